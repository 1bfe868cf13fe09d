"""The MoE serving tax (the paper Demystifying the MoE Serving Tax): an analytical model (at 100 % of the peaks,
and calibrated per GPU), padding, balls-bins-buckets simulation, communication volumes, expert load balancing,
and a report.

    from moekit.tax import TaxModel, tax_report
    print(tax_report("mixtral-8x7b", "H200"))

See docs/tax.md for the equations as implemented.
"""

from .bbb import (FIG10_CONFIGS, BBBConfig, LoadStats, bbb_bounds, expert_counts, figure10_data, loads_from_counts,
                  simulate)
from .comm import (
    allreduce_time,
    alltoall_time,
    api_volume_ratio,
    network_volume_ratio,
    network_volumes,
    token_sources,
    traffic,
)
from .eplb import (
    balanced_packing,
    compare_balancers,
    eplb_placement,
    evaluate_placement,
    padding_aware_placement,
    replicate_experts,
)
from .calibrated import CalibratedBlocks
from .efficiency import (Calibration, Curve, LaunchCost, RouterCost, StreamCost, adapt_calibration,
                         load_calibration, nearest_calibration, save_calibration)
from .hardware import PRESETS as HARDWARE_PRESETS
from .hardware import Hardware, get_hardware, gpu_key, load_hardware, with_overrides
from .model import (
    PARALLELISMS,
    PHASES,
    REGIMES,
    AttentionSpec,
    TaxModel,
    TaxPoint,
    UnitCosts,
    attention_spec,
    compare,
    format_compare,
    rebatch,
    tax_shape,
    unit_costs,
)
from .padding import (
    active_experts,
    eta,
    expected_active_experts,
    expected_eta,
    expected_padded_work,
    max_load_bounds,
    padded_work,
    round_up,
)
from .placement import Placement, assignment_gpus
from .report import tax_report
from .topk import as_topk_array, sample_routing, zipf_popularity

__all__ = [
    # model
    "TaxModel", "TaxPoint", "UnitCosts", "unit_costs", "AttentionSpec", "attention_spec",
    "compare", "format_compare", "rebatch", "tax_shape", "PARALLELISMS", "PHASES", "REGIMES",
    # hardware
    "Hardware", "HARDWARE_PRESETS", "get_hardware", "load_hardware", "with_overrides", "gpu_key",
    # the calibrated model
    "Calibration", "Curve", "LaunchCost", "StreamCost", "RouterCost", "CalibratedBlocks", "load_calibration",
    "save_calibration", "adapt_calibration", "nearest_calibration",
    # padding and activation
    "round_up", "padded_work", "eta", "active_experts", "expected_active_experts",
    "expected_padded_work", "expected_eta", "max_load_bounds",
    # balls-bins-buckets
    "Placement", "LoadStats", "simulate", "loads_from_counts", "sample_routing",
    "zipf_popularity", "as_topk_array", "expert_counts", "assignment_gpus", "bbb_bounds",
    "BBBConfig", "FIG10_CONFIGS", "figure10_data",
    # communication
    "api_volume_ratio", "network_volume_ratio", "network_volumes", "traffic",
    "token_sources", "alltoall_time", "allreduce_time",
    # load balancing
    "replicate_experts", "balanced_packing", "eplb_placement", "padding_aware_placement",
    "evaluate_placement", "compare_balancers",
    # report
    "tax_report",
]
