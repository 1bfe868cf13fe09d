"""Expert parallelism: the Dispatcher protocol, placements, local launches and dispatchers."""

from moekit.ep.alltoall import AllToAllDispatcher
from moekit.ep.dispatcher import Dispatched, DispatchHandle, Dispatcher, validate_routing, weighted_slot_sum
from moekit.ep.group import current_device, default_backend, launch
from moekit.ep.layout import ExpertPlacement

__all__ = [
    "AllToAllDispatcher", "Dispatched", "DispatchHandle", "Dispatcher", "ExpertPlacement",
    "current_device", "default_backend", "launch", "validate_routing", "weighted_slot_sum",
]
