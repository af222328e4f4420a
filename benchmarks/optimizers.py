r"""The ``optim`` choices at 1B on one card: step time, optimizer memory, and the loss that
AdamW and Muon reach on the same data after the same number of tokens.

``--part step`` (default): for each of ``--optimizers`` (adamw, adamw_8bit, adafactor,
muon), ``recipe=pretrain/llama_1b optim=NAME`` on uniformly random tokens (the
library's trainer, strategy, bf16 autocast and compiled blocks; constant LR, gradient
clipping at 1.0), each in its own process. Reported per choice: the training step
(median, ms) and tokens/s; the optimizer's own step (from Lightning's
``on_before_optimizer_step`` to the end of the batch: gradient clipping, the update and
``zero_grad``, synchronized at both ends on every other step); the bytes of the
optimizer's state; the peak memory.

``--part loss``: ``recipe=pretrain/llama_1b`` with the embedded standard-library
corpus (a 32K BPE vocabulary trained on it), ``--loss-steps`` optimizer steps of
``--batch-size`` x ``--seq-len`` tokens under the same warmup and cosine schedule, once
with ``optim=adamw`` and once with ``optim=muon`` at the same learning rate (Muon's
update is scaled to AdamW's RMS, so one rate serves both); the last training losses and
the held-out loss. Prints one JSON object::

    python benchmarks/optimizers.py --part step --out $OUT/optimizers_step.json
    python benchmarks/optimizers.py --part loss --out $OUT/optimizers_loss.json

``--smoke`` runs the chosen part with the tiny model on CPU in fp32 (adamw_8bit is left
out where bitsandbytes is not installed), in well under a minute per optimizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from _common import (
    benchmark_device,
    command_line,
    device_name,
    emit,
    package_versions,
    synchronize,
)
from _jobs import attempt_main, launch_attempt

HERE = Path(__file__).resolve()
OPTIMIZERS = ("adamw", "adamw_8bit", "adafactor", "muon")
LOG_TAIL_CHARS = 3000


class OptimizerStepTimer(L.Callback):
    """Times the optimizer's part of every ``every``-th batch after ``skip`` batches
    (synchronizing before and after it, which the other batches are spared)."""

    def __init__(self, device: torch.device, skip: int, every: int = 2):
        self.device, self.skip, self.every = device, skip, every
        self.times_ms: list[float] = []
        self.state_bytes = 0  # read during training: the run releases the state at its end
        self._t0: float | None = None

    def _timed(self, trainer) -> bool:
        step = trainer.global_step
        return step >= self.skip and (step - self.skip) % self.every == 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._timed(trainer):
            synchronize(self.device)
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._t0 is not None:
            synchronize(self.device)
            self.times_ms.append((time.perf_counter() - self._t0) * 1e3)
            self._t0 = None
            self.state_bytes = max(self.state_bytes, state_bytes(trainer.optimizers[0]))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state, each storage counted once."""
    seen, total = set(), 0
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                key = value.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += value.untyped_storage().nbytes()
    return total


def _base_overrides(args) -> list[str]:
    if args.smoke:
        return ["recipe=pretrain/tiny", "precision=32-true", "kernels.compile=false"]
    return [f"recipe={args.recipe}"]


def step_attempt(args) -> dict:
    """One optimizer's step time and memory, in this process."""
    from _library import (
        compose_run,
        fit_measured,
        measured_run_overrides,
        synthetic_batches,
        temporary_run_dir,
    )

    device = benchmark_device(args.smoke)
    steps = args.warmup_steps + args.steps
    with temporary_run_dir() as run_dir:
        cfg = compose_run(
            [
                *_base_overrides(args),
                f"optim={args.optimizer}",
                *measured_run_overrides(
                    steps=steps,
                    seq_len=args.seq_len,
                    batch_size=args.batch_size,
                    accelerator="cpu" if args.smoke else "gpu",
                    devices=1,
                    run_dir=run_dir,
                    seed=0,
                ),
            ]
        )
        batches = synthetic_batches(
            cfg.model.vocab_size, args.batch_size, args.seq_len, steps, seed=0
        )
        optim_timer = OptimizerStepTimer(device, skip=args.warmup_steps)
        fit = fit_measured(
            cfg, batches, warmup_steps=args.warmup_steps, device=device, callbacks=[optim_timer]
        )
        optimizer, state = fit.trainer.optimizers[0], optim_timer.state_bytes
        step_ms = fit.timer.step_times_ms()
        n_params = sum(p.numel() for p in fit.module.parameters())
        return {
            "optimizer": args.optimizer,
            "optimizer_class": type(optimizer).__name__,
            "parameters": n_params,
            "step_ms_median": round(statistics.median(step_ms), 2),
            "tokens_per_sec": round(
                args.batch_size * args.seq_len * len(step_ms) / fit.timer.total_s, 1
            ),
            "optimizer_step_ms_median": round(statistics.median(optim_timer.times_ms), 2),
            "optimizer_state_gib": round(state / 2**30, 3),
            "optimizer_state_bytes_per_param": round(state / n_params, 3),
            "peak_memory_gib": (
                round(torch.cuda.max_memory_allocated() / 2**30, 3)
                if device.type == "cuda"
                else None
            ),
            "final_loss": fit.final_loss,
        }


def loss_attempt(args) -> dict:
    """One optimizer's training run on the embedded corpus, in this process."""
    from recipes_lib.config import compose_config
    from recipes_lib.pipeline.report import read_stage_logs
    from recipes_lib.train import run

    benchmark_device(args.smoke)
    vocab = 512 if args.smoke else 32768
    with_gpu = [] if args.smoke else ["trainer.devices=1"]
    overrides = [
        *_base_overrides(args),
        f"optim={args.optimizer}",
        "data=stdlib",
        f"data.cache_dir={args.cache_dir}",
        f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch_size}",
        f"data.tokenizer.vocab_size={vocab}",
        f"model.vocab_size={vocab}",
        f"optim.lr={args.lr}",
        "optim.weight_decay=0.1",
        "scheduler=cosine",
        f"scheduler.warmup={max(1, args.loss_steps // 10)}",
        f"trainer.max_steps={args.loss_steps}",
        "trainer.accumulate_grad_batches=1",
        f"trainer.val_check_interval={args.loss_steps}",
        "trainer.limit_val_batches=20",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "callbacks=minimal",
        "run.save_top_k=0",
        "run.seed=0",
        f"run.dir={args.run_dir}",
        *with_gpu,
    ]
    started = time.perf_counter()
    result = run(compose_config(overrides))
    series = read_stage_logs(Path(result.output_dir), args.optimizer).series
    losses = [value for _, value in series["train/loss"]]
    return {
        "optimizer": args.optimizer,
        "lr": args.lr,
        "tokens": args.loss_steps * args.batch_size * args.seq_len,
        "train_loss_last10_mean": round(statistics.fmean(losses[-10:]), 4),
        "train_loss_first": round(losses[0], 4),
        "val_loss": round(result.metrics["val/loss"], 4),
        "seconds": round(time.perf_counter() - started, 1),
    }


def launch(args, optimizer: str, part: str, extra: list[str]) -> dict:
    arguments = [
        f"--part={part}",
        f"--optimizer={optimizer}",
        f"--recipe={args.recipe}",
        f"--steps={args.steps}",
        f"--warmup-steps={args.warmup_steps}",
        f"--loss-steps={args.loss_steps}",
        f"--batch-size={args.batch_size}",
        f"--seq-len={args.seq_len}",
        f"--lr={args.lr}",
        *(["--smoke"] if args.smoke else []),
        *extra,
    ]
    return launch_attempt(
        HERE,
        arguments,
        smoke=args.smoke,
        timeout_s=args.timeout_s,
        tail_chars=LOG_TAIL_CHARS,
        prefix="recipes-optim-",
    )


def _available(name: str) -> bool:
    if name != "adamw_8bit":
        return True
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


def drive(args) -> dict:
    import tempfile

    device = benchmark_device(args.smoke)
    result = {
        "part": args.part,
        "device": device_name(device),
        "versions": package_versions("lightning", "bitsandbytes"),
        "command": command_line(),
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("out", "fragment", "attempt")
        },
        "runs": {},
    }
    names = [n for n in args.optimizers.split(",") if n]
    if args.part == "loss":
        names = [n for n in names if n in ("adamw", "muon")]
    with tempfile.TemporaryDirectory(prefix="recipes-optim-") as tmp:
        for name in names:
            if not _available(name):
                result["runs"][name] = {"skipped": "bitsandbytes is not installed"}
                continue
            extra = []
            if args.part == "loss":  # one data cache: the second run reuses the first's
                extra = [f"--cache-dir={tmp}/cache", f"--run-dir={tmp}/{name}"]
            result["runs"][name] = launch(args, name, args.part, extra)
            print(f"{name}: {json.dumps(result['runs'][name])[:300]}", file=sys.stderr)
    base = result["runs"].get("adamw", {})
    for run in result["runs"].values():
        if args.part == "step" and "step_ms_median" in run and "step_ms_median" in base:
            run["step_time_vs_adamw"] = round(run["step_ms_median"] / base["step_ms_median"], 3)
            run["state_vs_adamw"] = round(
                run["optimizer_state_gib"] / max(base["optimizer_state_gib"], 1e-9), 3
            )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("step", "loss"), default="step")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--recipe", default="pretrain/llama_1b")
    p.add_argument("--steps", type=int, default=12, help="timed steps (--part step)")
    p.add_argument("--warmup-steps", type=int, default=6)
    p.add_argument("--loss-steps", type=int, default=200, help="training steps (--part loss)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4, help="--part loss, both optimizers")
    p.add_argument("--timeout-s", type=float, default=420)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, fp32, no compile")
    p.add_argument("--out", default=None)
    p.add_argument("--attempt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    p.add_argument("--optimizer", default="adamw", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup_steps, args.loss_steps = 4, 2, 20
        args.batch_size, args.seq_len, args.lr = 4, 64, 3e-3
    if args.attempt:
        work = step_attempt if args.part == "step" else loss_attempt
        return attempt_main(lambda: work(args), args.fragment)
    result = drive(args)
    emit(result, args.out)
    return 1 if any("error" in r for r in result["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
