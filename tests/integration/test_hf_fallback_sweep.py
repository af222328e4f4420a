"""The transformers fallback over transformers' causal-LM model types: three types of
different shapes on every run, and every type with ``RECIPES_HF_SWEEP=1``, which writes
docs/models/fallback.md (``RECIPES_HF_SWEEP=1 pytest -m slow -k every_causal_lm_type``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from hf_fallback_sweep import causal_lm_types, sweep_type, write_table  # noqa: E402

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "models" / "fallback.md"


@pytest.mark.parametrize(
    ("model_type", "packing"),
    [
        ("gpt_neox", "position ids"),  # a fused QKV projection, parallel residual
        ("bert", "4-D mask"),  # a decoder mode of an encoder: packed by a block mask
        ("mamba", "no"),  # no attention: a row per example
    ],
)
def test_a_type_trains_both_recipes_and_reloads(tmp_path, model_type, packing):
    row = sweep_type(model_type, tmp_path / model_type)
    assert row["status"] == "ok", row
    assert row["packing"] == packing
    assert row["sft_lora_reload"] <= 1e-4 and row["dpo_full_reload"] <= 1e-4
    assert row["dpo_full_load_check"] <= 1e-4


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("RECIPES_HF_SWEEP"),
    reason="the whole sweep (about 15 minutes) runs with RECIPES_HF_SWEEP=1",
)
def test_every_causal_lm_type_and_the_docs_table(tmp_path):
    rows = [sweep_type(t, tmp_path / "sweep") for t in causal_lm_types()]
    counts = write_table(rows, DOCS_PAGE)
    assert counts["ok"] >= 0.7 * (len(rows) - counts["skipped"]), counts
