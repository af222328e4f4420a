"""The rewards of a run: ``grpo.rewards``, a mapping of names to rewards.

Each reward is a ``weight`` in the total and a function node ``fn``: a ``_target_`` (one
of the declared :data:`REWARD_FUNCTIONS`, or your own under ``run.allowed_targets`` given
on the command line, built through the one
:func:`~recipes_lib.config.instantiate.instantiate`) with the function's settings::

    grpo:
      rewards:
        answer:
          weight: 1.0
          fn: {_target_: recipes_lib.rewards.exact_match, field: answer}
        shape:
          weight: 0.2
          fn: {_target_: recipes_lib.rewards.format_match, pattern: '\\d+'}

A function is called as ``fn(completion, record, **settings)`` and must return a finite
number; one that raises or returns anything else stops the run with a
:class:`~recipes_lib.errors.RewardError` naming it and the record.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recipes_lib.config.instantiate import TARGET_KEY, TargetKind, instantiate
from recipes_lib.errors import ConfigError, RecipesError, RewardError
from recipes_lib.rewards.functions import (
    defines_function,
    exact_match,
    format_match,
    function_header,
    python_syntax,
    unit_tests,
)
from recipes_lib.rewards.model import RewardModelScore

WEIGHT_KEY, FN_KEY = "weight", "fn"

# The functions a config may name as a reward. Declared one by one: the package holds
# helpers too, and a reward is built with its settings bound, never called at build.
REWARD_FUNCTIONS = (
    exact_match,
    format_match,
    python_syntax,
    defines_function,
    function_header,
    unit_tests,
    RewardModelScore,
)
REWARDS = TargetKind(
    "reward function",
    ("recipes_lib.rewards.",),
    lambda obj: any(obj is fn for fn in REWARD_FUNCTIONS),
    "the functions of recipes_lib.rewards.registry.REWARD_FUNCTIONS",
)


@dataclass(frozen=True)
class Reward:
    """One reward of a run: its name in ``grpo.rewards``, the bound function, its weight."""

    name: str
    fn: Callable[[str, Mapping[str, Any]], Any]
    weight: float


def build_rewards(
    nodes: Mapping[str, Any], extra_prefixes: Sequence[str] | None = None
) -> list[Reward]:
    """The rewards ``grpo.rewards`` describes (``null`` entries are left out).

    Raises:
        ConfigError: no reward, a reward without ``fn`` or with another key, a target
            outside the allowlist, a setting the function does not take, or a weight
            that is not a finite number.
    """
    rewards = []
    for name, node in (nodes or {}).items():
        if node is None:
            continue
        key = f"grpo.rewards.{name}"
        unknown = sorted(set(node) - {WEIGHT_KEY, FN_KEY}) if isinstance(node, Mapping) else []
        if not isinstance(node, Mapping) or FN_KEY not in node or unknown:
            found = f": unknown key {unknown[0]!r}" if unknown else ""
            raise ConfigError(
                f"{key}: a reward is {{weight: <number>, fn: {{{TARGET_KEY}: <function>, "
                f"<its settings>}}}}{found}"
            )
        weight = node.get(WEIGHT_KEY, 1.0)
        real = isinstance(weight, numbers.Real) and not isinstance(weight, bool)
        if not (real and math.isfinite(weight)):
            raise ConfigError(f"{key}.weight={weight!r} must be a finite number")
        fn = node[FN_KEY]
        if not isinstance(fn, Mapping) or TARGET_KEY not in fn:
            raise ConfigError(f"{key}.fn: expected a node with a {TARGET_KEY!r}, got {fn!r}")
        rewards.append(Reward(name, _build(fn, f"{key}.fn", extra_prefixes), float(weight)))
    if not rewards:
        raise ConfigError("grpo.rewards is empty: name at least one reward function")
    return rewards


def _build(fn: Mapping[str, Any], key: str, extra_prefixes: Sequence[str] | None) -> Callable:
    """The reward function a node names, its settings bound; a class (a reward that
    loads something, as :class:`~recipes_lib.rewards.model.RewardModelScore`) is
    built once with them, and its instance is the function."""
    built = instantiate({**fn, "_partial_": True}, key, REWARDS, extra_prefixes)
    if isinstance(built, functools.partial) and inspect.isclass(built.func):
        try:
            return built()
        except RecipesError as err:
            raise type(err)(f"{key}: {err}") from err
    return built


def _value(reward: Reward, completion: str, record: Mapping[str, Any], where: str) -> float:
    try:
        value = reward.fn(completion, record)
    except Exception as err:  # noqa: BLE001 - any failure of user code is reported as one line
        raise RewardError(
            f"grpo.rewards.{reward.name} raised {type(err).__name__}: {err} ({where})"
        ) from err
    number = value
    if isinstance(value, Tensor):  # a one-element tensor
        number = value.item() if value.numel() == 1 else value
    elif callable(getattr(value, "item", None)) and getattr(value, "size", None) == 1:
        number = value.item()  # a NumPy scalar or one-element array
    if isinstance(number, bool):
        number = float(number)
    if not isinstance(number, numbers.Real) or not math.isfinite(float(number)):
        raise RewardError(
            f"grpo.rewards.{reward.name} returned {value!r}, not a finite number ({where})"
        )
    return float(number)


def score_completions(
    rewards: Sequence[Reward],
    completions: Sequence[str],
    records: Sequence[Mapping[str, Any]],
    where: Sequence[str],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Each completion's weighted total reward ``(N,)`` and each reward's own values.

    Args:
        rewards: the run's rewards.
        completions: the sampled texts.
        records: each completion's prompt record.
        where: how errors name each completion's record (its file and line).

    Raises:
        RewardError: a function raised or returned something other than a finite number.
    """
    values = {
        reward.name: torch.tensor(
            [_value(reward, c, r, w) for c, r, w in zip(completions, records, where, strict=True)],
            dtype=torch.float32,
        )
        for reward in rewards
    }
    total = torch.zeros(len(completions), dtype=torch.float32)
    for reward in rewards:
        total += reward.weight * values[reward.name]
    return total, values
