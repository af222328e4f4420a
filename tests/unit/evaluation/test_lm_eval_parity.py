"""The native model through RecipesLM against lm-eval's own Hugging Face backend, on a
tiny exported model and a local task folder: the same log-likelihoods (1e-4), the same
rolling log-likelihoods and the same greedy generations."""

import json
import math

import pytest
import torch
from hf_folders import write_tokenizer
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.evaluation.run import EvalSettings, evaluate_checkpoint
from recipes_lib.models import Transformer

lm_eval = pytest.importorskip("lm_eval")

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


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A native tiny model exported as a Hugging Face folder, and a task folder."""
    root = tmp_path_factory.mktemp("parity")
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


def test_native_lm_matches_lm_evals_hugging_face_backend(exported):
    from recipes_lib.evaluation.harness import RecipesLM, build_lm_eval_tasks
    from recipes_lib.generate import load_for_generation

    folder, tasks = exported
    names = ["parity_mc", "parity_rolling", "parity_gen"]
    common = dict(log_samples=True, bootstrap_iters=0, limit=None)
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "dtype": "float32"},
        tasks=list(build_lm_eval_tasks(names, tasks).values()),
        batch_size=4,
        device="cpu",
        **common,
    )
    loaded = load_for_generation(folder, dtype=torch.float32)
    lm = RecipesLM(loaded.model, loaded.tokenizer, loaded.eos_ids, batch_size=3)
    ours = lm_eval.simple_evaluate(
        model=lm, tasks=list(build_lm_eval_tasks(names, tasks).values()), **common
    )
    compared = 0
    for task in ("parity_mc", "parity_rolling"):
        a, b = samples(ours, task), samples(theirs, task)
        assert a.keys() == b.keys() and a
        for doc in a:
            assert a[doc]["arguments"] == b[doc]["arguments"]
            for ra, rb in zip(a[doc]["resps"], b[doc]["resps"], strict=True):
                la = ra[0][0] if isinstance(ra[0], tuple | list) else ra[0]
                lb = rb[0][0] if isinstance(rb[0], tuple | list) else rb[0]
                assert la == pytest.approx(lb, abs=1e-4)
                assert math.isfinite(la)
                compared += 1
    assert compared >= 12 * 3 + 4
    gen_a, gen_b = samples(ours, "parity_gen"), samples(theirs, "parity_gen")
    assert [gen_a[d]["resps"] for d in sorted(gen_a)] == [gen_b[d]["resps"] for d in sorted(gen_b)]
    for task in ("parity_mc", "parity_rolling"):
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-4)


def test_evaluate_checkpoint_runs_a_task_folder_and_a_builtin_task(exported):
    folder, tasks = exported
    report = evaluate_checkpoint(
        folder, EvalSettings(tasks=("stdlib_bodies", str(tasks)), limit=4, batch_size=8)
    )
    flat = report.flat()
    assert set(report.results) == {"stdlib_bodies", "parity_mc", "parity_rolling", "parity_gen"}
    for key in ("eval/stdlib_bodies/acc", "eval/parity_mc/acc_norm", "eval/parity_gen/exact_match"):
        assert 0.0 <= flat[key] <= 1.0
    assert flat["eval/parity_rolling/word_perplexity"] > 1.0
    assert report.examples == {"stdlib_bodies": 4}
