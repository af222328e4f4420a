"""Rewards for online RL: built-in verifiable reward functions and the registry that
builds a run's ``grpo.rewards`` (:mod:`recipes_lib.rewards.registry`)."""

from recipes_lib.rewards.functions import (
    defines_function,
    exact_match,
    format_match,
    python_syntax,
    unit_tests,
)
from recipes_lib.rewards.registry import Reward, build_rewards, score_completions

__all__ = [
    "Reward",
    "build_rewards",
    "defines_function",
    "exact_match",
    "format_match",
    "python_syntax",
    "score_completions",
    "unit_tests",
]
