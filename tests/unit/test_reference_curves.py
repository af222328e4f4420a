"""The rules that compare GPU stage curves with the per-card records, on CPU, and the
shipped records themselves."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from reference_curves import (
    OTHER_CARD,
    REFERENCE,
    SAME_CARD,
    Reference,
    curve_problems,
    find_reference,
    load_records,
    mismatches,
    record_curve,
)

HOPPER = (9, 0)


def _curve(start: float = 8.0, end: float = 6.0, steps: int = 30, val: float = 6.5) -> dict:
    """A falling curve with a sawtooth on top, like a real one's batch-to-batch noise."""
    train = [
        start + (end - start) * i / (steps - 1) + (0.1 if i % 2 else -0.1) for i in range(steps)
    ]
    return {"train/loss": train, "val/loss": val}


def _record(curve: dict, capability: str | None = "9.0") -> dict:
    env = {"python": "3.12.3", "torch": "2.11.0"}
    return {
        **curve,
        "recorded_with": env if capability is None else {**env, "capability": capability},
    }


def _shifted(curve: dict, by: float) -> dict:
    return {"train/loss": [x + by for x in curve["train/loss"]], "val/loss": curve["val/loss"] + by}


def _python(record: dict) -> str:
    return ".".join(record["recorded_with"]["python"].split(".")[:2])


def test_same_card_within_tolerance_passes():
    recorded = _curve()
    records = {"NVIDIA H200": {"sft": _record(recorded)}}
    reference = find_reference(records, "NVIDIA H200", HOPPER, "sft")
    assert reference.card == "NVIDIA H200" and reference.band == SAME_CARD
    # non-deterministic kernels move a step by a few thousandths
    assert mismatches(_shifted(recorded, 0.01), reference) == []


def test_same_card_regression_fails():
    recorded = _curve()
    reference = find_reference(
        {"NVIDIA H200": {"sft": _record(recorded)}}, "NVIDIA H200", HOPPER, "sft"
    )
    late = dict(recorded, **{"train/loss": [*recorded["train/loss"][:20], *[7.0] * 10]})
    problems = mismatches(late, reference)
    assert len(problems) == 1 and "train/loss" in problems[0] and "(20, 7.0," in problems[0]
    # one step off is enough on the same card
    one_step = list(recorded["train/loss"])
    one_step[5] += 0.2
    assert mismatches(dict(recorded, **{"train/loss": one_step}), reference)
    assert "val/loss" in mismatches(dict(recorded, **{"val/loss": 6.7}), reference)[0]


def test_new_card_within_band_passes_where_same_card_tolerance_would_not():
    recorded = _curve()
    records = {"NVIDIA H200": {"sft": _record(recorded)}}
    reference = find_reference(records, "NVIDIA H100 80GB HBM3", HOPPER, "sft")
    assert reference.card == "NVIDIA H200" and reference.band == OTHER_CARD
    # another card's bf16 drifts: 0.08 on every step is too far for the same card
    drifted = _shifted(recorded, 0.08)
    drifted["train/loss"][7] += 0.2  # and one jittery step, averaged within its window
    assert mismatches(drifted, reference) == []
    assert mismatches(drifted, Reference("NVIDIA H200", recorded, SAME_CARD, "this card"))


def test_new_card_far_off_fails():
    recorded = _curve()
    reference = find_reference(
        {"NVIDIA H200": {"sft": _record(recorded)}}, "NVIDIA H100 80GB HBM3", HOPPER, "sft"
    )
    problems = mismatches(_shifted(recorded, 0.5), reference)  # e.g. a halved learning rate
    assert len(problems) == 2 and "train/loss" in problems[0] and "val/loss" in problems[1]
    # a regression in one part of the curve: the windows it covers fail
    late = dict(recorded, **{"train/loss": [*recorded["train/loss"][:25], *[7.0] * 5]})
    assert "(25, 7.0," in mismatches(late, reference)[0]
    # a different step count is a changed test, whatever the card
    short = dict(recorded, **{"train/loss": recorded["train/loss"][:20]})
    assert "20 train/loss steps, the record has 30" in mismatches(short, reference)[0]


@pytest.mark.parametrize("where", ["train", "val"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_fails(where, value):
    curve = _curve()
    if where == "train":
        curve["train/loss"][3] = value
    else:
        curve["val/loss"] = value
    problems = curve_problems(curve)
    assert len(problems) == 1 and "not finite" in problems[0]


def test_non_decreasing_fails():
    assert curve_problems(_curve()) == []
    assert "does not fall" in curve_problems(_curve(start=6.0, end=6.0))[0]
    assert "does not fall" in curve_problems(_curve(start=6.0, end=7.0))[0]
    # DPO that does not learn stays at log 2
    assert curve_problems({"train/loss": [math.log(2)] * 30, "val/loss": math.log(2)})
    # a fall smaller than the margin (0.5% of the first quarter's mean) is no fall
    assert curve_problems(_curve(start=6.42, end=6.40))
    assert "too few" in curve_problems({"train/loss": [6.0], "val/loss": 6.0})[0]


def test_nearest_card_choice():
    curve = _curve()
    records = {
        "A100": {"sft": _record(curve, "8.0")},
        "B200": {"sft": _record(curve, "10.0")},
        "H200": {"sft": _record(curve, "9.0"), "dpo": _record(curve, "9.0")},
        "L4": {"sft": _record(curve, "8.9")},
        "Old": {"sft": _record(curve, None), "sft_lora": _record(curve, None)},
    }

    def nearest(capability, name="sft", card="new"):
        return find_reference(records, card, capability, name).card

    assert nearest((9, 0)) == "H200"  # same compute capability: H100 against H200
    assert nearest((8, 6)) == "L4"  # same family (8.x), closest capability
    assert nearest((8, 1)) == "A100"
    assert nearest((12, 0)) == "B200"  # another family: the closest capability
    assert nearest((7, 5)) == "A100"
    assert nearest((9, 0), card="H200") == "H200"  # its own record first
    assert find_reference(records, "H200", (9, 0), "sft").band == SAME_CARD
    assert nearest((9, 0), name="sft_lora") == "Old"  # a record without capability: last resort
    assert nearest(None) == "A100"  # capability unknown here: by name, stable
    reference = find_reference(records, "H100", (9, 0), "sft")
    assert "same compute capability" in reference.describe()
    assert find_reference(records, "H100", (9, 0), "pretrain_tiny") is None  # nobody has it


def test_record_new_card_and_existing_card(tmp_path):
    path = tmp_path / "reference_losses.json"
    env = {"python": "3.12.3", "torch": "2.11.0", "capability": "9.0"}
    record_curve("NVIDIA H200", "sft", _curve(), env, path=path)  # no file yet
    record_curve("NVIDIA H200", "dpo", _curve(0.69, 0.62, val=0.64), env, path=path)
    record_curve("NVIDIA H100 80GB HBM3", "sft", _curve(8.1, 6.1), env, path=path)  # new card
    record_curve("NVIDIA H200", "sft", _curve(7.9, 5.9), env, path=path)  # replaced
    records = load_records(path)
    assert sorted(records) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert sorted(records["NVIDIA H200"]) == ["dpo", "sft"]
    assert records["NVIDIA H200"]["sft"]["train/loss"] == _curve(7.9, 5.9)["train/loss"]
    assert records["NVIDIA H100 80GB HBM3"]["sft"]["recorded_with"] == env
    assert path.read_text() == json.dumps(records, indent=1, sort_keys=True) + "\n"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_shipped_records_are_finite_and_fall():
    records = load_records(REFERENCE)
    assert records, f"no records in {REFERENCE}"
    for card, tests in records.items():
        for name, record in tests.items():
            assert curve_problems(record) == [], (card, name)
            assert "capability" in record["recorded_with"], (card, name)


def test_shipped_records_agree_across_cards():
    """Where two cards have recorded the same test they agree within the cross-card band:
    the check that ``OTHER_CARD`` is wide enough for real drift (run it after recording a
    new card)."""
    records = load_records(REFERENCE)
    # the data are the standard-library corpus: only records made on one Python compare
    pairs = [
        (name, a, b)
        for a, b in itertools.combinations(sorted(records), 2)
        for name in sorted(set(records[a]) & set(records[b]))
        if _python(records[a][name]) == _python(records[b][name])
    ]
    if not pairs:
        pytest.skip(f"no two cards recorded on one Python ({', '.join(records)})")
    for name, a, b in pairs:
        reference = Reference(a, records[a][name], OTHER_CARD, "another recorded card")
        assert mismatches(records[b][name], reference) == [], (name, b, a)
