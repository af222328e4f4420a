"""The pre-launch check (``recipes-check``, or ``recipes-train ... run.launch_check=true``):
what a run will need and whether it can start, before it does.

:func:`check_launch` runs the checks (:mod:`.check`) and returns their rows;
:func:`estimate_memory` (:mod:`.memory`), :func:`token_budget` and :func:`step_time`
(:mod:`.budget`) are the figures behind them, usable on their own.
"""

from recipes_lib.launch_check.budget import StepTime, TokenBudget, step_time, token_budget
from recipes_lib.launch_check.check import CheckRow, LaunchReport, check_launch, print_report
from recipes_lib.launch_check.memory import MemoryEstimate, estimate_memory

__all__ = [
    "CheckRow",
    "LaunchReport",
    "MemoryEstimate",
    "StepTime",
    "TokenBudget",
    "check_launch",
    "estimate_memory",
    "print_report",
    "step_time",
    "token_budget",
]
