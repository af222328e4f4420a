"""SimPO: the ``simpo`` objective, preference pairs without a reference.

The policy's mean log-prob per response token of the chosen and rejected answers,
scaled by ``stage.simpo.beta``, against a target margin ``stage.simpo.gamma``
(:func:`~recipes_lib.losses.preference.simpo_loss`). No reference model is built. The
module is :class:`~recipes_lib.objectives.preference.PreferenceModule`, on DPO's pairs.
"""

from __future__ import annotations

from typing import Any

from recipes_lib.config.schema import RunConfig
from recipes_lib.data.preference.module import build_preference_data
from recipes_lib.objectives.dpo import PAIR_BATCH
from recipes_lib.objectives.preference import PreferenceModule
from recipes_lib.objectives.registry import ObjectiveSpec, register_objective, shapes_vary
from recipes_lib.objectives.settings import SimPOSettings


def simpo_module(cfg: RunConfig, **kwargs: Any) -> PreferenceModule:
    return PreferenceModule.from_run_config(cfg, objective="simpo", **kwargs)  # type: ignore[return-value]


SIMPO = register_objective(
    ObjectiveSpec(
        name="simpo",
        module=simpo_module,
        data=build_preference_data,
        batch=PAIR_BATCH,
        loss="simpo_loss",
        settings=SimPOSettings,
        sequences_per_example=2,
        example_noun="pairs",
        batches_vary=shapes_vary,
        context_parallel=True,
    )
)
