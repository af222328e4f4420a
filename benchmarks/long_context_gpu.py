r"""Long context on GPUs: activation offload against keeping the block inputs, and a
long-context recipe's steps against the launch check's estimate.

``offload`` (one GPU): a model of ``--model``'s shape at ``--seq-len`` tokens, bf16
autocast over fp32 weights, every block recomputed, trained for a few steps with and
without ``kernels.activation_offload`` (eager, then compiled blocks): the peak memory
(``torch.cuda.max_memory_allocated``), the median step time, and the loss and gradients
of the first step against those without offload::

    python benchmarks/long_context_gpu.py offload --out $OUT/offload_h100.json

``docs``: the synthetic long-document mix the figures in ``results/long_context_*``
were measured on (:func:`documents`)::

    python benchmarks/long_context_gpu.py docs --out /tmp/lc

``run`` (under torchrun, one process a GPU): ``recipes_lib.train.run`` on the overrides
given (a long-context recipe); each rank writes its peak memory and the run's logged
losses and throughput, rank 0 the estimate of the same config::

    torchrun --nproc_per_node=4 benchmarks/long_context_gpu.py run --out $OUT/cpt_long \
        recipe=cpt/long data.sources.main.path=... trainer.max_steps=3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

GIB = 2**30


def _offload_case(model_cfg, seq_len: int, offload: bool, compiled: bool, steps: int) -> dict:
    from recipes_lib.config.schema import KernelsConfig, PrecisionConfig, StrategyConfig
    from recipes_lib.training.build import ModelBuild, build_model

    kernels = KernelsConfig(
        attention="sdpa",
        activation_checkpointing="full",
        activation_offload=offload,
        compile=compiled,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(
            ModelBuild(model_cfg, kernels, PrecisionConfig(name="bf16-mixed"), StrategyConfig()),
            device=torch.device("cuda"),
        )
    generator = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, model_cfg.vocab_size, (1, seq_len), device="cuda", generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    times, first_loss, grads = [], None, None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for step in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels, loss_chunk_size=1024)
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step == 0:
            first_loss = loss.item()
            grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    copies = model.activation_offload.copies if model.activation_offload is not None else 0
    del model
    torch.cuda.empty_cache()
    return {
        "offload": offload,
        "compiled": compiled,
        "peak_memory_gib": round(peak / GIB, 3),
        "peak_above_weights_gib": round((peak - base) / GIB, 3),
        "step_ms_median": round(1e3 * statistics.median(times[1:]), 1),
        "first_loss": first_loss,
        "offloaded_tensors": copies,
        "_grads": grads,
    }


def _worst(a: dict, b: dict) -> float:
    """The largest relative difference (in norm) between two sets of gradients."""
    return max(((b[n] - g).norm() / g.norm().clamp(min=1e-12)).item() for n, g in a.items())


def offload(args: argparse.Namespace) -> dict:
    from recipes_lib.config import compose_config, to_run_config

    cfg = to_run_config(
        compose_config([f"model={args.model}", f"model.max_seq_len={args.seq_len}", "trainer=gpu"])
    )
    cases = []
    for compiled in (False, True) if args.compiled else (False,):
        kept = _offload_case(cfg.model, args.seq_len, False, compiled, args.steps)
        again = _offload_case(cfg.model, args.seq_len, False, compiled, args.steps)
        moved = _offload_case(cfg.model, args.seq_len, True, compiled, args.steps)
        # the same run twice gives the noise floor of the kernels' own nondeterminism
        again["largest_relative_grad_difference"] = _worst(kept["_grads"], again["_grads"])
        moved["largest_relative_grad_difference"] = _worst(kept["_grads"], moved["_grads"])
        for case in (again, moved):
            case["loss_difference"] = abs(case["first_loss"] - kept["first_loss"])
        for case in (kept, again, moved):
            case.pop("_grads")
        cases += [kept, again, moved]
    return {
        "device": torch.cuda.get_device_name(0),
        "model": args.model,
        "seq_len": args.seq_len,
        "cases": cases,
    }


def run(args: argparse.Namespace, overrides: list[str]) -> None:
    from recipes_lib.config import compose_config, to_run_config
    from recipes_lib.launch_check import estimate_memory
    from recipes_lib.train import run as train

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    composed = compose_config(overrides)
    started = time.perf_counter()
    result = train(composed)
    seconds = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "device": torch.cuda.get_device_name(local),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(local) / GIB, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(local) / GIB, 3),
        "seconds": round(seconds, 1),
        "overrides": overrides,
    }
    if rank == 0:
        cfg = to_run_config(composed)
        est = estimate_memory(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        record["estimate"] = est.as_gib()
        record["estimate_notes"] = list(est.notes)
        record["metrics"] = result.metrics
        record["tokens_seen"] = result.tokens_seen
        record["fit_seconds"] = round(result.seconds, 1)
        for csv in Path(result.output_dir).rglob("metrics.csv"):  # the logged curve
            (out / "metrics.csv").write_text(csv.read_text())
            break
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")


def documents(out: Path, count: int, seed: int = 0) -> None:
    """``out/main.jsonl``: ``count`` long documents of 60,000-200,000 words; and
    ``out/short.jsonl``: 6,000 of 100-800 words. The words are syllable strings drawn
    with Zipf frequencies (3,000 of them), a full stop every 17 words: text with a
    word distribution like natural text's, no repetition to memorise, and documents
    long enough that a 128K-token row holds one or two of them."""
    import random

    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa"]
    syllables += ["te", "vo", "zi", "pa", "do", "ge"]  # codespell:ignore te
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]

    def text(n: int) -> str:
        body = rng.choices(words, weights, k=n)
        return " ".join(w + ("." if i % 17 == 16 else "") for i, w in enumerate(body))

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "main.jsonl", "w") as f:
        for _ in range(count):
            f.write(json.dumps({"text": text(rng.randint(60_000, 200_000))}) + "\n")
    with open(out / "short.jsonl", "w") as f:
        for _ in range(6000):
            f.write(json.dumps({"text": text(rng.randint(100, 800))}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["offload", "run", "docs"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="qwen3_1_7b")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--count", type=int, default=48, help="docs: long documents")
    parser.add_argument(
        "--no-compiled", dest="compiled", action="store_false", help="eager blocks only"
    )
    args, overrides = parser.parse_known_args()
    if args.mode == "offload":
        report = offload(args)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
    elif args.mode == "docs":
        documents(Path(args.out), args.count)
    else:
        run(args, overrides)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
