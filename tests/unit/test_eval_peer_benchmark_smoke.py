"""The evaluation benchmark runs on CPU (``--smoke``): the same tiny folder and the same
multiple-choice task scored by the library (through lm-eval and natively) and by
lm-eval's Hugging Face backend, each in its own process, with the same accuracy on
every side. The smoke runs the library's side through lm-eval and lm-eval's own (the
others differ in batch sizes or skip lm-eval's pipeline), to spare the suite the other
processes' imports."""

from __future__ import annotations

import pytest
from run_helpers import benchmark_smoke

SIDES = {"recipes_lib", "lm_eval_hf"}


def test_eval_peer_smoke(tmp_path):
    pytest.importorskip("lm_eval")  # the peer side: lm-eval's Hugging Face backend
    figures = benchmark_smoke(
        "eval_peer.py",
        tmp_path / "eval.json",
        "--sides",
        ",".join(sorted(SIDES)),
        stdout_json=True,
    )
    case = figures["cases"]["multiple_choice"]
    assert set(case["sides"]) == SIDES
    assert case["examples"] == 16 and case["requests"] == 64
    for side in case["sides"].values():
        assert side["examples_per_sec"] > 0 and side["scoring_examples_per_sec"] > 0
        assert side["examples"] == 16
    # One fp32 model on one task: every side picks the same choices. A pick could only
    # differ where two choices' log-likelihoods (sums over a few hundred tokens, apart
    # by whole nats) came within the kernels' rounding (~1e-5) of each other, so the
    # accuracies are compared exactly.
    hf = case["sides"]["lm_eval_hf"]
    for name in SIDES - {"lm_eval_hf"}:
        side = case["sides"][name]
        assert (side["acc"], side["acc_norm"]) == (hf["acc"], hf["acc_norm"]), name
        assert case["vs_lm_eval_hf"][name]["speed"] > 0
