"""Lightning callbacks of recipes-lib, importable as ``recipes_lib.callbacks``.

They depend only on lightning, torch, rich and the standard library, and read what
they need from the LightningModule by duck typing (``tokens_seen``,
``flops_per_token(seq_len)``); :class:`DownstreamEval` imports the scoring of
:mod:`recipes_lib.evaluation` when it is built.
"""

from recipes_lib.callbacks.downstream import DownstreamEval
from recipes_lib.callbacks.ema import WeightEMA
from recipes_lib.callbacks.gc import GarbageCollection
from recipes_lib.callbacks.monitors import GradNormMonitor, total_grad_norm
from recipes_lib.callbacks.preemption import EXIT_PREEMPTED, Preempted, Preemption
from recipes_lib.callbacks.progress import TokenProgressBar
from recipes_lib.callbacks.step import OptimizerStepCallback
from recipes_lib.callbacks.summary import ModelSizeSummary
from recipes_lib.callbacks.throughput import (
    PEAK_TFLOPS,
    ThroughputMonitor,
    peak_tflops_for,
    precision_arithmetic,
)
from recipes_lib.callbacks.validation import ValidateAtStart
from recipes_lib.callbacks.watchdog import EXIT_HUNG, HangWatchdog

__all__ = [
    "DownstreamEval",
    "EXIT_HUNG",
    "EXIT_PREEMPTED",
    "GarbageCollection",
    "PEAK_TFLOPS",
    "GradNormMonitor",
    "HangWatchdog",
    "ModelSizeSummary",
    "OptimizerStepCallback",
    "Preempted",
    "Preemption",
    "ThroughputMonitor",
    "TokenProgressBar",
    "ValidateAtStart",
    "WeightEMA",
    "peak_tflops_for",
    "precision_arithmetic",
    "total_grad_norm",
]
