r"""How long training stalls per checkpoint: sharded FSDP saves, synchronous vs asynchronous.

The driver launches one ``torchrun --standalone --nproc_per_node=N`` job of this script
(``--worker``) per mode, one after another, and prints one JSON object. Each worker
composes ``recipe=pretrain/llama_1b`` (Llama 3.2 1B, sequence 2048, bf16-mixed, compiled
blocks) with ``strategy=fsdp``, ``trainer.devices=N`` and a fixed micro-batch per GPU,
builds the trainer and module with the library's own builders and trains on uniformly
random tokens. Modes:

    none    no checkpoint in the run: the baseline step time
    sync    a sharded checkpoint every ``--every`` steps, written in the foreground
            (strategy.async_checkpoint=false, the default)
    async   the same, written in the background (strategy.async_checkpoint=true):
            training waits only while DCP copies each rank's shards to host memory

A checkpoint is what a run writes: model and AdamW state sharded over the ranks (12
bytes per parameter in bf16-mixed: fp32 weights and two fp32 moments), written under a
hidden name, hashed (SHA-256, a share of the files per rank) and renamed into place,
then the run's retention (``run.keep_last_checkpoints=1`` here, so the disk holds at
most two) applied. The last step is not a checkpoint step (the run's last save is
always synchronous). Figures per mode, rank 0's (``DEFINITIONS`` below, also in the
JSON): ``save_blocked_s`` (the stall), ``landed_s``, ``overhead_per_checkpoint_s``,
``checkpoint_gib``, ``write_gib_per_s``, ``verify_s``, and every timed step's time
(``checkpoint_step_ms``: the steps a save fell in).

Usage on a machine with 2 GPUs (``--checkpoint-dir`` on the disk checkpoints would go
to; it needs room for two checkpoints, about 30 GB at 1B)::

    python benchmarks/checkpoint_stall.py --gpus 2 --checkpoint-dir /local/ckpt \
        --out $OUT/checkpoint_stall.json

The JSON is rewritten after every mode, so a stopped run keeps what it measured;
``--modes async --resume FILE`` adds a mode to an earlier call's file. A mode that fails
or runs past ``--timeout-s`` is recorded as ``{"error": ...}`` with the tail of its log;
the exit status is then 1. ``--smoke`` runs the tiny recipe on CPU over gloo (two
processes, fp32, no compilation) in well under a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import command_line, device_name, emit, package_versions, step_time_stats
from _jobs import launch_torchrun, worker_main

HERE = Path(__file__).resolve()
GPU_RECIPE = "pretrain/llama_1b"
SMOKE_RECIPE = "pretrain/tiny"
MODES = ("none", "sync", "async")
LOG_TAIL_CHARS = 3000
DEFINITIONS = {
    "save_blocked_s": "seconds inside trainer.save_checkpoint per checkpoint, CUDA "
    "synchronized before and after: the stall training sees (state dict, copy or write, "
    "hash, rename, retention)",
    "landed_s": "seconds from the start of a save until its folder was in place (async: "
    "the background write; sync: the same as save_blocked_s)",
    "overhead_per_checkpoint_s": "(timed seconds of the mode - timed seconds of mode "
    "none) / checkpoints: the stall plus any slowdown of steps run during a background write",
    "checkpoint_gib": "size of one checkpoint folder; write_gib_per_s = size / landed_s",
    "verify_s": "seconds to check the last checkpoint against its SHA-256s on one process, "
    "what a resume pays once (read from the page cache here: hashing speed, not the disk's)",
    "checkpoint_step_ms": "the timed steps a save fell in (normal_step_ms_median: the rest)",
}
# what measured_run_overrides sets to write no checkpoint, replaced here
_NO_CHECKPOINTS = ("run.save_top_k=", "callbacks.checkpoint.save_last=")


# ---------------------------------------------------------------------------- worker
def worker_overrides(args, world_size: int) -> list[str]:
    from _library import measured_run_overrides

    base = measured_run_overrides(
        steps=args.warmup_steps + args.steps,
        seq_len=args.seq_len,
        batch_size=args.micro_batch,
        accelerator="cpu" if args.smoke else "gpu",
        devices=world_size,
        run_dir=args.run_dir,
        seed=args.seed,
    )
    overrides = [
        f"recipe={SMOKE_RECIPE if args.smoke else GPU_RECIPE}",
        "strategy=fsdp",
        *[o for o in base if not o.startswith(_NO_CHECKPOINTS)],
        f"strategy.async_checkpoint={'true' if args.mode == 'async' else 'false'}",
        "run.keep_last_checkpoints=1",
    ]
    if args.mode == "none":
        overrides += ["run.save_top_k=0", "callbacks.checkpoint.save_last=false"]
    else:
        overrides += [f"run.checkpoint_every_n_steps={args.every}", "run.save_top_k=-1"]
    if args.smoke:
        overrides += ["precision=32-true", "kernels.compile=false"]
    elif not args.compile:
        overrides.append("kernels.compile=false")
    return overrides


def _timed_saves(device: torch.device):
    """A callback that times every ``trainer.save_checkpoint`` (CUDA synchronized before
    and after, so the time is what the training loop lost)."""
    import lightning as L
    from _common import synchronize

    class TimedSaves(L.Callback):
        def __init__(self):
            self.saves: list[dict] = []

        def setup(self, trainer, pl_module, stage) -> None:
            save = trainer.save_checkpoint

            def timed(filepath, *args, **kwargs):
                synchronize(device)
                started = time.perf_counter()
                save(filepath, *args, **kwargs)
                synchronize(device)
                seconds = time.perf_counter() - started
                self.saves.append({"step": trainer.global_step, "blocked_s": seconds})

            trainer.save_checkpoint = timed  # ModelCheckpoint calls it through the trainer

    return TimedSaves()


def run_worker(args) -> dict:
    """One mode, in one of the ``torchrun`` processes; rank 0's figures."""
    from _library import compose_run, fit_measured, rank_and_device, synthetic_batches

    from recipes_lib.checkpoint.integrity import forget_verified, verify_checkpoint
    from recipes_lib.checkpoint.layout import RunDir
    from recipes_lib.checkpoint.weights import list_step_checkpoints

    rank, world_size, device = rank_and_device(cpu=args.smoke)
    cfg = compose_run(worker_overrides(args, world_size))
    total = args.warmup_steps + args.steps
    batches = synthetic_batches(
        cfg.model.vocab_size, args.micro_batch, args.seq_len, total, seed=args.seed + rank
    )
    saves = _timed_saves(device)
    fit = fit_measured(
        cfg,
        batches,
        warmup_steps=args.warmup_steps,
        device=device,
        world_size=world_size,
        callbacks=[saves],
    )
    step_ms = fit.timer.step_times_ms()
    # a save after step s falls in the timed interval of the step after it
    after = [s["step"] - args.warmup_steps for s in saves.saves]
    in_window = [i for i in after if 0 <= i < len(step_ms)]
    normal = [t for i, t in enumerate(step_ms) if i not in in_window]
    report = {
        "device": device_name(device),
        "world_size": world_size,
        "mode": args.mode,
        "trainer_strategy": type(fit.trainer.strategy).__name__,
        "measured_steps": len(step_ms),
        "timed_s": round(fit.timer.total_s, 3),
        "step_time_ms": {**step_time_stats(step_ms), "each": [round(t, 2) for t in step_ms]},
        "normal_step_ms_median": round(statistics.median(normal), 3) if normal else None,
        "checkpoint_step_ms": [round(step_ms[i], 2) for i in sorted(in_window)],
        "checkpoints": len(saves.saves),
        "save_blocked_s": [round(s["blocked_s"], 4) for s in saves.saves],
        "final_loss_rank0": round(fit.final_loss, 5),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        if device.type == "cuda"
        else None,
    }
    writer = getattr(fit.trainer.strategy, "checkpoint_writer", None)
    timings = list(writer.timings) if writer is not None else []
    report["landed_s"] = [round(t.finished_s, 4) for t in timings if t.finished_s is not None]
    report["written_in_background"] = [t.asynchronous for t in timings]
    if timings and timings[-1].bytes:
        size = timings[-1].bytes
        report["checkpoint_gib"] = round(size / 2**30, 3)
        landed = [t.finished_s for t in timings if t.finished_s]
        report["write_gib_per_s"] = round(size / 2**30 / statistics.median(landed), 3)
    saved = list_step_checkpoints(RunDir(args.run_dir).checkpoints) if rank == 0 else []
    if saved:
        forget_verified()  # as a resuming process would: hash every file again
        started = time.perf_counter()
        report["verified"] = verify_checkpoint(saved[-1][1])
        report["verify_s"] = round(time.perf_counter() - started, 3)
        report["checkpoints_on_disk"] = [path.name for _, path in saved]
    return report


# ---------------------------------------------------------------------------- driver
def launch(args, mode: str, timeout_s: float) -> dict:
    """One ``torchrun`` job; its rank-0 fragment, or an error with the log's tail."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=args.checkpoint_dir))
    arguments = [
        f"--mode={mode}",
        f"--run-dir={run_dir}",
        f"--every={args.every}",
        f"--micro-batch={args.micro_batch}",
        f"--seq-len={args.seq_len}",
        f"--warmup-steps={args.warmup_steps}",
        f"--steps={args.steps}",
        f"--seed={args.seed}",
        *(["--no-compile"] if not args.compile else []),
        *(["--smoke"] if args.smoke else []),
    ]
    return launch_torchrun(
        HERE,
        args.gpus,
        arguments,
        smoke=args.smoke,
        timeout_s=timeout_s,
        tail_chars=LOG_TAIL_CHARS,
        prefix="recipes-ckpt-stall-",
        after=lambda: shutil.rmtree(run_dir, ignore_errors=True),  # tens of GB of checkpoints
    )


def filesystem(path: str) -> dict:
    """The file system ``path`` is on (from /proc/mounts) and its free space."""
    real, best = os.path.realpath(path), ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            device, mount, kind = line.split()[:3]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best[0]):
                best = (mount, kind, device)
    usage = shutil.disk_usage(path)
    return {
        "path": real,
        "mount": best[0],
        "type": best[1],
        "device": best[2],
        "free_gib": round(usage.free / 2**30, 1),
    }


def summarize(runs: dict) -> dict:
    """Stall and overhead per checkpoint of each checkpointing mode, and async vs sync."""
    base = runs.get("none", {})
    table: dict = {}
    for mode in ("sync", "async"):
        run = runs.get(mode, {})
        if not run.get("save_blocked_s"):
            continue
        row = {
            # the first save finds no earlier write under way: the stall of a run whose
            # checkpoints are further apart than one takes to land (a later background
            # save waits for the one before it)
            "first_save_stall_s": run["save_blocked_s"][0],
            "stall_per_checkpoint_s_median": round(statistics.median(run["save_blocked_s"]), 4),
            "stall_per_checkpoint_s_max": max(run["save_blocked_s"]),
            "landed_s_median": round(statistics.median(run["landed_s"]), 4)
            if run.get("landed_s")
            else None,
            "overhead_per_checkpoint_s": None,
        }
        if base.get("timed_s") and run.get("checkpoints"):
            extra = run["timed_s"] - base["timed_s"]
            row["overhead_per_checkpoint_s"] = round(extra / run["checkpoints"], 4)
        table[mode] = row
    if "sync" in table and "async" in table:
        sync, background = table["sync"], table["async"]
        table["async_stall_vs_sync"] = round(
            background["stall_per_checkpoint_s_median"] / sync["stall_per_checkpoint_s_median"], 4
        )
        table["async_first_save_stall_vs_sync"] = round(
            background["first_save_stall_s"] / sync["stall_per_checkpoint_s_median"], 4
        )
        if sync["overhead_per_checkpoint_s"] and background["overhead_per_checkpoint_s"]:
            table["async_overhead_vs_sync"] = round(
                background["overhead_per_checkpoint_s"] / sync["overhead_per_checkpoint_s"], 4
            )
    return table


def driver_main(args) -> dict:
    if not args.smoke and torch.cuda.device_count() < args.gpus:
        raise SystemExit(
            f"needs {args.gpus} CUDA GPUs, {torch.cuda.device_count()} visible; run with "
            "--smoke for the CPU check"
        )
    Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    result: dict = {
        "benchmark": "checkpoint_stall",
        "question": "seconds of training lost per sharded checkpoint, written in the "
        "foreground (sync) or in the background (async)",
        "device": None,  # from the workers: the driver leaves the GPUs alone
        "versions": package_versions("lightning", "recipes-lib"),
        "command": command_line(),
        "settings": {
            "recipe": SMOKE_RECIPE if args.smoke else GPU_RECIPE,
            "strategy": "fsdp",
            "processes": args.gpus,
            "precision": "32-true" if args.smoke else "bf16-mixed (the recipe's)",
            "compile": "off" if args.smoke or not args.compile else "the recipe's",
            "micro_batch_per_gpu": args.micro_batch,
            "seq_len": args.seq_len,
            "warmup_steps": args.warmup_steps,
            "steps": args.steps,
            "checkpoint_every_n_steps": args.every,
            "keep_last_checkpoints": 1,
            "data": "uniformly random tokens, each rank its own",
            "timeout_s_per_mode": args.timeout_s,
        },
        "filesystem": filesystem(args.checkpoint_dir),
        "definitions": DEFINITIONS,
        "runs": {},
        "summary": {},
    }
    if args.resume and Path(args.resume).is_file():
        earlier = json.loads(Path(args.resume).read_text())
        result["runs"] = {k: v for k, v in earlier.get("runs", {}).items() if "timed_s" in v}
        result["device"] = earlier.get("device")
    started = time.perf_counter()
    for mode in args.modes:
        if mode in result["runs"]:
            continue
        left = args.budget_s - (time.perf_counter() - started)
        if left < 30:
            result["runs"][mode] = {"skipped": f"time budget of {args.budget_s} s used up"}
            continue
        print(f"[checkpoint_stall] {mode} ...", file=sys.stderr, flush=True)
        result["runs"][mode] = launch(args, mode, min(args.timeout_s, left))
        report = {k: v for k, v in result["runs"][mode].items() if k != "step_time_ms"}
        print(f"[checkpoint_stall] {mode}: {report}", file=sys.stderr, flush=True)
        result["device"] = result["device"] or result["runs"][mode].get("device")
        result["summary"] = summarize(result["runs"])
        if args.out:  # keep what is measured so far
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["summary"] = summarize(result["runs"])
    emit(result, args.out)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="processes (one per GPU)")
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {MODES}, in order")
    p.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--steps", type=int, default=36, help="timed steps (after the warmup)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager blocks")
    p.add_argument(
        "--checkpoint-dir",
        default=tempfile.gettempdir(),
        help="where each mode's run folder (and its checkpoints) goes; removed after",
    )
    p.add_argument("--timeout-s", type=float, default=400.0, help="per mode")
    p.add_argument("--budget-s", type=float, default=570.0, help="all modes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--resume", default=None, help="keep the measured modes of this JSON")
    p.add_argument("--smoke", action="store_true", help="tiny recipe on CPU (gloo), 2 procs")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="sync", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if unknown := sorted(set(args.modes) - set(MODES)):
        p.error(f"unknown modes {unknown}; choose from {MODES}")
    if args.smoke and not args.worker:
        args.gpus, args.seq_len, args.micro_batch = 2, 64, 2
        args.warmup_steps, args.steps, args.every = 1, 7, 3
        args.timeout_s = min(args.timeout_s, 120.0)
    if args.worker and not (args.fragment and args.run_dir):
        p.error("--worker needs --fragment and --run-dir")
    total = args.warmup_steps + args.steps
    if args.every <= args.warmup_steps or total % args.every == 0:
        p.error(
            "--every must exceed --warmup-steps, and the last step (warmup + steps) must "
            "not be a checkpoint step: the run's last save is always synchronous"
        )
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        sys.exit(worker_main(lambda: run_worker(arguments), arguments.fragment))
    figures = driver_main(arguments)
    sys.exit(1 if any("error" in r for r in figures["runs"].values()) else 0)
