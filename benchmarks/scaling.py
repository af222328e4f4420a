r"""Data-parallel scaling of the 1B pretraining recipe: tokens/s on 1, 2 and 4 GPUs.

The driver launches one ``torchrun --standalone --nproc_per_node=N`` job of this script
(``--worker``) per configuration, one after another, each under its own time limit, and
prints one JSON object. Each worker composes ``recipe=pretrain/llama_1b`` (Llama 3.2 1B
shape, sequence 2048, bf16-mixed, compiled blocks) with ``strategy=<s>``,
``trainer.devices=N`` and a fixed micro-batch per GPU (no accumulation), builds the
trainer and module with the library's own builders, and trains on uniformly random
tokens (each rank its own). The first ``--warmup-steps`` steps are not timed; then
``--steps`` steps are timed on rank 0 between CUDA synchronizations. Figures per
configuration::

    tokens_per_sec           = N * micro_batch * seq_len * steps / seconds  (all ranks)
    tokens_per_sec_per_gpu   = tokens_per_sec / N
    mfu                      = tokens_per_sec * flops_per_token / (N * peak bf16 TFLOP/s)
    scaling_efficiency       = tokens_per_sec(N) / (N * tokens_per_sec(1)), same strategy
    efficiency_vs_single     = tokens_per_sec(N) / (N * tokens_per_sec of strategy=single
                               on 1 GPU)
    peak_memory_gib          = the largest max_memory_allocated over the ranks
    step_time_ms             = rank 0's per-step times (mean/median/min/max, and each)
    gc_pauses                = Python garbage-collector pauses in the timed window, per
                               rank (count, full collections, total and longest ms)

Runs use the library's ``GarbageCollection`` callback (``callbacks=minimal`` has it:
automatic collection off, a collection every ``--gc-every-n-steps`` steps on all ranks
at once). A strategy written ``NAME+autogc`` (``fsdp+autogc``) runs NAME without it,
under Python's automatic collector, so the two can be compared in one run. ``hsdp``
runs with ``strategy.replicas=2`` on an even number of GPUs: two replicas, each sharded
over half the GPUs, as two nodes would be (one node's links are faster than two's).

On a machine with 4 GPUs::

    python benchmarks/scaling.py --gpus 1,2,4 --strategies fsdp,ddp --out $OUT/scaling.json

The JSON is also rewritten after every configuration, so a run that is stopped keeps
what it measured. A configuration that fails or runs past ``--timeout-s`` is recorded as
``{"error": ...}`` (with the tail of its log) and the rest still run; the exit status is
then 1. ``--smoke`` runs the tiny recipe on CPU with gloo (fp32, no compilation) on 1 and
2 processes with ``ddp`` (``--strategies ddp,fsdp`` adds FSDP), in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import (
    GcPauses,
    command_line,
    device_name,
    emit,
    package_versions,
    peak_bf16_tflops,
    step_time_stats,
)
from _jobs import launch_torchrun, worker_main

HERE = Path(__file__).resolve()
GPU_RECIPE = "pretrain/llama_1b"
SMOKE_RECIPE = "pretrain/tiny"
STRATEGIES = ("single", "ddp", "fsdp", "hsdp")
GC_SUFFIX = "+autogc"  # NAME+autogc: NAME without the GarbageCollection callback
EP_SUFFIX = "+ep"  # fsdp+ep: fsdp with a mixture's experts spread over the ranks
LOG_TAIL_CHARS = 3000


# ---------------------------------------------------------------------------- worker
def worker_overrides(args, world_size: int, run_dir: str) -> list[str]:
    from _library import measured_run_overrides

    recipe = SMOKE_RECIPE if args.smoke else args.recipe
    extra = ["precision=32-true", "kernels.compile=false"] if args.smoke else []
    if args.expert_parallel:
        extra.append("strategy.expert_parallel=true")
    if args.strategy == "hsdp":  # one node here: two replicas stand for two nodes
        extra.append(f"strategy.replicas={2 if world_size % 2 == 0 else 1}")
    if args.auto_gc:
        extra.append("~callbacks.gc")
    else:
        extra.append(f"callbacks.gc.every_n_steps={args.gc_every_n_steps}")
    return [
        f"recipe={recipe}",
        f"strategy={args.strategy}",
        *extra,
        *measured_run_overrides(
            steps=args.warmup_steps + args.steps,
            seq_len=args.seq_len,
            batch_size=args.micro_batch,
            accelerator="cpu" if args.smoke else "gpu",
            devices=world_size,
            run_dir=run_dir,
            seed=args.seed,
        ),
    ]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` of all ranks (every rank must call this)."""
    if not _distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor.item())


def _gathered(summary: dict, device: torch.device) -> list[dict]:
    """Every rank's ``summary`` (a dict of numbers, same keys on all ranks), by rank."""
    keys = sorted(summary)
    if not _distributed():
        return [summary]
    local = torch.tensor([float(summary[k]) for k in keys], dtype=torch.float64, device=device)
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, local)
    return [
        {k: round(float(v), 3) for k, v in zip(keys, part.tolist(), strict=True)} for part in parts
    ]


def run_worker(args) -> dict:
    """One configuration, in one of the ``torchrun`` processes; rank 0's figures."""
    from _common import synchronize
    from _library import (
        compose_run,
        fit_measured,
        meta_transformer,
        rank_and_device,
        synthetic_batches,
    )

    rank, world_size, device = rank_and_device(cpu=args.smoke)
    with tempfile.TemporaryDirectory(prefix="recipes-scaling-") as root:
        cfg = compose_run(worker_overrides(args, world_size, root))
        batches = synthetic_batches(
            cfg.model.vocab_size,
            args.micro_batch,
            args.seq_len,
            args.warmup_steps + args.steps,
            seed=args.seed + rank,  # each rank its own data, as in training
        )
        with GcPauses() as pauses:
            fit = fit_measured(
                cfg, batches, warmup_steps=args.warmup_steps, device=device, world_size=world_size
            )
    synchronize(device)
    gc_pauses = _gathered(pauses.summary(*fit.timer.window), device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    peak = _max_over_ranks(peak, device)
    name = device_name(device)
    peak_tflops = None if args.smoke else peak_bf16_tflops(name)
    flops_per_token = meta_transformer(cfg.model).flops_per_token(args.seq_len)
    step_ms = fit.timer.step_times_ms()
    tokens_per_sec = world_size * args.micro_batch * args.seq_len * len(step_ms)
    tokens_per_sec /= fit.timer.total_s
    tflops = tokens_per_sec * flops_per_token / 1e12
    return {
        "device": name,
        "world_size": world_size,
        "strategy": args.strategy
        + (EP_SUFFIX if args.expert_parallel else "")
        + (GC_SUFFIX if args.auto_gc else ""),
        "trainer_strategy": type(fit.trainer.strategy).__name__,
        "tokens_per_sec": round(tokens_per_sec, 1),
        "tokens_per_sec_per_gpu": round(tokens_per_sec / world_size, 1),
        "tflops": round(tflops, 3),
        "mfu": round(tflops / (peak_tflops * world_size), 4) if peak_tflops else None,
        "step_time_ms_median": round(sorted(step_ms)[len(step_ms) // 2], 3),
        "step_time_ms": {**step_time_stats(step_ms), "each": [round(t, 2) for t in step_ms]},
        "gc_pauses": gc_pauses,
        "gc_every_n_steps": None if args.auto_gc else args.gc_every_n_steps,
        "measured_steps": len(step_ms),
        "peak_memory_gib": round(peak, 3) if device.type == "cuda" else None,
        "final_loss_rank0": round(fit.final_loss, 5),
        "num_params": meta_transformer(cfg.model).num_params(),
        "flops_per_token": flops_per_token,
    }


# ---------------------------------------------------------------------------- driver
def split_strategy(name: str) -> tuple[str, bool, bool]:
    """``fsdp+autogc`` -> (``fsdp``, True, False); ``fsdp+ep`` -> (``fsdp``, False, True):
    the strategy, whether under Python's automatic GC, whether expert-parallel."""
    auto_gc = name.endswith(GC_SUFFIX)
    name = name.removesuffix(GC_SUFFIX)
    return name.removesuffix(EP_SUFFIX), auto_gc, name.endswith(EP_SUFFIX)


def launch(args, strategy: str, gpus: int, timeout_s: float) -> dict:
    """One ``torchrun`` job; its rank-0 fragment, or an error with the log's tail."""
    base, auto_gc, expert_parallel = split_strategy(strategy)
    arguments = [
        f"--strategy={base}",
        f"--recipe={args.recipe}",
        *(["--expert-parallel"] if expert_parallel else []),
        f"--gc-every-n-steps={args.gc_every_n_steps}",
        *(["--auto-gc"] if auto_gc else []),
        f"--micro-batch={args.micro_batch}",
        f"--seq-len={args.seq_len}",
        f"--warmup-steps={args.warmup_steps}",
        f"--steps={args.steps}",
        f"--seed={args.seed}",
        *(["--smoke"] if args.smoke else []),
    ]
    return launch_torchrun(
        HERE,
        gpus,
        arguments,
        smoke=args.smoke,
        timeout_s=timeout_s,
        tail_chars=LOG_TAIL_CHARS,
        prefix="recipes-scaling-",
    )


def _efficiency(runs: dict, key: str, base_key: str, gpus: int) -> float | None:
    run, base = runs.get(key, {}), runs.get(base_key, {})
    tps, base_tps = run.get("tokens_per_sec"), base.get("tokens_per_sec")
    if not tps or not base_tps:
        return None
    return round(tps / (gpus * base_tps), 4)


def _one_gpu_key(runs: dict, strategy: str) -> str:
    """The 1-GPU run a strategy's scaling is measured against: its own, or for a
    ``NAME+autogc`` variant not run on 1 GPU, NAME's."""
    own = f"{strategy}/1"
    return own if own in runs else f"{split_strategy(strategy)[0]}/1"


def summarize(runs: dict, strategies: list[str]) -> dict:
    """Scaling efficiency of each run against 1 GPU of its strategy and of ``single``."""
    table: dict = {}
    gpus = sorted({int(key.split("/")[1]) for key in runs})
    for strategy in strategies:
        for n in gpus:
            key = f"{strategy}/{n}"
            if key not in runs:
                continue
            table[key] = {
                "tokens_per_sec": runs[key].get("tokens_per_sec"),
                "tokens_per_sec_per_gpu": runs[key].get("tokens_per_sec_per_gpu"),
                "mfu": runs[key].get("mfu"),
                "peak_memory_gib": runs[key].get("peak_memory_gib"),
                "scaling_efficiency": _efficiency(runs, key, _one_gpu_key(runs, strategy), n),
                "efficiency_vs_single": _efficiency(runs, key, "single/1", n),
            }
    return table


def _strategies_of(runs: dict, args) -> list[str]:
    """This call's strategies and those of the runs it resumed, in order, once each."""
    return list(dict.fromkeys(["single", *args.strategies, *(k.split("/")[0] for k in runs)]))


def driver_main(args) -> dict:
    configs = [("single", 1)] if args.single_baseline else []
    configs += [(s, n) for s in args.strategies for n in args.gpus if (s, n) != ("single", 1)]
    available = torch.cuda.device_count() if not args.smoke else os.cpu_count() or 1
    if not args.smoke and available == 0:
        raise SystemExit("no CUDA device; run with --smoke for the CPU check")
    result: dict = {
        "benchmark": "scaling",
        "device": None,  # from the workers: the driver leaves the GPUs alone
        "gpus_available": None if args.smoke else available,
        "versions": package_versions("lightning", "recipes-lib"),
        "command": command_line(),
        "settings": {
            "recipe": SMOKE_RECIPE if args.smoke else args.recipe,
            "precision": "32-true" if args.smoke else "bf16-mixed (the recipe's)",
            "compile": "off" if args.smoke else "each block (the recipe's sdpa_compiled)",
            "micro_batch_per_gpu": args.micro_batch,
            "seq_len": args.seq_len,
            "accumulate_grad_batches": 1,
            "warmup_steps": args.warmup_steps,
            "steps": args.steps,
            "timeout_s_per_config": args.timeout_s,
            "budget_s": args.budget_s,
            "data": "uniformly random tokens, each rank its own",
            "launcher": "torchrun --standalone --nproc_per_node=N (one job per config)",
            "seed": args.seed,
            "gc_every_n_steps": f"{args.gc_every_n_steps} (none in NAME{GC_SUFFIX} runs)",
        },
        "runs": {},
        "summary": {},
    }
    if args.resume and Path(args.resume).is_file():
        # configurations measured by an earlier call on this machine (not failed ones)
        earlier = json.loads(Path(args.resume).read_text())
        result["runs"] = {k: v for k, v in earlier.get("runs", {}).items() if "tokens_per_sec" in v}
        result["device"] = earlier.get("device")
    started = time.perf_counter()
    for strategy, n in configs:
        key = f"{strategy}/{n}"
        left = args.budget_s - (time.perf_counter() - started)
        if key in result["runs"]:
            continue
        if not args.smoke and n > available:
            result["runs"][key] = {"skipped": f"needs {n} GPUs, {available} visible"}
        elif left < 30:
            result["runs"][key] = {"skipped": f"time budget of {args.budget_s} s used up"}
        else:
            print(f"[scaling] {key} ...", file=sys.stderr, flush=True)
            result["runs"][key] = launch(args, strategy, n, min(args.timeout_s, left))
            print(f"[scaling] {key}: {result['runs'][key]}", file=sys.stderr, flush=True)
            result["device"] = result["device"] or result["runs"][key].get("device")
        result["summary"] = summarize(result["runs"], _strategies_of(result["runs"], args))
        if args.out:  # keep what is measured so far
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["summary"] = summarize(result["runs"], _strategies_of(result["runs"], args))
    emit(result, args.out)
    return result


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="1,2,4", help="process counts, e.g. 1,2,4")
    p.add_argument(
        "--strategies",
        default=None,
        help=f"subset of {STRATEGIES}, each also as NAME{GC_SUFFIX} (fsdp,ddp; ddp with --smoke)",
    )
    p.add_argument(
        "--no-single-baseline",
        dest="single_baseline",
        action="store_false",
        help="skip strategy=single on 1 GPU (the efficiency_vs_single baseline)",
    )
    p.add_argument("--recipe", default=GPU_RECIPE, help="the recipe measured on GPUs")
    p.add_argument("--expert-parallel", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--gc-every-n-steps",
        type=int,
        default=10,
        help="steps between the GarbageCollection callback's collections",
    )
    p.add_argument("--auto-gc", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=240.0, help="per configuration")
    p.add_argument("--budget-s", type=float, default=560.0, help="all configurations")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "--resume",
        default=None,
        help="a JSON of an earlier call on this machine: keep its measured configurations "
        "(e.g. --gpus 1,2 first, then --gpus 4 --resume the same file)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny recipe on CPU (gloo), 1-2 procs")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.gpus = _ints(args.gpus)
    if args.strategies is None:
        args.strategies = "ddp" if args.smoke else "fsdp,ddp"
    args.strategies = [s for s in args.strategies.split(",") if s]
    if unknown := {s for s in args.strategies if split_strategy(s)[0] not in STRATEGIES}:
        p.error(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    if args.smoke and not args.worker:
        args.gpus = [n for n in args.gpus if n <= 2] or [1, 2]
        args.seq_len, args.micro_batch = 64, 2
        args.warmup_steps, args.steps = 1, 2
        args.timeout_s = min(args.timeout_s, 60.0)
    if args.worker and not args.fragment:
        p.error("--worker needs --fragment")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        sys.exit(worker_main(lambda: run_worker(arguments), arguments.fragment))
    figures = driver_main(arguments)

    def _failed(report: dict) -> bool:
        return "error" in report

    sys.exit(1 if any(_failed(r) for r in figures["runs"].values()) else 0)
