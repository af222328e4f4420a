"""Direct preference optimisation: the ``dpo`` objective, pairs against a frozen reference.

The policy's and the reference's summed log-probs of each pair's chosen and rejected
responses feed ``stage.dpo.loss``: ``sigmoid`` (DPO), ``ipo`` or ``hinge``, at inverse
temperature ``stage.dpo.beta`` (:mod:`recipes_lib.losses.preference`). The module is
:class:`~recipes_lib.objectives.preference.PreferenceModule`; the reference
(``stage.dpo.reference_from``, else the starting weights; precomputed with
``stage.dpo.precompute_reference``) is :class:`~recipes_lib.objectives.pairs.PairedReference`.
Batches: :mod:`recipes_lib.data.preference.collate`'s pairs.
"""

from __future__ import annotations

from typing import Any

from recipes_lib.config.schema import RunConfig
from recipes_lib.data.preference.module import build_preference_data
from recipes_lib.objectives.pairs import reference_models
from recipes_lib.objectives.preference import PreferenceModule
from recipes_lib.objectives.registry import (
    FrozenModel,
    ObjectiveSpec,
    register_objective,
    shapes_vary,
)
from recipes_lib.objectives.settings import DPOSettings

PAIR_BATCH = (
    "input_ids, labels (B, T) of both sequences of every pair; sequence_ids (B, T): pair j's "
    "chosen tokens j, its rejected ones P + j, padding -1; pair_index (P,); reference_logps "
    "(P, 2) when precomputed"
)


def dpo_module(cfg: RunConfig, **kwargs: Any) -> PreferenceModule:
    return PreferenceModule.from_run_config(cfg, objective="dpo", **kwargs)  # type: ignore[return-value]


def _reference(cfg: RunConfig, settings: DPOSettings) -> tuple[FrozenModel, ...]:
    return reference_models(cfg, settings.reference_from, settings.precompute_reference)


DPO = register_objective(
    ObjectiveSpec(
        name="dpo",
        module=dpo_module,
        data=build_preference_data,
        batch=PAIR_BATCH,
        loss="dpo_sigmoid_loss | ipo_loss | hinge_loss",
        settings=DPOSettings,
        sequences_per_example=2,
        example_noun="pairs",
        batches_vary=shapes_vary,
        frozen_models=_reference,
        context_parallel=True,
    )
)
