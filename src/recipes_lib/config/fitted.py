"""Recipe defaults fitted to the model and the run.

A recipe meant for any model (``sft/full``, ``dpo/full``, ...) cannot know how many
positions the model has or how long the user will train. Its defaults are written as
resolvers, which take the recipe's value unless it does not fit:

    seq_len: ${fit_to_model:2048}   # 2048, or model.max_seq_len where it is smaller
    warmup: ${fit_to_run:20}        # 20, or a tenth of the run where that is smaller

A value set anywhere after the recipe (the command line, a pipeline stage) replaces the
resolver, so it is kept as written and refused by the pre-flight when it does not fit.
Each change is said in one log line.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

FIT_TO_MODEL = "fit_to_model"
FIT_TO_RUN = "fit_to_run"
RUN_FRACTION = 0.1  # the most of a run its default warmup may take


def fit_to_model(default: int, *, _root_: Any) -> int:
    """``data.seq_len``: ``default``, or the model's positions where there are fewer."""
    positions = int(_root_.model.max_seq_len)
    if default <= positions:
        return default
    log.info(
        "data.seq_len=%d: the recipe's %d is more than the model's %d positions "
        "(model.max_seq_len); set data.seq_len to choose another",
        positions,
        default,
        positions,
    )
    return positions


def fit_to_run(default: int, *, _root_: Any) -> int:
    """``scheduler.warmup``: ``default``, or a tenth of the run where that is less.

    The run's length is ``trainer.max_steps`` (``scheduler.unit=steps``) or
    ``stage.max_tokens`` (``unit=tokens``); a run counted otherwise keeps ``default``.
    """
    unit, max_tokens = _root_.scheduler.unit, _root_.stage.max_tokens
    if unit == "steps" and max_tokens is None:
        length, key = int(_root_.trainer.max_steps), "trainer.max_steps"
    elif unit == "tokens" and max_tokens is not None:
        length, key = int(max_tokens), "stage.max_tokens"
    else:
        return default
    cap = int(length * RUN_FRACTION)
    if length <= 0 or default <= cap:  # a run of no set length keeps the recipe's
        return default
    log.info(
        "scheduler.warmup=%d: the recipe's %d %s of warmup cut to a tenth of the run "
        "(%s=%d); set scheduler.warmup to choose another",
        cap,
        default,
        unit,
        key,
        length,
    )
    return cap


def register_fitted_resolvers() -> None:
    """Make ``${fit_to_model:N}`` and ``${fit_to_run:N}`` known to OmegaConf (once)."""
    for name, resolver in ((FIT_TO_MODEL, fit_to_model), (FIT_TO_RUN, fit_to_run)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
