"""A tiny exported model and a local lm-eval task folder of each kind, shared by the CPU
and GPU parity tests of the evaluation against lm-eval's Hugging Face backend."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_folders import write_tokenizer
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.models import Transformer

TASKS = ["parity_mc", "parity_rolling", "parity_gen"]

MC_YAML = """\
task: parity_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
"""
ROLLING_YAML = """\
task: parity_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: docs.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity}
  - {metric: byte_perplexity}
"""
GEN_YAML = """\
task: parity_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
generation_kwargs: {until: ["\\n\\n"], max_gen_toks: 12, do_sample: false}
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true}
"""


def export_with_tasks(root: Path) -> tuple[Path, Path]:
    """A native tiny model exported as a Hugging Face folder (with a tokenizer) and a
    local lm-eval task folder: multiple choice, rolling log-likelihood, generation."""
    torch.manual_seed(0)
    config = tiny_model_config(vocab_size=512, dim=64, ffn_dim=128, max_seq_len=256)
    model = Transformer(config, "sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    write_tokenizer(tokenizer_dir, stdlib_instruction_records(100))
    folder = export_hf_checkpoint(model, config, root / "hf", tokenizer_dir)
    tasks = root / "tasks"
    tasks.mkdir()
    records = stdlib_instruction_records(12, seed=3)
    with open(tasks / "mc.jsonl", "w") as f:
        for i, r in enumerate(records):
            lines = r["response"].splitlines()
            choices = [lines[0][:30], lines[-1][:30], "return None"]
            f.write(json.dumps({"context": r["prompt"][:80], "choices": choices, "answer": i % 3}))
            f.write("\n")
    with open(tasks / "docs.jsonl", "w") as f:  # longer than the context: several windows
        for r in records[:4]:
            f.write(json.dumps({"text": r["response"] * 3}) + "\n")
    with open(tasks / "gen.jsonl", "w") as f:
        for r in records[:5]:
            f.write(json.dumps({"context": r["prompt"][:60], "target": "x"}) + "\n")
    (tasks / "mc.yaml").write_text(MC_YAML)
    (tasks / "rolling.yaml").write_text(ROLLING_YAML)
    (tasks / "gen.yaml").write_text(GEN_YAML)
    return folder, tasks


def samples(results, task):
    return {s["doc_id"]: s for s in results["samples"][task]}


def assert_same_results(ours: dict, theirs: dict, tolerance: float) -> int:
    """Every log-likelihood of the choice and rolling tasks within ``tolerance``, the
    same generations, the same metrics; returns how many log-likelihoods were compared."""
    compared = 0
    for task in ("parity_mc", "parity_rolling"):
        a, b = samples(ours, task), samples(theirs, task)
        assert a.keys() == b.keys() and a
        for doc in a:
            assert a[doc]["arguments"] == b[doc]["arguments"]
            for ra, rb in zip(a[doc]["resps"], b[doc]["resps"], strict=True):
                la = ra[0][0] if isinstance(ra[0], tuple | list) else ra[0]
                lb = rb[0][0] if isinstance(rb[0], tuple | list) else rb[0]
                # a rolling log-likelihood sums thousands of fp32 terms: relative 1e-6 too
                assert la == pytest.approx(lb, abs=tolerance, rel=1e-6)
                assert math.isfinite(la)
                compared += 1
    gen_a, gen_b = samples(ours, "parity_gen"), samples(theirs, "parity_gen")
    assert [gen_a[d]["resps"] for d in sorted(gen_a)] == [gen_b[d]["resps"] for d in sorted(gen_b)]
    for task in ("parity_mc", "parity_rolling"):
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=tolerance)
    return compared


def both_backends(folder: Path, tasks: Path, device: str) -> tuple[dict, dict]:
    """lm-eval's results (samples logged) of the tasks in ``tasks`` for the exported
    ``folder``: ``(the native model through RecipesLM, lm-eval's HF backend)``, fp32."""
    import lm_eval

    from recipes_lib.evaluation.harness import RecipesLM, build_lm_eval_tasks
    from recipes_lib.generate import load_for_generation

    common = dict(log_samples=True, bootstrap_iters=0, limit=None)
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "dtype": "float32"},
        tasks=list(build_lm_eval_tasks(TASKS, tasks).values()),
        batch_size=4,
        device=device,
        **common,
    )
    loaded = load_for_generation(folder, device=device, dtype=torch.float32)
    lm = RecipesLM(loaded.model, loaded.tokenizer, loaded.eos_ids, batch_size=3)
    ours = lm_eval.simple_evaluate(
        model=lm, tasks=list(build_lm_eval_tasks(TASKS, tasks).values()), **common
    )
    return ours, theirs
