"""Stage loss curves against the curves recorded per GPU card.

``tests/gpu/reference_losses.json`` maps a card name (``torch.cuda.get_device_name()``)
to each stage test's curve: ``train/loss`` per step, the final ``val/loss`` and
``recorded_with`` (Python, torch and the card's compute capability). The rules:

- every curve must be finite and fall (:func:`curve_problems`), recorded or not;
- a card with its own record is compared with it step by step, within ``SAME_CARD``;
- a card without one is compared with the nearest recorded card (:func:`find_reference`)
  on window means, within the wider ``OTHER_CARD``;
- no record on any card is not a failure: the curve is only checked to be finite and fall.

Pure Python (no torch), so the unit tests check these rules on CPU; the GPU tests in
``tests/gpu/test_stage_curves.py`` apply them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

REFERENCE = Path(__file__).parent / "gpu" / "reference_losses.json"


class LossReferenceWarning(UserWarning):
    """A stage curve was compared with another card's record, or with none."""


@dataclass(frozen=True)
class Band:
    """How far a curve may be from its record: ``abs_tol + rel_tol * |recorded|``, on
    means of ``window`` consecutive steps (1: step by step) and on the validation loss."""

    abs_tol: float
    rel_tol: float
    window: int

    def allows(self, got: float, want: float) -> bool:
        return abs(got - want) <= self.abs_tol + self.rel_tol * abs(want)

    def __str__(self) -> str:
        steps = "each step" if self.window == 1 else f"means of {self.window} steps"
        return f"{self.abs_tol} + {self.rel_tol} * |recorded| on {steps}"


# The same card, seed and data repeat the curve up to non-deterministic kernels (atomic
# adds in some backward passes): a few thousandths after 30 steps, so 0.02 + 0.5% per step
# (about 0.05 at a pretraining loss of 6, 0.023 at DPO's 0.65) is well above that jitter
# and still catches a changed schedule, loss or data order on the first steps it touches.
SAME_CARD = Band(abs_tol=0.02, rel_tol=0.005, window=1)
# Another card (another SM count, architecture or kernel choice) sums bf16 in another
# order, so its curve drifts from the record step by step even with the same batches.
# Window means average out that step-level jitter, while a regression (learning rate,
# loss masking, an adapter that does not train) shifts whole windows; 2% of the loss
# (0.15 at 6.4, 0.033 at DPO's 0.65) is four times the same-card relative term. Set before a
# second card was recorded: tests/unit/test_reference_curves.py checks that the recorded
# cards agree within it, so a record that drifts further says so.
OTHER_CARD = Band(abs_tol=0.02, rel_tol=0.02, window=5)

# Learning means the mean of the last quarter of the steps is below the mean of the
# first quarter by this share of the latter. The recorded H200 curves fall by 1.5% (LoRA
# SFT, which only trains small adapters on the tiny model), 7% (SFT), 10% (DPO) and
# 19-27% (pretraining) over 30 steps: 0.5% leaves the weakest three times the room, and
# a flat or rising curve (DPO that stays at log 2, an adapter without gradients) fails.
MIN_RELATIVE_FALL = 0.005


@dataclass(frozen=True)
class Reference:
    """The record a curve is compared with, and why that one."""

    card: str
    curve: dict
    band: Band
    relation: str

    def describe(self) -> str:
        return f"{self.card!r} ({self.relation}; recorded with {self.curve.get('recorded_with')})"


def curve_problems(curve: dict) -> list[str]:
    """What is wrong with ``curve`` on its own: non-finite losses, or no clear fall."""
    train = curve["train/loss"]
    values = {**{f"train/loss[{i}]": x for i, x in enumerate(train)}, "val/loss": curve["val/loss"]}
    bad = {key: x for key, x in values.items() if not math.isfinite(x)}
    if bad:
        return [f"losses not finite: {bad}"]
    if len(train) < 2:
        return [f"{len(train)} train/loss values: too few to tell whether it falls"]
    n = max(1, len(train) // 4)
    first, last = fmean(train[:n]), fmean(train[-n:])
    need = MIN_RELATIVE_FALL * abs(first)
    if not last < first - need:
        return [
            f"train/loss does not fall: the mean of the first {n} steps is {first:.4f}, of "
            f"the last {n} {last:.4f}; it must fall by at least {need:.4f} "
            f"({MIN_RELATIVE_FALL:.1%} of the first)"
        ]
    return []


def capability_of(record: dict) -> tuple[int, int] | None:
    """The compute capability a record was made on, as ``(major, minor)``, if stored."""
    text = record.get("recorded_with", {}).get("capability")
    if not text:
        return None
    major, minor = str(text).split(".")
    return int(major), int(minor)


def find_reference(
    records: dict, card: str, capability: tuple[int, int] | None, name: str
) -> Reference | None:
    """The record of test ``name`` to compare with on ``card``, or None when no card has one.

    This card's own record first. Failing that, the nearest card that has one: the same
    compute capability (an H100 and an H200 are both 9.0, Hopper), then
    the same architecture family (same major version, e.g. 8.0 and 8.9), then any, each
    by the smallest capability distance, then by name so the choice is stable. A record
    without a stored capability comes last.
    """
    own = records.get(card, {}).get(name)
    if own is not None:
        return Reference(card, own, SAME_CARD, "this card")
    candidates = [(other, tests[name]) for other, tests in records.items() if name in tests]
    if not candidates:
        return None

    def rank(candidate: tuple[str, dict]) -> tuple[int, float, str]:
        other, record = candidate
        theirs = capability_of(record)
        if theirs is None or capability is None:
            return 3, math.inf, other
        distance = abs((theirs[0] * 10 + theirs[1]) - (capability[0] * 10 + capability[1]))
        tier = 0 if theirs == capability else 1 if theirs[0] == capability[0] else 2
        return tier, distance, other

    other, record = min(candidates, key=rank)
    kind = ["same compute capability", "same architecture family", "another architecture"]
    tier = rank((other, record))[0]
    relation = (
        f"nearest recorded card: {kind[tier] if tier < 3 else 'capability unknown'}, "
        f"recorded on {_sm(capability_of(record))}, this card {_sm(capability)}"
    )
    return Reference(other, record, OTHER_CARD, relation)


def _sm(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"


def window_means(values: list[float], window: int) -> list[float]:
    """Means of consecutive ``window``-step slices (the last one may be shorter)."""
    return [fmean(values[i : i + window]) for i in range(0, len(values), window)]


def mismatches(curve: dict, reference: Reference) -> list[str]:
    """Where ``curve`` leaves ``reference.band`` around the recorded curve."""
    got, want = curve["train/loss"], reference.curve["train/loss"]
    if len(got) != len(want):
        # a changed step count is a changed test, not drift: record again
        return [f"{len(got)} train/loss steps, the record has {len(want)}"]
    band = reference.band
    means = zip(window_means(got, band.window), window_means(want, band.window), strict=True)
    bad = [
        (i * band.window, round(g, 5), round(w, 5))
        for i, (g, w) in enumerate(means)
        if not band.allows(g, w)
    ]
    problems = []
    if bad:
        problems.append(
            f"train/loss beyond {band} (first step of the window, got, recorded): {bad[:8]}"
        )
    got_val, want_val = curve["val/loss"], reference.curve["val/loss"]
    if not band.allows(got_val, want_val):
        problems.append(f"val/loss {got_val} vs recorded {want_val}, beyond {band}")
    return problems


def load_records(path: Path = REFERENCE) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def record_curve(card: str, name: str, curve: dict, environment: dict, path: Path = REFERENCE):
    """Store ``curve`` as the record of test ``name`` on ``card``, beside the other records
    (a new card is added, an existing one's test replaced)."""
    records = load_records(path)
    records.setdefault(card, {})[name] = {**curve, "recorded_with": environment}
    _write_atomically(path, json.dumps(records, indent=1, sort_keys=True) + "\n")


def _write_atomically(path: Path, text: str) -> None:
    # a run stopped mid-write must not leave a truncated JSON that fails every later run:
    # write beside it, then rename over it in one step
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
