r"""Where a training step's GPU time goes: kernels by kind, idle gaps, exposed communication.

Composes a run from Hydra overrides as ``recipes-train`` would, trains it on random
tokens through the library's own trainer and module builders, and records
``--steps`` steps after ``--warmup-steps`` with ``torch.profiler`` (CPU and CUDA). Each
rank reads its own kernel timeline and reports, per step:

    kernel_ms        GPU time of each kind of kernel (matmul, float8 matmul, attention,
                     compiled (Triton), optimizer, communication, copies, other)
    busy_ms          time at least one kernel runs (the union of kernel intervals)
    idle_ms          step time minus busy time: the GPU waits on the host or on a peer
    comm_ms          time a communication (NCCL) kernel runs
    exposed_comm_ms  time a communication kernel runs while no compute kernel does,
                     i.e. what overlapping it with compute would win back

plus the slowest kernels by total time. The profiler's own overhead makes the steps
somewhat slower than unprofiled ones; compare the shares, and time with
``pretrain_throughput.py`` / ``scaling.py``. One GPU, or several under torchrun::

    python benchmarks/profile_step.py recipe=pretrain/llama_1b precision=fp8 --out p.json
    torchrun --standalone --nproc_per_node=4 benchmarks/profile_step.py \
        recipe=pretrain/llama_1b strategy=fsdp --out p.json

``--trace DIR`` keeps each rank's Chrome trace (``rank<r>.json``, viewable in Perfetto).
``--smoke`` profiles the tiny recipe on CPU (no kernels: the report is then empty of
GPU figures but the path runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch
from _common import command_line, device_name, emit, package_versions, synchronize

# Kernel kinds, the first whose test matches a kernel's lower-cased name wins.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")),
    ("matmul_fp8", ("e4m3", "e5m2", "f8f8", "fp8")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "sm90_", "sm80_")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "fused_sgd")),
    ("compiled", ("triton",)),
)
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")
TOP_KERNELS = 15


# cuBLASLt's Hopper GEMMs are named nvjet_sm90_<operand types>tst_...: plain "tst" for
# bf16 operands, "qqtst" / "qrtst" for float8 ones (in a float8 run there are exactly as
# many of them per step as float8 Linear layers times three: forward, two backward)
FP8_NVJET = re.compile(r"^nvjet_sm\d+_q[a-z]tst")


def kernel_kind(name: str, category: str = "kernel") -> str:
    """The kind of a GPU timeline event, from its trace category and kernel name."""
    if category in COPY_CATEGORIES:
        return "copy"
    lowered = name.lower()
    if FP8_NVJET.match(lowered):
        return "matmul_fp8"
    for kind, needles in KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def analyse_timeline(events: list[dict], steps: int, step_ms: float) -> dict:
    """Per-step figures of one GPU's timeline (Chrome-trace events, times in µs).

    Args:
        events: the trace's complete events (``ph == "X"``) of categories ``kernel``,
            ``gpu_memcpy`` and ``gpu_memset``.
        steps: how many training steps the events cover.
        step_ms: the measured time of one step (ms).
    """
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    everything, compute, comm = [], [], []
    for event in events:
        start, dur = float(event["ts"]), float(event.get("dur", 0.0))
        span = (start, start + dur)
        kind = kernel_kind(event.get("name", ""), event.get("cat", "kernel"))
        by_kind[kind] += dur
        entry = by_name[event.get("name", "?")]
        entry[0] += dur
        entry[1] += 1
        everything.append(span)
        (comm if kind == "communication" else compute).append(span)
    busy = union_length(everything)
    busy_compute = union_length(compute)
    per_step = 1e-3 / max(steps, 1)  # µs over all steps -> ms per step
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {
        "step_ms": round(step_ms, 3),
        "kernel_ms": {k: round(v * per_step, 3) for k, v in sorted(by_kind.items())},
        "busy_ms": round(busy * per_step, 3),
        "idle_ms": round(max(step_ms - busy * per_step, 0.0), 3),
        "comm_ms": round(union_length(comm) * per_step, 3),
        "exposed_comm_ms": round((busy - busy_compute) * per_step, 3),
        "top_kernels": [
            {
                "name": name[:160],
                "kind": kernel_kind(name),
                "ms_per_step": round(total * per_step, 3),
                "calls_per_step": round(count / max(steps, 1), 2),
            }
            for name, (total, count) in top
        ],
    }


def gpu_events(trace: dict) -> list[dict]:
    """The GPU-side complete events (kernels, copies, sets) of a Chrome trace."""
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", *COPY_CATEGORIES)
    ]


class ProfiledSteps(L.Callback):
    """Runs ``torch.profiler`` from the first measured batch to the end of the last."""

    def __init__(self, warmup_steps: int, total_steps: int, device: torch.device):
        self.warmup_steps, self.total_steps, self.device = warmup_steps, total_steps, device
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup_steps:
            synchronize(self.device)
            self.profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.total_steps - 1:
            synchronize(self.device)
            self.profiler.stop()


def profile(args) -> dict:
    """Profile the composed run on this rank; every rank's report, on rank 0."""
    from _library import (
        compose_run,
        fit_measured,
        measured_run_overrides,
        meta_transformer,
        rank_and_device,
        synthetic_batches,
    )

    rank, world_size, device = rank_and_device(cpu=args.smoke)
    total = args.warmup_steps + args.steps
    with tempfile.TemporaryDirectory(prefix="recipes-profile-") as root:
        overrides = list(args.overrides)
        if args.smoke:
            overrides = ["recipe=pretrain/tiny", "precision=32-true", *overrides]
        cfg = compose_run(
            [
                *overrides,
                *measured_run_overrides(
                    steps=total,
                    seq_len=args.seq_len,
                    batch_size=args.micro_batch,
                    accelerator="cpu" if args.smoke else "gpu",
                    devices=world_size,
                    run_dir=root,
                    seed=args.seed,
                ),
            ]
        )
        batches = synthetic_batches(
            cfg.model.vocab_size, args.micro_batch, args.seq_len, total, seed=args.seed + rank
        )
        profiled = ProfiledSteps(args.warmup_steps, total, device)
        fit = fit_measured(
            cfg,
            batches,
            warmup_steps=args.warmup_steps,
            device=device,
            world_size=world_size,
            callbacks=[profiled],
        )
        trace_path = Path(root) / f"rank{rank}.json"
        profiled.profiler.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            trace_path.replace(Path(args.trace) / trace_path.name)
    step_ms = fit.timer.step_times_ms()
    mean_step_ms = sum(step_ms) / len(step_ms)
    report = analyse_timeline(gpu_events(trace), len(step_ms), mean_step_ms)
    report["rank"] = rank
    flops_per_token = meta_transformer(cfg.model).flops_per_token(args.seq_len)
    tokens_per_step = args.micro_batch * args.seq_len
    report["tflops_per_gpu_under_profiler"] = round(
        tokens_per_step * flops_per_token / (mean_step_ms * 1e-3) / 1e12, 2
    )
    reports = [report]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        reports = [None] * world_size
        torch.distributed.all_gather_object(reports, report)
    return {
        "device": device_name(device),
        "world_size": world_size,
        "strategy": cfg.strategy.name,
        "precision": cfg.precision.name,
        "model": cfg.model.name,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "ranks": reports,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. recipe=pretrain/llama_1b")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--trace", default=None, help="folder for each rank's Chrome trace")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny recipe on CPU, a few steps")
    args = p.parse_intermixed_args(argv)  # overrides may follow the options
    if args.smoke:
        args.seq_len, args.micro_batch, args.warmup_steps = 64, 2, 1
        args.steps = min(args.steps, 2)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    rank = int(os.environ.get("RANK", 0))
    with contextlib.redirect_stdout(sys.stderr):
        found = profile(args)
    if rank == 0:
        emit(
            {
                "benchmark": "profile_step",
                "command": command_line(),
                "versions": package_versions("lightning", "recipes-lib"),
                "overrides": args.overrides,
                "warmup_steps": args.warmup_steps,
                "steps": args.steps,
                **found,
            },
            args.out,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
