r"""Evaluation against lm-evaluation-harness's Hugging Face backend: a multiple-choice task
scored by log-likelihood, on the same folder, task and card.

The parent process makes, once, in a temporary folder:

- ``model/``: a preset's shape (default ``llama_1b``), the library's ``Transformer`` at
  random init from ``--seed``, exported as a Hugging Face folder
  (:func:`~recipes_lib.checkpoint.hf_export.export_hf_checkpoint`; bf16 safetensors,
  fp32 for ``--smoke``) with a byte-level BPE tokenizer of ``--vocab-size`` tokens
  trained on the task's text and its ``tokenizer_config.json``: one folder that
  transformers and the library both load;
- ``task/``: an lm-eval local task folder, ``data.jsonl`` (the built-in
  ``stdlib_bodies`` task's first ``--examples`` examples: a function's ``def`` line and
  docstring, four candidate bodies) and ``stdlib_bodies.yaml`` (``output_type:
  multiple_choice``, the choice appended to the context as written, ``acc`` and
  ``acc_norm``).

Then each side scores every example (four requests each), one after the other, each
in a process of its own (so each peak is its own):

- ``recipes_lib``: the folder loaded by ``load_for_generation`` (bf16), the task built
  by ``build_lm_eval_tasks``, and lm-eval's own ``simple_evaluate`` run with
  :class:`~recipes_lib.evaluation.harness.RecipesLM` as the model (``score_requests``:
  longest first, batches of up to ``--rows`` rows and ``--batch-tokens`` padded tokens,
  the library's defaults; only the continuation's logits formed);
- ``recipes_lib_rows``: the same with ``--batch-size`` rows and no token budget (the
  rows ``lm_eval_hf`` takes);
- ``recipes_lib_native``: the same examples from ``data.jsonl`` through
  ``score_choice_task`` and ``score_requests`` directly, no lm-eval;
- ``lm_eval_hf``: lm-eval's ``HFLM`` (what ``simple_evaluate(model="hf",
  model_args={"pretrained": folder, "dtype": "bfloat16"})`` builds) with
  ``--batch-size`` rows, through the same ``simple_evaluate`` call as ``recipes_lib``;
- ``lm_eval_hf_auto``: the same with ``batch_size="auto"`` (lm-eval's search from 64
  rows down, done again in every evaluation and timed with it);
- ``lm_eval_hf_rows``: the same with ``--rows`` rows (as many as ``recipes_lib`` may
  take).

Both lm-eval sides call ``simple_evaluate`` as ``run_lm_eval`` does (no samples logged,
no bootstrap, the same seeds, a ``TaskManager`` passed so that no call indexes lm-eval's
whole task registry).

Only the evaluation is timed: the model is loaded and the task built first, then one
warm-up evaluation of ``--warmup-examples`` examples runs, then the whole task between
two synchronisations. Each side reports examples/s over the whole evaluation, and over
the scoring calls alone (lm-eval's ``loglikelihood``: tokenising and scoring the
requests; ``harness_s`` is the rest: building the requests, metrics, lm-eval's
environment report), ``acc`` and ``acc_norm`` (the same model on the same task: the
sides should agree, up to bf16 rounding: lm-eval's HF backend takes its log-softmax in
the model's dtype, the library in fp32) and CUDA's allocated peak over the timed
evaluation; ``vs_lm_eval_hf`` gives each side's speeds as ratios to ``lm_eval_hf``'s
and its accuracies' differences. Prints one JSON object::

    python benchmarks/eval_peer.py --out $OUT/eval_peer.json
    python benchmarks/eval_peer.py --examples 500 --batch-size 64 --sides recipes_lib,lm_eval_hf

A side that fails is recorded as ``{"error": ...}`` (exit status 1). ``--smoke`` runs
a tiny shape on CPU in fp32 (its sides run all at once: their timings mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _peer import add_peer_arguments, check_choices, report_header, spawn, sync  # noqa: E402

TASK = "stdlib_bodies"
CASE = "multiple_choice"
SIDES = (
    "recipes_lib",
    "recipes_lib_rows",
    "recipes_lib_native",
    "lm_eval_hf",
    "lm_eval_hf_auto",
    "lm_eval_hf_rows",
)
BASELINE = "lm_eval_hf"
EOS = "<|endoftext|>"
TASK_YAML = {
    "task": TASK,
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": "data.jsonl"}},
    "test_split": "test",
    "output_type": "multiple_choice",
    "doc_to_text": "{{context}}",
    "doc_to_choice": "{{choices}}",
    "doc_to_target": "{{answer}}",
    "target_delimiter": "",
    "metric_list": [
        {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
    ],
}


# ------------------------------------------------------------------------- inputs
def make_inputs(args, root: Path) -> dict:
    """The model folder and the task folder every side reads; what they hold."""
    import torch
    import yaml

    from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
    from recipes_lib.config import compose_config, to_run_config
    from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer
    from recipes_lib.evaluation.builtin import stdlib_bodies
    from recipes_lib.models import Transformer

    examples = stdlib_bodies(args.examples).examples  # fewer where the pool runs out
    task_dir = root / "task"
    task_dir.mkdir(parents=True)
    with open(task_dir / "data.jsonl", "w", encoding="utf-8") as f:
        for e in examples:
            row = {"context": e.context, "choices": list(e.choices), "answer": e.answer}
            f.write(json.dumps(row) + "\n")
    (task_dir / f"{TASK}.yaml").write_text(yaml.safe_dump(TASK_YAML, sort_keys=False))

    texts = [e.context + "".join(e.choices) for e in examples]
    tokenizer = train_bpe_tokenizer(texts, args.vocab_size, EOS)
    tokenizer_file = save_tokenizer(tokenizer, root / "tokenizer" / "tokenizer.json")

    config = to_run_config(compose_config([f"model={args.model}"])).model
    if args.smoke:
        config = replace(config, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
        config = replace(config, ffn_dim=128, vocab_size=args.vocab_size)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise SystemExit(f"--vocab-size={args.vocab_size} is larger than the model's vocabulary")
    torch.manual_seed(args.seed)
    model = Transformer(config, "sdpa").eval()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    export_hf_checkpoint(model, config, root / "model", tokenizer_file, eos_token=EOS, dtype=dtype)
    lengths = [len(tokenizer.encode(e.context + c).ids) for e in examples for c in e.choices]
    return {
        "task": TASK,
        "examples": len(examples),
        "requests": sum(len(e.choices) for e in examples),
        "tokens_per_request": round(sum(lengths) / len(lengths), 1),  # a context and a choice
        "tokenizer_vocab": tokenizer.get_vocab_size(),
        "model_vocab": config.vocab_size,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "dtype": "float32" if args.smoke else "bfloat16",
    }


# -------------------------------------------------------------------------- sides
class _Clock:
    """Seconds spent inside the wrapped calls: the model's share of an evaluation
    (lm-eval's ``loglikelihood``: tokenising and scoring the requests)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            started = sync()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += sync() - started

        return timed


def _lm_eval(lm, tasks: list, limit: int | None, seed: int) -> dict:
    """``acc`` and ``acc_norm`` of built tasks with ``lm``, through the library's call of
    lm-eval's ``simple_evaluate`` (``run_lm_eval``), whatever ``lm`` is."""
    from recipes_lib.evaluation.harness import run_lm_eval

    values = run_lm_eval(lm, tasks, limit=limit, num_fewshot=None, chat_template=False, seed=seed)
    return {metric: values[TASK][metric] for metric in ("acc", "acc_norm")}


def _evaluator(args, side: str, root: Path, device: str, clock: _Clock):
    """``(evaluate, lm)``: ``evaluate(limit) -> {"acc", "acc_norm"}`` of ``side``, its
    model loaded and its task built; ``lm`` the lm-eval model it runs (None natively).
    ``clock`` times the scoring inside it."""
    import torch

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    folder, task_dir = root / "model", root / "task"
    if side.startswith("recipes_lib"):
        from recipes_lib.generate import load_for_generation

        loaded = load_for_generation(folder, device=device, dtype=dtype)
        if side == "recipes_lib_native":
            from functools import partial

            from recipes_lib.evaluation.choice import read_choice_file, score_choice_task
            from recipes_lib.evaluation.scoring import score_requests

            task = read_choice_file(task_dir / "data.jsonl", TASK)
            score = partial(
                score_requests,
                loaded.model,
                batch_size=args.rows,
                max_tokens=args.batch_tokens,
            )

            def native(limit: int | None) -> dict:
                return score_choice_task(task.head(limit), loaded.tokenizer, score)

            # tokenising and scoring are all it does, as in lm-eval's loglikelihood
            return clock.wrap(native), None
        from recipes_lib.evaluation.harness import RecipesLM

        rows = args.batch_size if side == "recipes_lib_rows" else args.rows
        tokens = None if side == "recipes_lib_rows" else args.batch_tokens
        lm = RecipesLM(
            loaded.model, loaded.tokenizer, loaded.eos_ids, batch_size=rows, max_tokens=tokens
        )
    else:
        from lm_eval.models.huggingface import HFLM

        batch_size = {"lm_eval_hf_auto": "auto", "lm_eval_hf_rows": args.rows}.get(
            side, args.batch_size
        )
        # what simple_evaluate(model="hf", model_args={"pretrained": folder, "dtype":
        # "bfloat16"}, batch_size=..., device=...) makes, made here once so that loading
        # the model is not timed
        lm = HFLM(pretrained=str(folder), dtype=dtype, batch_size=batch_size, device=device)
    from lm_eval.tasks import TaskManager, get_task_dict

    with contextlib.chdir(task_dir):  # the YAML's data file is relative to its folder
        manager = TaskManager(include_path=str(task_dir), include_defaults=False)
        if side == "recipes_lib":
            from recipes_lib.evaluation.harness import build_lm_eval_tasks

            tasks = list(build_lm_eval_tasks([TASK], task_dir).values())
        else:  # lm-eval's own calls, which build_lm_eval_tasks makes the same way
            tasks = list(get_task_dict([TASK], manager).values())
    lm.loglikelihood = clock.wrap(lm.loglikelihood)  # what lm-eval calls for the requests
    return lambda limit: _lm_eval(lm, tasks, limit, args.seed), lm


def _batch_size(side: str, lm, args) -> int | list[int] | None:
    """The rows per forward pass: ``--batch-size``, or what ``auto`` found."""
    if side in ("recipes_lib", "recipes_lib_native", "lm_eval_hf_rows"):
        return args.rows
    if side != "lm_eval_hf_auto":
        return args.batch_size
    sizes = sorted(set(lm.batch_sizes.values()))
    return sizes[0] if len(sizes) == 1 else (sizes or None)


def run_side(args, side: str, root: Path) -> dict:
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.set_float32_matmul_precision("high")
    started = time.time()
    clock = _Clock()
    evaluate, lm = _evaluator(args, side, root, device, clock)
    load_s = sync() - started
    evaluate(args.warmup_examples)  # warm-up: allocator, kernels, lm-eval's first call
    warmup_s = sync() - started - load_s
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock.seconds = 0.0
    t0 = sync()
    metrics = evaluate(None)
    seconds = sync() - t0
    n = sum(1 for line in (root / "task" / "data.jsonl").open() if line.strip())
    figures = {
        "examples_per_sec": round(n / seconds, 2),
        "seconds": round(seconds, 3),
        # the time inside the scoring calls, and what the pipeline around them took
        "scoring_examples_per_sec": round(n / clock.seconds, 2),
        "scoring_s": round(clock.seconds, 3),
        "harness_s": round(seconds - clock.seconds, 3),
        "examples": n,
        "acc": metrics["acc"],
        "acc_norm": metrics["acc_norm"],
        "batch_size": _batch_size(side, lm, args),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        "load_s": round(load_s, 1),
        "warmup_s": round(warmup_s, 1),
    }
    return figures


# ------------------------------------------------------------------------ driver
def worker(args) -> int:
    """One side, in this process; its figures to ``--worker-out``. Its standard output
    goes to standard error: the parent's holds the JSON alone."""
    root = Path(args.root)
    # the task's dataset is cached beside it, and nothing is looked up on the Hub
    os.environ.setdefault("HF_DATASETS_CACHE", str(root / "datasets_cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.smoke:
        import torch

        torch.set_num_threads(1)  # the sides share the machine's cores at once
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = run_side(args, args.side, root)
        status = 0
    except Exception as err:  # recorded; the other sides still run
        result, status = {"error": f"{type(err).__name__}: {err}"[:2000]}, 1
    Path(args.worker_out).write_text(json.dumps(result))
    return status


def summary(sides: dict) -> dict:
    """Each side against lm-eval's HF backend: its speed (whole evaluations, and the
    scoring calls alone) as a ratio, and its accuracy's difference."""
    base = sides.get(BASELINE, {})
    if not base.get("examples_per_sec"):
        return {}
    out = {}
    for side, figures in sides.items():
        if side == BASELINE or not figures.get("examples_per_sec"):
            continue
        out[side] = {
            "speed": round(figures["examples_per_sec"] / base["examples_per_sec"], 3),
            "scoring_speed": round(
                figures["scoring_examples_per_sec"] / base["scoring_examples_per_sec"], 3
            ),
            "acc_diff": round(figures["acc"] - base["acc"], 4),
            "acc_norm_diff": round(figures["acc_norm"] - base["acc_norm"], 4),
        }
    return {f"vs_{BASELINE}": out}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama_1b", help="a preset of conf/model/")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--examples", type=int, default=2000, help="capped at the task's pool")
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="rows per forward pass (the *_rows sides: "
        "recipes_lib with no token budget, lm_eval_hf)",
    )
    p.add_argument("--rows", type=int, default=256, help="recipes_lib's row cap; lm_eval_hf_rows")
    p.add_argument("--batch-tokens", type=int, default=32768, help="recipes_lib's token budget")
    p.add_argument("--warmup-examples", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=4096, help="the tokenizer's")
    add_peer_arguments(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.examples, args.batch_size, args.warmup_examples = 16, 8, 2
        args.rows, args.batch_tokens = 16, 2048
        args.vocab_size = 512
    check_choices(p, args, sides=SIDES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from _common import emit

    result = report_header(args, "lm_eval", "datasets", "lightning")
    with tempfile.TemporaryDirectory(prefix="eval-peer-") as tmp:
        root = Path(tmp)
        inputs = make_inputs(args, root)
        names = args.sides.split(",")
        # one card: one side at a time; the CPU smoke run starts them all at once
        with ThreadPoolExecutor(max_workers=len(names) if args.smoke else 1) as pool:
            runs = [pool.submit(spawn, args, CASE, side, root, __file__) for side in names]
            sides = dict(zip(names, (run.result() for run in runs), strict=True))
    status = any("error" in figures for figures in sides.values())
    result["cases"][CASE] = {**inputs, "sides": sides, **summary(sides)}
    emit(result, args.out)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
