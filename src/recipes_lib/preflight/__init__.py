"""The pre-flight: every check a run needs before data or weights are touched, once.

A single value is checked where it is consumed (a constructor checks its own arguments;
:mod:`recipes_lib.config.validate` the schema's plain numbers). What depends on two
keys, or on a key and this machine, is checked here, in this order, and the first
problem stops the run with one line naming the keys:

1. every ``_target_`` at any depth against what its key builds (before anything is
   imported; :mod:`recipes_lib.preflight.targets`);
2. the model against the weights ``stage.init_from`` holds (every difference at once;
   upcycling: a dense model);
3. the schema's single values (:func:`recipes_lib.config.validate.check_values`);
4. what the stage starts from and what it writes (``init_optimizer``, ``ckpt_path``,
   ``average_last_k`` / ``ema_decay``);
5. the output head against the objective (a score head is the reward objective's);
6. the data against the model (sequence length, a new tokenizer's vocabulary) and the
   attention kernel (document masking);
7. the adapter, the precision and the strategy on this machine;
8. the training guard and the batch ramp against the strategy;
9. the objective's own rules (its spec's ``check``: GRPO's rollouts, distillation's head).

Domains declare what they support (:class:`~recipes_lib.parallel.StrategySpec`,
:class:`~recipes_lib.kernels.AttentionCapabilities`,
:class:`~recipes_lib.objectives.ObjectiveSpec`); these checks read those declarations
instead of comparing names.
"""

from __future__ import annotations

from recipes_lib.config.schema import RunConfig
from recipes_lib.config.validate import check_values
from recipes_lib.preflight.devices import (
    check_expert_parallel,
    check_optimizer_choice,
    check_precision,
    check_strategy,
)
from recipes_lib.preflight.stage import (
    check_adapter,
    check_batch_ramp,
    check_data_and_kernels,
    check_guard,
    check_head,
    check_init_source,
    check_objective,
    check_stage_io,
)
from recipes_lib.preflight.targets import check_run_targets


def check_run(cfg: RunConfig, objectives: tuple[str, ...], *, init_written: bool = True) -> None:
    """Every check of a run, in the order of the module docstring.

    Args:
        cfg: the typed run config (``precision=auto`` and ``kernels.compile=null``
            already resolved for the device).
        objectives: the objectives a LightningModule exists for (``stage.objective``).
        init_written: False where ``stage.init_from`` is not written yet (a pipeline's
            plan, before the stage it comes from has trained): it is not read, and the
            plan checks the model against the source stage's instead.

    Raises:
        ConfigError: the first problem found, naming its keys.
        CheckpointError: ``stage.init_from`` is missing or unreadable.
    """
    check_run_targets(cfg)
    if init_written:
        check_init_source(cfg)
    check_values(cfg, objectives)
    check_stage_io(cfg)
    check_head(cfg)
    check_data_and_kernels(cfg)
    check_adapter(cfg)
    check_precision(cfg)
    check_strategy(cfg)
    check_guard(cfg)
    check_batch_ramp(cfg)
    check_objective(cfg)


__all__ = [
    "check_adapter",
    "check_batch_ramp",
    "check_data_and_kernels",
    "check_expert_parallel",
    "check_guard",
    "check_head",
    "check_init_source",
    "check_objective",
    "check_optimizer_choice",
    "check_precision",
    "check_run",
    "check_stage_io",
    "check_strategy",
]
