"""DICE: staleness-aware asynchronous expert parallelism for diffusion MoE models (DiT-MoE).

* :mod:`moekit.dice.dit_moe` — the DiT-MoE model (presets dit-moe-s/-b/-xl/-g);
* :mod:`moekit.dice.sampler` — rectified-flow training loss and Euler sampler with guidance;
* :mod:`moekit.dice.schedules` — sync / displaced / interweaved, selective synchronization,
  warm-up / cool-down / periodic sync, conditional communication, stale / latest scores;
* :mod:`moekit.dice.runner` — the schedules over any moekit Dispatcher;
* :mod:`moekit.dice.executor` — in-order, side-stream (no thread) or worker-thread transfers;
* :mod:`moekit.dice.stale` — the fixed-capacity exchange that never reads the host;
* :mod:`moekit.dice.graphs` — a schedule's steady steps replayed from CUDA graphs;
* :mod:`moekit.dice.simulator` — the exact single-process staleness simulator;
* :mod:`moekit.dice.accounting` — bytes per step, buffer memory, the speedup model;
* :mod:`moekit.dice.measure` — measured ms per denoising step on real ranks (``moekit dice step``),
  :mod:`moekit.dice.overlap` — how much of a trace's communication ran beside compute,
  :mod:`moekit.dice.verdicts` — the best dispatcher of each schedule and the goals;
* :mod:`moekit.dice.quality`, :mod:`moekit.dice.train` — the digits recipe and its metrics.
"""

from moekit.dice.dit_moe import PRESETS, DiTMoE, DiTMoEConfig, digits_config, get_config
from moekit.dice.executor import AsyncExecutor, InlineExecutor, StreamExecutor, make_executor
from moekit.dice.runner import ScheduledMoE
from moekit.dice.sampler import rf_loss, sample
from moekit.dice.schedules import PRESET_NAMES, ScheduleConfig, SchedulePlan, preset
from moekit.dice.simulator import StalenessSimulator

__all__ = [
    "PRESETS", "PRESET_NAMES", "AsyncExecutor", "DiTMoE", "DiTMoEConfig", "InlineExecutor", "ScheduleConfig",
    "ScheduledMoE", "SchedulePlan", "StalenessSimulator", "StreamExecutor", "digits_config", "get_config", "make_executor", "preset",
    "rf_loss", "sample",
]
