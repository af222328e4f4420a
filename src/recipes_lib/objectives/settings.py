"""What each built-in objective reads under ``stage.<objective>``: its settings dataclass.

The run schema types ``stage.dpo`` and its neighbours from these classes
(:mod:`recipes_lib.config.objectives`), so composing a config, ``--cfg job`` and every
refused override read them without the objectives' modules. This module therefore
imports neither torch nor Lightning; each objective's module names its class in its
:class:`~recipes_lib.objectives.registry.ObjectiveSpec`. The checks that need only a
setting's own value are here; those that need a tensor library or a checkpoint stay in
the objective's module (``check_grpo``, ``check_distill``).

Importing this module declares each class to the schema under its objective's name
(:func:`~recipes_lib.config.objectives.declare_settings`); registering the spec declares
the same class under the same name, and one class declared under two names is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recipes_lib.config.objectives import declare_settings
from recipes_lib.errors import ConfigError

if TYPE_CHECKING:
    from recipes_lib.objectives.preference import PairLoss

DPO_LOSSES = ("sigmoid", "ipo", "hinge")


def _pair_loss(name: str, beta: float, gamma: float = 0.0) -> PairLoss:
    """The preference loss called ``name`` with its coefficients (imported only now: the
    losses import torch)."""
    from recipes_lib.losses.preference import PREFERENCE_LOSSES
    from recipes_lib.objectives.preference import PairLoss

    return PairLoss(PREFERENCE_LOSSES[name], beta, gamma)


@dataclass
class DPOSettings:
    """``stage.dpo``: the loss against the reference and its inverse temperature."""

    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge
    beta: float = 0.1  # inverse temperature of the policy-reference log-ratios
    reference_from: str | None = None  # weights of the frozen reference; None: init_from
    precompute_reference: bool = False  # one pass of reference log-probs, then free it

    def pair_loss(self) -> PairLoss:
        """The loss and its coefficient.

        Raises:
            ConfigError: a loss other than DPO's, or a non-positive beta.
        """
        if self.loss not in DPO_LOSSES:
            raise ConfigError(f"stage.dpo.loss={self.loss!r} is not one of {list(DPO_LOSSES)}")
        if not self.beta > 0:
            raise ConfigError(f"stage.dpo.beta={self.beta} must be positive")
        return _pair_loss(self.loss, self.beta)


@dataclass
class SimPOSettings:
    """``stage.simpo``: the reward scale and the target margin."""

    beta: float = 2.0  # scale of the mean log-prob rewards
    gamma: float = 1.0  # target reward margin between chosen and rejected

    def pair_loss(self) -> PairLoss:
        """SimPO's loss with its coefficients.

        Raises:
            ConfigError: a non-positive beta.
        """
        if not self.beta > 0:
            raise ConfigError(f"stage.simpo.beta={self.beta} must be positive")
        return _pair_loss("simpo", self.beta, self.gamma)


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
        return _pair_loss("orpo", self.odds_ratio_weight)


@dataclass
class KTOSettings:
    """``stage.kto``: the inverse temperature, each kind's weight and the reference."""

    beta: float = 0.1  # inverse temperature of the policy-reference log-ratios
    desirable_weight: float = 1.0  # lambda_D
    undesirable_weight: float = 1.0  # lambda_U: raise it when undesirable examples are rarer
    reference_from: str | None = None  # weights of the frozen reference; None: init_from
    precompute_reference: bool = False  # one pass of reference log-probs, then free it

    def check(self) -> None:
        """Raises ConfigError: a non-positive beta or a negative weight."""
        if not self.beta > 0:
            raise ConfigError(f"stage.kto.beta={self.beta} must be positive")
        for key in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"stage.kto.{key}={getattr(self, key)} must be >= 0")


@dataclass
class RewardSettings:
    """``stage.reward``: the Bradley-Terry loss's centring term."""

    # weight of mean((r_chosen + r_rejected)^2), which keeps the scores centred on 0
    center_coef: float = 0.0


@dataclass
class DistillSettings:
    """``stage.distill``: the student learns a teacher's next-token distributions on SFT
    data (``loss``: ``forward_kl`` | ``jsd``, GKD's generalised Jensen-Shannon with
    ``beta``), both at ``temperature``."""

    teacher_from: str | None = None  # any weights stage.init_from takes; same vocabulary
    loss: str = "forward_kl"
    beta: float = 0.5  # jsd: near 0 like the forward KL, near 1 like the reverse KL
    temperature: float = 1.0  # both distributions' (the loss scales by its square)


@dataclass
class GRPOSettings:
    """``stage.grpo``: ``completions_per_prompt`` samples of each prompt, scored by
    ``rewards`` (see recipes_lib.rewards.registry), their group-normalised advantages,
    and the clipped objective (recipes_lib.losses.rl) over ``updates_per_batch``
    optimizer steps."""

    completions_per_prompt: int = 4  # the group size k
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    updates_per_batch: int = 1  # optimizer steps on one batch of completions (mu)
    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float | None = None  # None: clip_low (DAPO raises it, e.g. 0.28)
    kl_coef: float = 0.0  # beta of the KL to the frozen reference (the starting weights)
    loss_norm: str = "sequence"  # sequence | token | dr_grpo
    scale_rewards: bool = True  # divide advantages by their group's std (false: Dr. GRPO)
    # name -> {weight: float, fn: {_target_: <function>, <its settings>}}
    rewards: dict[str, Any] = field(default_factory=dict)


BUILTIN_SETTINGS: dict[str, type] = {
    "distill": DistillSettings,
    "dpo": DPOSettings,
    "grpo": GRPOSettings,
    "kto": KTOSettings,
    "orpo": ORPOSettings,
    "reward": RewardSettings,
    "simpo": SimPOSettings,
}
for _name, _settings in BUILTIN_SETTINGS.items():
    declare_settings(_name, _settings)
