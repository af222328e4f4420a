"""The attention benchmark runs end to end on CPU (``--smoke``) and counts masks right."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from run_helpers import run_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
BENCHMARK = BENCHMARKS / "attention.py"


@pytest.fixture(scope="module")
def attention_benchmark():
    """benchmarks/attention.py imported as a module (it imports its sibling ``_common``)."""
    name = "attention_benchmark"
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARK)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(BENCHMARKS))


def test_attention_smoke_reports_every_backend_and_mask(tmp_path):
    out = tmp_path / "attention.json"
    proc = run_script(BENCHMARK, "--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout)  # stdout holds the JSON and nothing else
    assert json.loads(out.read_text()) == figures
    assert figures["benchmark"] == "attention"
    assert figures["settings"]["dtype"] == "float32"
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None

    assert set(figures["shapes"]) == {"hd32_T128", "hd32_T256"}
    for shape in figures["shapes"].values():
        B, H, T, D = (shape[k] for k in ("batch_size", "n_heads", "seq_len", "head_dim"))
        assert B * T == shape["tokens_per_call"] == figures["settings"]["tokens_per_call"]
        assert H * D == figures["settings"]["heads_width"]
        causal, document = shape["masks"]["causal"], shape["masks"]["document_mean48"]
        assert causal["masked_in_fraction"] == pytest.approx((T + 1) / (2 * T))
        assert 0 < document["masked_in_fraction"] < causal["masked_in_fraction"]
        assert document["documents"] > B  # several documents per row

        assert document["backends"]["sdpa"]["status"] == "unsupported"
        assert "document" in document["backends"]["sdpa"]["reason"]
        if not has_flash_attn:  # on CPU it is unavailable or unsupported, never run
            for mask in (causal, document):
                report = mask["backends"]["flash_attn"]
                assert report["status"] in ("unavailable", "unsupported"), report
                assert report["reason"]

        for name, mask in (("sdpa", causal), ("flex", causal), ("flex", document)):
            report = mask["backends"][name]
            assert report["status"] == "ok", report
            assert report["iters"] == 2
            ms = report["fwd_bwd_ms"]
            assert 0 < ms["min"] <= ms["median"] <= ms["max"]
            assert report["tokens_per_sec"] == pytest.approx(B * T / ms["median"] * 1e3, rel=1e-3)
            dense_flops = 4 * B * H * T * T * D * 0.5 * 3.5
            assert report["tflops_dense_equivalent"] == pytest.approx(
                dense_flops / ms["median"] / 1e9, rel=1e-3
            )
            # effective / dense-equivalent is the kept fraction over the causal 0.5
            assert report["tflops_effective"] / report["tflops_dense_equivalent"] == (
                pytest.approx(mask["masked_in_fraction"] / 0.5, rel=2e-3)
            )
            assert report["first_call_s"] > 0
            assert report["mask_build"]["first_build_s"] >= 0  # sdpa: no mask to build
            assert report["mask_build"]["rebuilds"] == 1
        flex_document = document["backends"]["flex"]
        assert flex_document["mask_build"]["first_build_s"] > 0
        assert flex_document["mask_build"]["rebuild_ms_median"] > 0
        assert 0 < flex_document["flex_computed_block_fraction"] <= 1

        ratios = shape["ratios_to_sdpa_causal"]
        expected = (
            causal["backends"]["flex"]["tokens_per_sec"]
            / (causal["backends"]["sdpa"]["tokens_per_sec"])
        )
        assert ratios["flex_causal/sdpa_causal"] == pytest.approx(expected, rel=1e-3)
        assert ratios["flex_document_mean48/sdpa_causal"] > 0

    summary = figures["summary"]
    assert summary["target"] == 0.8
    by_shape = summary["flex_document_over_sdpa_causal_tokens_per_sec"]
    assert all(ratio["document_mean48"] > 0 for ratio in by_shape.values())
    assert isinstance(summary["all_within_target"], bool)


def test_document_ids_are_seeded_packed_runs(attention_benchmark):
    ids = attention_benchmark.document_ids(4, 256, 40, seed=7)
    assert ids.shape == (4, 256) and ids.dtype == torch.int32
    assert torch.equal(ids, attention_benchmark.document_ids(4, 256, 40, seed=7))
    assert not torch.equal(ids, attention_benchmark.document_ids(4, 256, 40, seed=8))
    flat = ids.flatten()
    assert flat[0] == 0 and bool((flat.diff() >= 0).all())  # documents laid end to end
    assert bool((flat.diff() <= 1).all())  # no id skipped: every document has a token
    n_docs = int(flat[-1]) + 1
    assert 1024 / n_docs == pytest.approx(40, rel=0.5)  # the mean length drawn


def test_document_stats_match_a_dense_count(attention_benchmark):
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [2, 2, 3, 3, 3, 3, 3, 3]])
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    kept = (same_doc & causal).sum().item()

    stats = attention_benchmark.document_stats(doc_ids)
    assert stats["masked_in_fraction"] == kept / (2 * T * T)
    assert stats["documents"] == 5  # document 2 counts once in each row it spans
    assert stats["mean_document_len"] == 16 / 5


def test_grouped_query_shape_measures_on_cpu(attention_benchmark):
    """GQA inputs (fewer key/value heads) run through the library's flex backend."""
    bench = attention_benchmark
    shape = bench.Shape(batch_size=2, n_heads=4, n_kv_heads=2, seq_len=64, head_dim=16)
    q, k, v, grad_out = bench.attention_inputs(shape, "cpu", torch.float32, seed=0)
    assert q.shape == (2, 4, 64, 16) and k.shape == v.shape == (2, 2, 64, 16)
    assert q.transpose(1, 2).is_contiguous()  # the model's (B, T, heads, D) layout

    args = SimpleNamespace(
        mask_rebuilds=1, seed=0, dtype=torch.float32, warmup=0, iters=1, peak=None
    )
    backend = bench.get_attention_backend("flex")
    doc_ids = bench.document_ids(2, 64, 16, seed=0)
    fraction = bench.document_stats(doc_ids)["masked_in_fraction"]
    report = bench.measure(backend, shape, 16, fraction, args, torch.device("cpu"))
    assert report["status"] == "ok" and report["iters"] == 1
    assert math.isfinite(report["tflops_effective"]) and report["tflops_effective"] > 0
