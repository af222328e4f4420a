"""ORPO: the ``orpo`` objective, preference pairs without a reference.

The chosen answers' negative log-likelihood plus ``stage.orpo.odds_ratio_weight`` (ORPO's
lambda) times the odds-ratio term (:func:`~recipes_lib.losses.preference.orpo_loss`). No
reference model is built, so it can start from pretrained weights without an SFT stage.
The module is :class:`~recipes_lib.objectives.preference.PreferenceModule`, on DPO's pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recipes_lib.config.schema import RunConfig
from recipes_lib.data.preference.module import build_preference_data
from recipes_lib.errors import ConfigError
from recipes_lib.losses.preference import PREFERENCE_LOSSES
from recipes_lib.objectives.dpo import PAIR_BATCH
from recipes_lib.objectives.preference import PairLoss, PreferenceModule
from recipes_lib.objectives.registry import ObjectiveSpec, register_objective, shapes_vary


@dataclass
class ORPOSettings:
    """``stage.orpo``: the weight of the odds-ratio term beside the chosen answers' NLL."""

    odds_ratio_weight: float = 0.1

    def pair_loss(self) -> PairLoss:
        """ORPO's loss with its weight.

        Raises:
            ConfigError: a non-positive weight.
        """
        if not self.odds_ratio_weight > 0:
            raise ConfigError(
                f"stage.orpo.odds_ratio_weight={self.odds_ratio_weight} must be positive"
            )
        return PairLoss(PREFERENCE_LOSSES["orpo"], self.odds_ratio_weight)


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
    )
)
