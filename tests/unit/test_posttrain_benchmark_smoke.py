"""The post-training benchmark runs end to end on CPU (``--smoke``) and reports every figure."""

from __future__ import annotations

import math

import pytest
from run_helpers import benchmark_smoke


@pytest.mark.slow
def test_posttrain_smoke_reports_packing_dpo_cost_and_adapter_memory(tmp_path):
    out = tmp_path / "figures.json"
    figures = benchmark_smoke("posttrain.py", out, stdout_json=True)
    steps = figures["settings"]["steps"]

    def check_run(report: dict) -> None:
        assert "error" not in report, report
        assert report["tokens_per_sec"] > 0 and report["tokens"] > 0
        assert report["measured_steps"] == steps
        assert 0 <= report["padding_fraction"] < 1
        assert math.isfinite(report["final_loss"])
        assert report["peak_memory_gib"] is None  # no CUDA memory counter on CPU

    packing = figures["sft_packing"]
    for name in ("padded", "packed", "packed_document_mask"):
        check_run(packing[name])
        assert packing[name]["trained_tokens_per_sec"] <= packing[name]["tokens_per_sec"]
    # packed rows are as full as first fit gets them; padded rows wait for the longest
    assert packing["packed"]["padding_fraction"] <= packing["padded"]["padding_fraction"]
    assert packing["tokens_per_sec_ratio"]["packed/padded"] > 0

    dpo = figures["dpo_vs_sft"]
    for name in ("dpo_live", "dpo_precomputed"):
        check_run(dpo[name])
        assert dpo["cost_per_token_vs_sft"][name] > 0
    # policy = reference at the start: the loss is log 2 either way
    for name in ("dpo_live", "dpo_precomputed"):
        assert dpo[name]["final_loss"] == pytest.approx(math.log(2), abs=0.05)
    assert dpo["dpo_precomputed"]["precompute_pairs"] > 0
    assert dpo["dpo_precomputed"]["precompute_seconds"] > 0

    memory = figures["adapter_memory"]
    check_run(memory["full"])
    check_run(memory["lora"])
    assert memory["lora"]["trainable_params"] < memory["full"]["trainable_params"] / 5
    assert memory["lora"]["params"] > memory["full"]["params"]  # the base plus the adapters
    assert "skipped" in memory["qlora"] and "qlora" in memory["qlora"]["skipped"]
    assert memory["peak_memory_vs_full"] == {"lora": None, "qlora": None}
