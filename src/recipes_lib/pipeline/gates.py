"""A stage's evaluation and gates: what it measures after training, and what it must reach.

A stage's YAML may add::

    evaluate:                       # after the stage (an eval stage: instead of training)
      tasks: [stdlib_bodies]        # as recipes-eval's tasks
      limit: 100
    gates:                          # checked once the stage is done; one failing stops
      eval/stdlib_bodies/acc: ">= 0.30"        # the pipeline, naming it
      val/loss: "<= from"                      # against the stage it started from
      eval/stdlib_bodies/acc_norm: ">= from - 0.02"

A gate reads a metric of the stage: ``eval/<task>/<metric>`` of its evaluation, or a
``val/...`` or ``train/...`` value it logged last. Its condition is a comparison
(``>=``, ``>``, ``<=``, ``<``) with a number or with ``from`` (the same metric of the
weights the stage started from, optionally plus or minus a number). ``from`` is, for a
held-out ``val/...`` metric the stage logged at its first step (``ValidateAtStart``:
its starting weights on its own held-out data), that value; otherwise the source
stage's value, so the source must produce the metric too.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from recipes_lib.errors import ConfigError
from recipes_lib.evaluation.settings import METRIC_PREFIX, EvalSettings

EVALUATE_KEYS = (
    "tasks",
    "task_dirs",
    "limit",
    "batch_size",
    "batch_tokens",
    "num_fewshot",
    "chat_template",
)
METRIC_ROOTS = (METRIC_PREFIX, "val", "train")
_OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
    "<": operator.lt,
}
_NUMBER = r"(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"
_CONDITION = re.compile(
    rf"^\s*(>=|<=|>|<)\s*(?:(?P<number>[-+]?{_NUMBER})|from\s*"
    rf"(?:(?P<sign>[-+])\s*(?P<offset>{_NUMBER}))?)\s*$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Gate:
    """``metric`` must satisfy ``op`` against ``threshold``, or against the source's
    value plus ``offset`` when ``from_source``."""

    metric: str
    condition: str
    op: str
    threshold: float | None = None
    from_source: bool = False
    offset: float = 0.0

    def target(self, source_value: float | None) -> float:
        if not self.from_source:
            assert self.threshold is not None
            return self.threshold
        assert source_value is not None
        return source_value + self.offset

    def passes(self, value: float, source_value: float | None = None) -> bool:
        return _OPERATORS[self.op](value, self.target(source_value))


def parse_gates(node: Any, key: str) -> tuple[Gate, ...]:
    """A stage's ``gates`` mapping (metric -> condition) as :class:`Gate` s.

    Raises:
        ConfigError: naming ``<key>.<metric>`` for a metric outside ``eval/``, ``val/``
            and ``train/`` or a condition that does not read as one.
    """
    if node is None:
        return ()
    if not isinstance(node, Mapping):
        raise ConfigError(f"{key} must map metrics to conditions, e.g. {{val/loss: '<= from'}}")
    gates = []
    for metric, condition in node.items():
        where = f"{key}.{metric}"
        if not isinstance(metric, str) or metric.split("/")[0] not in METRIC_ROOTS:
            raise ConfigError(
                f"{where}: a gate reads eval/<task>/<metric>, val/<name> or train/<name>"
            )
        if metric.startswith(f"{METRIC_PREFIX}/") and metric.count("/") != 2:
            raise ConfigError(f"{where}: an evaluation metric reads eval/<task>/<metric>")
        match = _CONDITION.match(str(condition))
        if match is None:
            raise ConfigError(
                f"{where}={condition!r}: a condition reads '<op> <number>' or '<op> from' "
                "(optionally '<op> from - <number>'), with <op> one of >=, >, <=, <"
            )
        op = match.group(1)
        if match.group("number") is not None:
            gates.append(Gate(metric, str(condition), op, threshold=float(match.group("number"))))
        else:
            offset = float(match.group("offset") or 0.0)
            offset = -offset if match.group("sign") == "-" else offset
            gates.append(Gate(metric, str(condition), op, from_source=True, offset=offset))
    return tuple(gates)


def parse_evaluate(node: Any, key: str) -> EvalSettings | None:
    """A stage's ``evaluate`` mapping as :class:`EvalSettings` (None when absent).

    Raises:
        ConfigError: naming ``<key>.<field>`` for an unknown field or a bad value.
    """
    if node is None:
        return None
    if not isinstance(node, Mapping):
        raise ConfigError(f"{key} must be a mapping with at least tasks: [...]")
    unknown = sorted(set(node) - set(EVALUATE_KEYS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not one of: {', '.join(EVALUATE_KEYS)}")
    values = dict(node)
    for field in ("tasks", "task_dirs"):
        entries = values.get(field, [])
        if not isinstance(entries, list | tuple) or not all(isinstance(e, str) for e in entries):
            raise ConfigError(f"{key}.{field} must be a list of names or paths")
        values[field] = tuple(entries)
    if not values["tasks"]:
        raise ConfigError(f"{key}.tasks: name at least one task")
    for field in ("limit", "batch_size", "batch_tokens", "num_fewshot"):
        value = values.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{key}.{field}={value!r} must be a whole number")
    if not isinstance(values.get("chat_template", False), bool):
        raise ConfigError(f"{key}.chat_template must be true or false")
    try:
        return EvalSettings(**values)
    except ConfigError as err:
        raise ConfigError(f"{key}: {err}") from err


def settings_json(settings: EvalSettings | None) -> dict[str, Any] | None:
    return None if settings is None else asdict(settings)


# ------------------------------------------------------------------- checking
@dataclass(frozen=True)
class GateResult:
    """A gate checked: the stage's value, what it was compared with, and the outcome."""

    metric: str
    condition: str
    value: float
    target: float
    passed: bool
    source: str | None = None  # what ``from`` was: e.g. "stage pretrain"
    source_value: float | None = None

    def describe(self) -> str:
        versus = f" ({self.source}: {self.source_value:.4g})" if self.source else ""
        outcome = "passed" if self.passed else "FAILED"
        return f"{self.metric} {self.value:.4g} {self.condition.strip()}{versus}: {outcome}"


def check_gates(
    stage: str,
    gates: tuple[Gate, ...],
    values: Mapping[str, float],
    source_values: Mapping[str, float],
    source_label: str | None,
) -> list[GateResult]:
    """Check every gate of a finished stage (``values``: its metrics; ``source_values``:
    what ``from`` reads, per metric).

    Raises:
        ConfigError: a gate on a metric the stage (or, for ``from``, its source) did not
            produce, naming what it did produce.
    """
    results = []
    for gate in gates:
        if gate.metric not in values:
            produced = ", ".join(sorted(values)) or "none"
            raise ConfigError(
                f"stage {stage}: gate on {gate.metric}: the stage produced no such metric "
                f"(it has: {produced})"
            )
        source_value = None
        if gate.from_source:
            source_value = source_values.get(gate.metric)
            if source_value is None:
                raise ConfigError(
                    f"stage {stage}: gate {gate.metric} {gate.condition}: "
                    f"{source_label or 'its source'} has no {gate.metric} to compare with"
                )
        value = values[gate.metric]
        results.append(
            GateResult(
                gate.metric,
                gate.condition,
                value,
                gate.target(source_value),
                gate.passes(value, source_value),
                source_label if gate.from_source else None,
                source_value,
            )
        )
    return results
