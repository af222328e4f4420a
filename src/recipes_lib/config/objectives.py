"""The settings of the post-training objectives beyond the data and the model:
``preference.*`` (objectives ``dpo`` and ``kto``), ``reward.*`` (objective ``reward``),
``distill.*`` (objective ``distill``) and ``grpo.*`` (objective ``grpo``). Re-exported by
:mod:`recipes_lib.config.schema`, whose ``RunConfig`` holds them as groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PreferenceConfig:
    """Preference optimisation on pairs (objective ``dpo``): against a frozen reference
    (``sigmoid``, DPO; ``ipo``; ``hinge``) or without one (``simpo``, ``orpo``); on
    unpaired desirable and undesirable completions (objective ``kto``, loss ``kto``)."""

    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge | simpo | orpo; kto (objective kto)
    # DPO's and KTO's inverse temperature; SimPO's reward scale; ORPO's odds-ratio weight
    beta: float = 0.1
    gamma: float = 0.5  # SimPO's target reward margin (unused by the other losses)
    desirable_weight: float = 1.0  # KTO's lambda_D
    undesirable_weight: float = 1.0  # KTO's lambda_U
    reference_from: str | None = None  # weights of the frozen reference; None: init_from
    precompute_reference: bool = False  # one pass of reference log-probs, then free it


@dataclass
class DistillConfig:
    """Distillation (objective ``distill``): the student learns a teacher's next-token
    distributions on SFT data (``loss``: ``forward_kl`` | ``jsd``, GKD's generalised
    Jensen-Shannon with ``beta``), both at ``temperature``."""

    teacher_from: str | None = None  # any weights stage.init_from takes; same vocabulary
    loss: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0


@dataclass
class RewardConfig:
    """A reward model (objective ``reward``, ``model.head=score``) trained with the
    Bradley-Terry loss on preference pairs (:mod:`recipes_lib.losses.reward`)."""

    # weight of mean((r_chosen + r_rejected)^2), which keeps the scores centred on 0
    center_coef: float = 0.0


@dataclass
class GRPOConfig:
    """Online RL with verifiable rewards (objective ``grpo``; recipes_lib.objectives.grpo):
    ``completions_per_prompt`` samples of each prompt, scored by ``rewards`` (see
    recipes_lib.rewards.registry), their group-normalised advantages, and the clipped
    objective (recipes_lib.losses.rl) over ``updates_per_batch`` optimizer steps."""

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
