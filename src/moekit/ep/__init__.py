"""Expert parallelism: the Dispatcher protocol, placements, local launches and dispatchers."""

from moekit.ep.alltoall import AllToAllDispatcher
from moekit.ep.capacity import calibrate_capacity, max_counts_capacity
from moekit.ep.capspill import CapacityOverflowError, CapAndSpillDispatcher, MaxCountsDispatcher
from moekit.ep.dispatcher import (COMBINE_ORDERS, Dispatched, DispatchHandle, Dispatcher, validate_routing,
                                  weighted_rank_sum, weighted_slot_sum)
from moekit.ep.group import RankFailedError, current_device, default_backend, launch
from moekit.ep.layout import ExpertPlacement
from moekit.ep.lowlatency import EPLowLatencyAllToAll  # needs neither CUDA nor Triton to import
from moekit.ep.peers import PeerError

__all__ = [
    "COMBINE_ORDERS", "AllToAllDispatcher", "CapAndSpillDispatcher", "EPLowLatencyAllToAll", "CapacityOverflowError",
    "MaxCountsDispatcher",
    "calibrate_capacity", "max_counts_capacity", "Dispatched", "DispatchHandle", "Dispatcher", "ExpertPlacement",
    "PeerError", "RankFailedError", "current_device", "default_backend", "launch", "validate_routing",
    "weighted_rank_sum", "weighted_slot_sum",
]
