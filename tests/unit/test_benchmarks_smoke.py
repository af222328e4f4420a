"""The throughput benchmark runs end to end on CPU (``--smoke``) and reports every trainer."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from run_helpers import benchmark_smoke

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "pretrain_throughput.py"
TRAINERS = ("recipes_lib", "plain_pytorch", "hf_transformers")


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict:
    """One ``--smoke`` run for every test here: the three trainers, and recipes_lib once
    per precision (bf16-mixed where this CPU has bf16 kernels) with activation
    checkpointing, which recomputes the same numbers, so fp32 still trains as the plain
    loop does."""
    from recipes_lib.parallel.precision import detect_cpu_bf16

    precisions = "32-true,bf16-mixed" if detect_cpu_bf16() else "32-true"
    out = tmp_path_factory.mktemp("throughput") / "figures.json"
    return benchmark_smoke(
        "pretrain_throughput.py",
        out,
        "--precisions",
        precisions,
        "--activation-checkpointing",
        stdout_json=True,
    )


def test_pretrain_throughput_smoke_reports_all_trainers(figures):
    tiny = figures["models"]["tiny"]
    assert tiny["tokens_per_step"] == tiny["batch_size"] * figures["settings"]["seq_len"]
    assert tiny["flops_per_token"] > 6 * tiny["num_params"] * 0.5
    has_transformers = importlib.util.find_spec("transformers") is not None
    for name in TRAINERS:
        report = tiny["trainers"][name]
        if name == "hf_transformers" and not has_transformers:
            assert "skipped" in report
            continue
        assert "error" not in report, report
        assert report["tokens_per_sec"] > 0
        assert report["measured_steps"] == 3
        assert 0 < report["step_time_ms"]["min"] <= report["step_time_ms"]["median"]
        assert math.isfinite(report["final_loss"])
        # random tokens: the loss stays near log(vocab) after a few steps
        assert abs(report["final_loss"] - math.log(tiny["config"]["vocab_size"])) < 1.5

    # Same model, same seed, same batches, same optimizer: the Lightning path and the
    # plain loop must train identically.
    trainers = tiny["trainers"]
    assert math.isclose(
        trainers["recipes_lib"]["final_loss"], trainers["plain_pytorch"]["final_loss"], rel_tol=1e-5
    )
    assert tiny["tokens_per_sec_ratios"]["recipes_lib/plain_pytorch"] > 0


def test_pretrain_throughput_smoke_measures_each_precision_through_the_library(figures):
    """``--precisions`` measures recipes_lib once per precision in one process, built by
    compose_config/build_trainer/build_stage."""
    if figures["settings"]["recipes_lib"]["precisions"] == ["32-true"]:
        pytest.skip("this CPU has no native bf16 kernels; precision=bf16-mixed is refused")
    assert figures["settings"]["recipes_lib"]["precisions"] == ["32-true", "bf16-mixed"]
    tiny = figures["models"]["tiny"]
    trainers = tiny["trainers"]
    assert set(trainers) == {*TRAINERS, "recipes_lib_bf16-mixed"}
    for key, precision in (("recipes_lib", "32-true"), ("recipes_lib_bf16-mixed", "bf16-mixed")):
        report = trainers[key]
        assert "error" not in report, report
        assert report["precision"] == precision and report["strategy"] == "single"
        assert report["activation_checkpointing"] is True
        assert report["tokens_per_sec"] > 0 and report["measured_steps"] == 3
    assert math.isclose(
        trainers["recipes_lib"]["final_loss"], trainers["plain_pytorch"]["final_loss"], rel_tol=1e-5
    )
    comparison = tiny["precision_comparison"]["bf16-mixed/32-true"]
    assert comparison["tokens_per_sec_ratio"] > 0
    assert abs(comparison["final_loss_difference"]) < 0.1  # bf16 rounding, a few steps


# a tiny Gemma 3: layer 0 attends to a window of 16 keys, layer 1 to every earlier one
GEMMA_LIKE = (
    "model.family=gemma3",
    "model.qk_norm=head",
    "model.norm_placement=both",
    "model.activation=gelu_tanh",
    "model.scale_embeddings=true",
    "model.norm_gain_offset=1.0",
    "model.sliding_window=16",
    "model.window_layers=[0]",
)


def test_pretrain_throughput_smoke_compares_attention_choices(tmp_path):
    """``--attention flex,auto`` measures recipes_lib once per choice in one call; each
    report names the backend of each kind of layer, and both train alike."""
    overrides = [arg for override in GEMMA_LIKE for arg in ("--model-override", override)]
    figures = benchmark_smoke(
        "pretrain_throughput.py",
        tmp_path / "figures.json",
        "--trainers",
        "recipes_lib",
        "--attention",
        "flex,auto",
        *overrides,
        stdout_json=True,
    )
    assert figures["settings"]["attentions"] == ["flex", "auto"]
    tiny = figures["models"]["tiny"]
    trainers = tiny["trainers"]
    assert trainers["recipes_lib"]["attention"] == {"global": "flex", "local": "flex"}
    auto = trainers["recipes_lib_attention_auto"]
    assert "error" not in auto, auto
    assert auto["attention"] == {"global": "sdpa", "local": "flex"}
    comparison = tiny["attention_comparison"]["auto/flex"]
    assert comparison["tokens_per_sec_ratio"] > 0
    assert abs(comparison["final_loss_difference"]) < 1e-4  # fp32: the same attention
