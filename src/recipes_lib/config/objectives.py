"""The settings of the post-training objectives beyond the data and the model:
``preference.*`` (objectives ``dpo`` and ``kto``), ``reward.*`` (objective ``reward``)
and ``distill.*`` (objective ``distill``). Re-exported by
:mod:`recipes_lib.config.schema`, whose ``RunConfig`` holds them as groups.
"""

from __future__ import annotations

from dataclasses import dataclass


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
