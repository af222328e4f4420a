"""The GRPO benchmark runs on CPU (``--smoke``): the rollout case samples the same
prompts with the library (the static step and the eager one) and transformers'
``generate``, each in its own process, every row to the full length."""

from __future__ import annotations

from run_helpers import benchmark_smoke


def test_grpo_peer_rollout_smoke(tmp_path):
    figures = benchmark_smoke("grpo_peer.py", tmp_path / "grpo.json", "--cases", "rollout")
    case = figures["cases"]["rollout"]
    assert set(case["sides"]) == {"recipes_lib", "recipes_lib_eager", "transformers"}
    for side in case["sides"].values():
        assert side["tokens_per_sec"] > 0 and side["rows"] == 4 and side["new_tokens"] == 8
    assert case["speed"] > 0
