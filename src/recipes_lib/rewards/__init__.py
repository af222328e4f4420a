"""Rewards for online RL: built-in verifiable reward functions, a trained reward model
as a reward (:mod:`recipes_lib.rewards.model`) and the registry that builds a run's
``grpo.rewards`` (:mod:`recipes_lib.rewards.registry`)."""

from recipes_lib.rewards.functions import (
    defines_function,
    exact_match,
    format_match,
    function_header,
    python_syntax,
    unit_tests,
)
from recipes_lib.rewards.model import RewardModelScore
from recipes_lib.rewards.registry import Reward, build_rewards, score_completions

__all__ = [
    "Reward",
    "RewardModelScore",
    "build_rewards",
    "defines_function",
    "exact_match",
    "format_match",
    "function_header",
    "python_syntax",
    "score_completions",
    "unit_tests",
]
