"""The transformers fallback over transformers' causal-LM model types: four types of
different shapes on every run, and every type with ``RECIPES_HF_SWEEP=1``, which writes
docs/models/fallback.md (``RECIPES_HF_SWEEP=1 pytest -m slow -k every_causal_lm_type``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import transformers  # noqa: E402
from hf_fallback_sweep import (  # noqa: E402
    causal_lm_types,
    read_sweep,
    render_table,
    sweep_type,
    type_speeds,
    write_table,
)

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "models" / "fallback.md"


@pytest.mark.parametrize(
    ("model_type", "packing"),
    [
        ("gpt_neox", "position ids"),  # a fused QKV projection, parallel residual
        ("bert", "4-D mask"),  # a decoder mode of an encoder: packed by a block mask
        ("mamba", "no"),  # no attention: a row per example
        ("deepseek_v3", "position ids"),  # latent attention, grouped routing
        ("fuyu", "position ids"),  # image-text: the language shape in its text_config
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
    counts = write_table(rows, DOCS_PAGE, transformers.__version__)
    assert counts["ok"] >= 0.7 * (len(rows) - counts["skipped"]), counts


def test_the_docs_table_holds_its_sweep_and_the_measured_speeds():
    """The page is its last sweep's rows with the speeds of today's result files: a new
    throughput file changes it (``python tests/hf_fallback_sweep.py`` writes it again)."""
    rows, version = read_sweep(DOCS_PAGE)
    assert DOCS_PAGE.read_text() == render_table(rows, version), (
        "docs/models/fallback.md is stale: run python tests/hf_fallback_sweep.py"
    )
    speeds = type_speeds()
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    oss = json.loads((results / "pretrain_throughput_gpt_oss_4l_h200.json").read_text())
    sides = oss["models"]["gpt_oss_20b"]["trainers"]
    ratio = sides["recipes_lib"]["tokens_per_sec"] / sides["hf_transformers"]["tokens_per_sec"]
    assert f"{ratio:.2f}x transformers (gpt_oss_20b, H200)" in speeds["gpt_oss"]
    fallback = json.loads((results / "hf_fallback_h100.json").read_text())
    assert f"fallback {fallback['families']['llama']['ratio']:.2f}x native" in speeds["llama"]


def test_a_speed_is_read_from_a_file_that_measured_both_sides(tmp_path):
    both = {"recipes_lib": {"tokens_per_sec": 300.0}, "hf_transformers": {"tokens_per_sec": 200.0}}
    one = {"recipes_lib": {"tokens_per_sec": 300.0}}
    for name, trainers in (("a", both), ("b", one)):
        report = {"device": "NVIDIA H100 80GB HBM3", "models": {"olmo3_7b": {"trainers": trainers}}}
        (tmp_path / f"pretrain_throughput_{name}_h100.json").write_text(json.dumps(report))
    speeds = type_speeds(tmp_path)
    assert speeds == {"olmo3": "1.50x transformers (olmo3_7b, H100)"}


def test_an_eager_sibling_file_gives_transformers_side_on_the_same_card_only(tmp_path):
    def write(name, trainers, device="NVIDIA H200"):
        report = {"device": device, "models": {"qwen3_5_0_8b": {"trainers": trainers}}}
        (tmp_path / f"pretrain_throughput_{name}.json").write_text(json.dumps(report))

    write("q_h200", {"recipes_lib": {"tokens_per_sec": 400.0}})
    write("q_hf_eager_h200", {"hf_transformers": {"tokens_per_sec": 200.0}})
    write("r_h100", {"recipes_lib": {"tokens_per_sec": 400.0}}, "NVIDIA H100 80GB HBM3")
    write("r_hf_eager_h100", {"hf_transformers": {"tokens_per_sec": 100.0}}, "NVIDIA H200")
    assert type_speeds(tmp_path)["qwen3_5"] == "2.00x transformers eager (qwen3_5_0_8b, H200)"
    other = tmp_path / "other_length"
    other.mkdir()
    for name, seq_len, trainers in (
        ("q_h200", 2048, {"recipes_lib": {"tokens_per_sec": 400.0}}),
        ("q_hf_eager_h200", 4096, {"hf_transformers": {"tokens_per_sec": 200.0}}),
    ):
        report = {
            "device": "NVIDIA H200",
            "settings": {"seq_len": seq_len},
            "models": {"qwen3_5_0_8b": {"trainers": trainers}},
        }
        (other / f"pretrain_throughput_{name}.json").write_text(json.dumps(report))
    assert "qwen3_5" not in type_speeds(other)  # another length: not the call's other side
