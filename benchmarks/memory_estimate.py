r"""The pre-launch check's memory estimate against the measured peak, preset by preset.

Each preset is trained for ``--steps`` optimizer steps on random tokens in its own
process (an out-of-memory error leaves nothing behind for the next), through the
library's own trainer and module builders (``_library.fit_measured``), on one GPU.
The process's ``torch.cuda.max_memory_allocated`` (model building included) is compared
with :func:`recipes_lib.launch_check.estimate_memory`'s ``allocated`` figure, and
``max_memory_reserved`` with the estimate plus the allocator's slack; the error is
``estimate / measured - 1``. Each step's phases (forward, backward, optimizer) are
recorded too: their peaks and what stays allocated between them, so a wrong term of the
estimate can be found. The target is an error within 15% on every preset. On one
80 GB GPU, in about 5 minutes::

    python benchmarks/memory_estimate.py --out $OUT/memory_estimate.json

``--presets`` picks among :data:`PRESETS` (``--list`` prints them); the default three
are a full llama_1b pretraining step with activation checkpointing, a QLoRA SFT step
of llama_1b (bitsandbytes; ``llama_1b_lora`` without it) and llama_3b under FSDP on one
GPU. ``--smoke`` runs the tiny preset on CPU in fp32, in seconds: the estimate and the
training run, no CUDA figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from _common import command_line, emit, package_versions
from _jobs import attempt_main
from _jobs import launch_attempt as launch_attempt_job

HERE = Path(__file__).resolve()
GIB = 2**30
TARGET_ERROR = 0.15
LOG_TAIL_CHARS = 2500

_1B = ["recipe=pretrain/llama_1b", "data.seq_len=2048"]
# checkpointing off as these presets were measured (the SFT recipes' own default is auto)
_SFT_1B = [
    "recipe=sft/qlora_1b",
    "data.seq_len=2048",
    "data.batch_size=4",
    "kernels.activation_checkpointing=off",
]
# name -> (what it is, Hydra overrides); seq_len and batch_size are the preset's own
PRESETS: dict[str, tuple[str, list[str]]] = {
    "llama_1b_full_ac": (
        "llama_1b pretraining, bf16-mixed, activation checkpointing, B=4 x 2048",
        [
            *_1B,
            "data.batch_size=4",
            "kernels.compile=false",
            "kernels.activation_checkpointing=true",
        ],
    ),
    "llama_1b_selective_ac": (
        "llama_1b pretraining, bf16-mixed, every 2nd block recomputed, B=4 x 2048",
        [
            *_1B,
            "data.batch_size=4",
            "kernels.compile=false",
            "kernels.activation_checkpointing=selective",
            "kernels.checkpoint_every=2",
        ],
    ),
    "llama_1b_qlora": (
        "llama_1b QLoRA SFT (recipe sft/qlora_1b), bf16-mixed, B=4 x 2048",
        [*_SFT_1B, "kernels.compile=false"],
    ),
    "llama_3b_fsdp": (
        "llama_3b pretraining, FSDP on one GPU, bf16-mixed, checkpointing, B=2 x 2048",
        [
            "model=llama_3b",
            "precision=bf16-mixed",
            "strategy=fsdp",
            "kernels=sdpa",
            "kernels.activation_checkpointing=true",
            "data.seq_len=2048",
            "data.batch_size=2",
        ],
    ),
    # more shapes of the same estimate, to see which term is off
    "llama_1b_lora": (
        "llama_1b LoRA SFT, bf16-mixed, B=4 x 2048",
        [*_SFT_1B, "adapter=lora", "kernels.compile=false"],
    ),
    "llama_1b_full": (
        "llama_1b pretraining, bf16-mixed, no checkpointing, B=2 x 2048",
        [*_1B, "data.batch_size=2", "kernels.compile=false"],
    ),
    "llama_1b_full_compiled": (
        "llama_1b pretraining as the recipe (compiled blocks), B=4 x 2048",
        [*_1B, "data.batch_size=4", "kernels.compile=true"],
    ),
    "llama_1b_full_ac_compiled": (
        "llama_1b pretraining, compiled blocks, activation checkpointing, B=4 x 2048",
        [
            *_1B,
            "data.batch_size=4",
            "kernels.compile=true",
            "kernels.activation_checkpointing=true",
        ],
    ),
    "qwen2_0_5b_bf16_true": (
        "qwen2_0_5b pretraining, bf16-true, no checkpointing, B=4 x 2048",
        [
            "model=qwen2_0_5b",
            "precision=bf16-true",
            "kernels=sdpa",
            "data.seq_len=2048",
            "data.batch_size=4",
        ],
    ),
    # held out: none of these was measured while the estimate's terms were derived
    "qwen2_0_5b_ac": (
        "qwen2_0_5b pretraining, bf16-mixed, activation checkpointing, B=8 x 2048",
        [
            "model=qwen2_0_5b",
            "precision=bf16-mixed",
            "kernels=sdpa",
            "kernels.activation_checkpointing=true",
            "data.seq_len=2048",
            "data.batch_size=8",
        ],
    ),
    "llama_8b_qlora": (
        "llama_8b QLoRA SFT, bf16-mixed, B=2 x 2048 (building the fp32 model is the peak)",
        [*_SFT_1B[:2], "model=llama_8b", "data.batch_size=2", "kernels.compile=false"],
    ),
    "llama_3b_lora_ac": (
        "llama_3b LoRA SFT, bf16-mixed, activation checkpointing, B=4 x 2048",
        [
            *_SFT_1B,
            "model=llama_3b",
            "adapter=lora",
            "kernels.compile=false",
            "kernels.activation_checkpointing=true",
        ],
    ),
    "llama_1b_chunked_loss": (
        "llama_1b pretraining, checkpointing, the fused chunked loss, B=4 x 2048",
        [
            *_1B,
            "data.batch_size=4",
            "kernels.compile=false",
            "kernels.activation_checkpointing=true",
            "kernels.loss_chunk_size=4096",
        ],
    ),
    "smollm_135m_compiled": (
        "smollm_135m pretraining, bf16-mixed, compiled blocks, B=16 x 2048",
        [
            "model=smollm_135m",
            "precision=bf16-mixed",
            "kernels=sdpa_compiled",
            "data.seq_len=2048",
            "data.batch_size=16",
        ],
    ),
    "tiny": (
        "the tiny decoder, fp32, on CPU (--smoke)",
        ["recipe=pretrain/tiny", "data.seq_len=64", "data.batch_size=2"],
    ),
}
DEFAULT_PRESETS = "llama_1b_full_ac,llama_1b_qlora,llama_3b_fsdp"
HELD_OUT = (
    "qwen2_0_5b_ac,llama_8b_qlora,llama_3b_lora_ac,llama_1b_chunked_loss,smollm_135m_compiled"
)


# --------------------------------------------------------------------------- attempt
class PhaseProbe(L.Callback):
    """CUDA memory at the edges of each step's forward, backward and optimizer phases:
    what is allocated at each edge and the peak since the previous one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[dict[str, float]] = []
        self.build_peak_gib: float | None = None

    def _mark(self, name: str) -> None:
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        step = self.steps[-1]
        step[f"{name}_peak_gib"] = round(torch.cuda.max_memory_allocated(self.device) / GIB, 3)
        step[f"{name}_end_gib"] = round(torch.cuda.memory_allocated(self.device) / GIB, 3)
        torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.build_peak_gib = round(torch.cuda.max_memory_allocated(self.device) / GIB, 3)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append({"step": batch_idx + 1})
        self._mark("before")

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        self._mark("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._mark("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._mark("optimizer")


def run_attempt(args) -> dict:
    """Estimate and train one preset in this process; both figures."""
    from _library import compose_run, fit_measured, measured_run_overrides, synthetic_batches

    from recipes_lib.launch_check import estimate_memory

    device = torch.device("cpu" if args.smoke else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    _, overrides = PRESETS[args.preset]
    own = [o for o in overrides if o.startswith(("data.seq_len=", "data.batch_size="))]
    seq_len = int(next(o for o in own if o.startswith("data.seq_len=")).split("=")[1])
    batch = int(next(o for o in own if o.startswith("data.batch_size=")).split("=")[1])
    with tempfile.TemporaryDirectory(prefix="recipes-memest-") as root:
        timed = measured_run_overrides(
            steps=args.steps,
            seq_len=seq_len,
            batch_size=batch,
            accelerator="cpu" if args.smoke else "gpu",
            devices=1,
            run_dir=root,
            seed=args.seed,
        )
        cfg = compose_run([*overrides, *timed, *(["precision=32-true"] if args.smoke else [])])
        estimate = estimate_memory(cfg, world_size=1)
        batches = synthetic_batches(cfg.model.vocab_size, batch, seq_len, args.steps, args.seed)
        probe = PhaseProbe(device)
        fit = fit_measured(
            cfg, batches, warmup_steps=args.steps - 1, device=device, callbacks=[probe]
        )
    report: dict = {
        "estimate_gib": estimate.as_gib(),
        "estimate_notes": list(estimate.notes),
        "final_loss": round(fit.final_loss, 4),
        "trainer_strategy": type(fit.trainer.strategy).__name__,
        "measured": None,
        "error": None,
    }
    if device.type == "cuda":
        measured = {
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 3),
            "build_peak_allocated_gib": probe.build_peak_gib,
            "phases": probe.steps,
            "device": torch.cuda.get_device_name(device),
        }
        # the probe resets the counter at each phase: the run's peak is the largest
        peaks = [v for step in probe.steps for k, v in step.items() if k.endswith("_peak_gib")]
        measured["peak_allocated_gib"] = max([probe.build_peak_gib or 0.0, *peaks])
        report["measured"] = measured
        allocated = estimate.allocated / GIB
        reserved = allocated * (1 + _slack())
        report["error"] = {
            "allocated": round(allocated / measured["peak_allocated_gib"] - 1, 4),
            "reserved": round(reserved / measured["peak_reserved_gib"] - 1, 4),
        }
    return report


def _slack() -> float:
    from recipes_lib.launch_check.memory import ALLOCATOR_SLACK

    return ALLOCATOR_SLACK


# ---------------------------------------------------------------------------- driver
def launch_attempt(args, preset: str) -> dict:
    arguments = [
        f"--preset={preset}",
        f"--steps={args.steps}",
        f"--seed={args.seed}",
        *(["--smoke"] if args.smoke else []),
    ]
    return launch_attempt_job(
        HERE,
        arguments,
        smoke=args.smoke,
        timeout_s=args.timeout_s,
        tail_chars=LOG_TAIL_CHARS,
        prefix="recipes-memest-",
        error_key="error_message",
    )


def driver_main(args) -> dict:
    result: dict = {
        "benchmark": "memory_estimate",
        "device": None,
        "versions": package_versions("lightning", "peft", "bitsandbytes", "recipes-lib"),
        "command": command_line(),
        "settings": {"steps": args.steps, "target_error": TARGET_ERROR, "smoke": args.smoke},
        "presets": {},
        "summary": {},
    }

    def write_partial() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    for preset in args.presets:
        print(f"[memory_estimate] {preset} ...", file=sys.stderr, flush=True)
        report = launch_attempt(args, preset)
        report["description"], report["overrides"] = PRESETS[preset]
        result["presets"][preset] = report
        measured = report.get("measured") or {}
        result["device"] = result["device"] or measured.get("device")
        error = (report.get("error") or {}).get("allocated")
        result["summary"][preset] = {
            "estimate_gib": (report.get("estimate_gib") or {}).get("allocated"),
            "measured_gib": measured.get("peak_allocated_gib"),
            "error": error,
            "within_target": None if error is None else abs(error) <= TARGET_ERROR,
            "failure": report.get("error_message"),
        }
        print(f"[memory_estimate] {preset}: {result['summary'][preset]}", file=sys.stderr)
        write_partial()
    errors = [s["error"] for s in result["summary"].values() if s["error"] is not None]
    result["max_abs_error"] = max((abs(e) for e in errors), default=None)
    emit(result, args.out)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=DEFAULT_PRESETS, help="comma-separated names")
    p.add_argument("--list", action="store_true", help="print the presets and exit")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per preset (>= 2)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="per preset")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--smoke", action="store_true", help="the tiny preset on CPU, fp32")
    p.add_argument("--attempt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    p.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.presets = [name for name in args.presets.split(",") if name]
    if unknown := set(args.presets) - set(PRESETS):
        p.error(f"unknown presets {sorted(unknown)}; choose from {list(PRESETS)}")
    if args.smoke and not args.attempt:
        args.presets, args.steps = ["tiny"], 2
    if args.steps < 2:
        p.error("--steps must be at least 2 (AdamW's moments exist from the second step)")
    if args.attempt and not (args.fragment and args.preset):
        p.error("--attempt needs --fragment and --preset")
    if not (args.list or args.attempt or args.smoke) and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; run with --smoke for the CPU check")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.list:
        for name, (what, overrides) in PRESETS.items():
            print(f"{name}: {what}\n    {' '.join(overrides)}")
        sys.exit(0)
    if arguments.attempt:
        sys.exit(attempt_main(lambda: run_attempt(arguments), arguments.fragment, "error_message"))
    figures = driver_main(arguments)
    failed = any(s["failure"] or s["within_target"] is False for s in figures["summary"].values())
    sys.exit(1 if failed else 0)
