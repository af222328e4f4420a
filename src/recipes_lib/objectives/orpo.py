"""ORPO: the ``orpo`` objective, preference pairs without a reference.

The chosen answers' negative log-likelihood plus ``stage.orpo.odds_ratio_weight`` (ORPO's
lambda) times the odds-ratio term (:func:`~recipes_lib.losses.preference.orpo_loss`). No
reference model is built, so it can start from pretrained weights without an SFT stage.
The module is :class:`~recipes_lib.objectives.preference.PreferenceModule`, on DPO's pairs.
"""

from __future__ import annotations

from typing import Any

from recipes_lib.config.schema import RunConfig
from recipes_lib.data.preference.module import build_preference_data
from recipes_lib.objectives.dpo import PAIR_BATCH
from recipes_lib.objectives.preference import PreferenceModule
from recipes_lib.objectives.registry import ObjectiveSpec, register_objective, shapes_vary
from recipes_lib.objectives.settings import ORPOSettings


def orpo_module(cfg: RunConfig, **kwargs: Any) -> PreferenceModule:
    return PreferenceModule.from_run_config(cfg, objective="orpo", **kwargs)  # type: ignore[return-value]


ORPO = register_objective(
    ObjectiveSpec(
        name="orpo",
        module=orpo_module,
        data=build_preference_data,
        batch=PAIR_BATCH,
        loss="orpo_loss",
        settings=ORPOSettings,
        sequences_per_example=2,
        example_noun="pairs",
        batches_vary=shapes_vary,
        context_parallel=True,
    )
)
