r"""The largest model preset that trains on one GPU with each strategy and offload choice.

For each choice (``single``, ``fsdp`` on one GPU, ``fsdp`` with CPU offload, DeepSpeed
ZeRO-2, ZeRO-3, ZeRO-3 with offload) the driver tries the model presets from the
smallest to the largest (by parameter count) and stops at the first that fails. Each
attempt is its own process (an out-of-memory error cannot leave anything behind for
the next) that composes ``model=<preset>`` with ``precision=bf16-mixed``,
``kernels.activation_checkpointing=true``, the choice's ``strategy`` overrides, a
micro-batch of 1 sequence of 2048 tokens, and trains ``--steps`` steps on random
tokens through the library's own trainer and module builders. A success records the
peak CUDA memory (allocated and reserved, from process start), the host's peak
resident memory and the last step's time; the first failure records its error.

Offload choices keep the weights' fp32 copy, gradients and AdamW state in host memory
(about 16 bytes per parameter): a preset whose estimate does not fit in 85% of the
host's available memory (``MemAvailable``, or ``--host-memory-gib``) is recorded as a
failure without being started (``not_attempted``), so the host is never driven out of
memory. The DeepSpeed choices are recorded as
errors where DeepSpeed is not installed. On one 80 GB GPU, in about 6-8 minutes::

    python benchmarks/memory.py --out $OUT/memory.json

``--budget-s`` caps the whole run (shared among the choices, twice as much for the
offload ones; what a choice leaves over passes on) and ``--timeout-s`` each attempt.
``--gpus 0,1,2,3`` spreads the choices over several GPUs that work at once (each
attempt still uses one GPU, and the budget applies to each GPU's share of choices).
A card larger than ``--device-memory-gib`` (80 by default) is capped to it with
``torch.cuda.set_per_process_memory_fraction``, so an H200 answers for an 80 GB card.
The JSON is rewritten after every attempt. ``--smoke`` runs the tiny preset with
``single`` on CPU in fp32, in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _common import command_line, emit, package_versions
from _jobs import attempt_main
from _jobs import launch_attempt as launch_attempt_job

HERE = Path(__file__).resolve()
CHOICES: dict[str, list[str]] = {
    "single": ["strategy=single"],
    "fsdp": ["strategy=fsdp"],
    "fsdp_cpu_offload": ["strategy=fsdp", "strategy.cpu_offload=true"],
    "deepspeed_zero2": ["strategy=deepspeed_zero2"],
    "deepspeed_zero3": ["strategy=deepspeed_zero3"],
    "deepspeed_zero3_offload": ["strategy=deepspeed_zero3", "strategy.cpu_offload=true"],
}
OFFLOAD_CHOICES = ("fsdp_cpu_offload", "deepspeed_zero3_offload")
# fp32 weights (4) + fp32 gradients (4) + AdamW moments (8) in host memory, per parameter
HOST_BYTES_PER_PARAM = 16
HOST_MEMORY_MARGIN = 0.85  # of MemAvailable, for the process itself and pinned buffers
DEFAULT_LADDER = "llama_1b,llama_3b,llama2_7b,llama_8b,llama2_13b"
LOG_TAIL_CHARS = 2500


# --------------------------------------------------------------------------- attempt
def attempt_overrides(args, run_dir: str) -> list[str]:
    from _library import measured_run_overrides

    return [
        f"model={args.model}",
        "kernels=sdpa",
        "kernels.compile=false",
        "kernels.activation_checkpointing=true",
        "precision=32-true" if args.smoke else "precision=bf16-mixed",
        *CHOICES[args.choice],
        *measured_run_overrides(
            steps=args.steps,
            seq_len=args.seq_len,
            batch_size=args.micro_batch,
            accelerator="cpu" if args.smoke else "gpu",
            devices=1,
            run_dir=run_dir,
            seed=args.seed,
        ),
    ]


def host_peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_attempt(args) -> dict:
    """Train one preset with one choice in this process; its memory figures."""
    from _library import compose_run, fit_measured, meta_transformer, synthetic_batches

    device = torch.device("cpu" if args.smoke else "cuda:0")
    cap = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
        total = torch.cuda.get_device_properties(device).total_memory
        if args.device_memory_gib and args.device_memory_gib * 2**30 < total:
            # a larger card behaves as one of --device-memory-gib (80 GB by default)
            cap = args.device_memory_gib
            torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total, device)
    with tempfile.TemporaryDirectory(prefix="recipes-memory-") as root:
        cfg = compose_run(attempt_overrides(args, root))
        batches = synthetic_batches(
            cfg.model.vocab_size, args.micro_batch, args.seq_len, args.steps, args.seed
        )
        fit = fit_measured(cfg, batches, warmup_steps=args.steps - 1, device=device)
    report: dict = {
        "num_params": meta_transformer(cfg.model).num_params(),
        "trainer_strategy": type(fit.trainer.strategy).__name__,
        "steps": args.steps,
        "last_step_s": round(fit.timer.total_s, 3),
        "final_loss": round(fit.final_loss, 4),
        "host_peak_rss_gib": round(host_peak_rss_gib(), 2),
        "peak_memory_gib": None,
        "peak_reserved_gib": None,
    }
    if device.type == "cuda":
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        report["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        report["device"] = torch.cuda.get_device_name(device)
        report["device_memory_gib"] = round(
            torch.cuda.get_device_properties(device).total_memory / 2**30, 1
        )
        report["memory_cap_gib"] = cap
    return report


# ---------------------------------------------------------------------------- driver
def available_host_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (Linux), None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def host_bytes(args) -> int | None:
    """Host memory an attempt may use: ``--host-memory-gib`` where given (on machines
    whose /proc/meminfo grows with use and so reads too low at first), else
    ``MemAvailable``."""
    if args.host_memory_gib:
        return int(args.host_memory_gib * 2**30)
    return available_host_bytes()


def num_params(model: str) -> int:
    from _library import compose_run, meta_transformer

    return meta_transformer(compose_run([f"model={model}"], check=False).model).num_params()


def launch_attempt(args, model: str, choice: str, timeout_s: float, gpu: str | None = None) -> dict:
    arguments = [
        f"--model={model}",
        f"--choice={choice}",
        f"--steps={args.steps}",
        f"--seq-len={args.seq_len}",
        f"--micro-batch={args.micro_batch}",
        f"--seed={args.seed}",
        f"--device-memory-gib={args.device_memory_gib}",
        *(["--smoke"] if args.smoke else []),
    ]
    return launch_attempt_job(
        HERE,
        arguments,
        smoke=args.smoke,
        timeout_s=timeout_s,
        tail_chars=LOG_TAIL_CHARS,
        prefix="recipes-memory-",
        gpus=gpu,
    )


def budget_weight(choice: str) -> int:
    """A choice's share of the time budget: offload steps are slow (AdamW on the CPU,
    weights over PCIe), a choice that cannot start costs nothing, and whatever a choice
    leaves unused passes on to the next."""
    if choice.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return 0
    return 2 if choice in OFFLOAD_CHOICES else 1


def try_choice(
    args,
    choice: str,
    ladder: list[tuple[str, int]],
    deadline: float,
    out,
    entry: dict | None = None,
    gpu: str | None = None,
) -> dict:
    """Presets from small to large with ``choice`` until the first failure, filling in
    ``entry`` (a new dict by default) as it goes and calling ``out()`` after each."""
    entry = {} if entry is None else entry
    entry.update(
        overrides=CHOICES[choice],
        largest_model=None,
        largest_num_params=None,
        peak_memory_gib=None,
        first_failure=None,
        attempts={},
    )
    if choice.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        entry["first_failure"] = {"model": None, "error": "deepspeed is not installed"}
        return entry
    for model, params in ladder:
        left = deadline - time.perf_counter()
        if left < 20:
            entry["stopped"] = "time budget used up"
            break
        host = host_bytes(args)
        needed = params * HOST_BYTES_PER_PARAM
        if choice in OFFLOAD_CHOICES and host is not None and needed > HOST_MEMORY_MARGIN * host:
            report = {
                "error": f"not attempted: needs about {needed / 2**30:.0f} GiB of host memory "
                f"({HOST_BYTES_PER_PARAM} bytes per parameter), {host / 2**30:.0f} GiB available",
                "not_attempted": True,
            }
        else:
            print(f"[memory] {choice} {model} ...", file=sys.stderr, flush=True)
            report = launch_attempt(args, model, choice, min(args.timeout_s, left), gpu)
        short = {k: v for k, v in report.items() if k != "log_tail"}
        print(f"[memory] {choice} {model}: {short}", file=sys.stderr, flush=True)
        entry["attempts"][model] = report
        out()
        if "error" in report:
            entry["first_failure"] = {"model": model, "error": report["error"]}
            break
        entry.update(
            largest_model=model,
            largest_num_params=params,
            peak_memory_gib=report.get("peak_memory_gib"),
        )
    return entry


def driver_main(args) -> dict:
    ladder = sorted(((m, num_params(m)) for m in args.models), key=lambda item: item[1])
    host = host_bytes(args)
    result: dict = {
        "benchmark": "memory",
        "device": None,  # from the attempts: the driver leaves the GPU alone
        "device_memory_gib": None,
        "host_memory_gib": round(host / 2**30, 1) if host else None,
        "host_memory_source": "--host-memory-gib" if args.host_memory_gib else "MemAvailable",
        "versions": package_versions("lightning", "deepspeed", "recipes-lib"),
        "command": command_line(),
        "settings": {
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "steps": args.steps,
            "precision": "32-true" if args.smoke else "bf16-mixed",
            "activation_checkpointing": True,
            "compile": "off",
            "optimizer": "AdamW (the library's), constant LR",
            "timeout_s_per_attempt": args.timeout_s,
            "budget_s": args.budget_s,
            "host_bytes_per_param_offload_estimate": HOST_BYTES_PER_PARAM,
        },
        "ladder": [{"model": m, "num_params": n} for m, n in ladder],
        "choices": {},
        "summary": {},
    }

    def write_partial() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    lock = threading.Lock()

    def write_locked() -> None:
        with lock:
            write_partial()

    def run_group(choices: list[str], gpu: str | None) -> None:
        """The choices given to one GPU, one after another, sharing the budget."""
        started = time.perf_counter()
        weights = {choice: budget_weight(choice) for choice in choices}
        for index, choice in enumerate(choices):
            left = args.budget_s - (time.perf_counter() - started)
            remaining = sum(weights[c] for c in choices[index:])
            share = left * weights[choice] / remaining if remaining else 0.0
            with lock:  # partial writes show its attempts
                entry = result["choices"].setdefault(choice, {})
            deadline = time.perf_counter() + share
            try_choice(args, choice, ladder, deadline, write_locked, entry, gpu)
            with lock:
                for report in entry["attempts"].values():
                    result["device"] = result["device"] or report.get("device")
                    result["device_memory_gib"] = result["device_memory_gib"] or report.get(
                        "device_memory_gib"
                    )
                failure = entry["first_failure"]
                result["summary"][choice] = {
                    "largest_model": entry["largest_model"],
                    "largest_num_params": entry["largest_num_params"],
                    "peak_memory_gib": entry["peak_memory_gib"],
                    "fails_at": failure["model"] if failure else None,
                    "failure": failure["error"][:300] if failure else entry.get("stopped"),
                }
                write_partial()

    if not args.gpus:
        run_group(list(args.choices), None)
    else:  # each GPU takes every len(gpus)-th choice; the GPUs run at once
        groups = {gpu: list(args.choices)[i :: len(args.gpus)] for i, gpu in enumerate(args.gpus)}
        threads = [
            threading.Thread(target=run_group, args=(choices, gpu))
            for gpu, choices in groups.items()
            if choices
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    result["settings"]["memory_cap_gib"] = args.device_memory_gib
    result["settings"]["gpus"] = args.gpus or None
    emit(result, args.out)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT_LADDER, help="presets to try (sorted by size)")
    p.add_argument("--choices", default=",".join(CHOICES), help=f"subset of {list(CHOICES)}")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per attempt")
    p.add_argument("--timeout-s", type=float, default=150.0, help="per attempt")
    p.add_argument("--budget-s", type=float, default=480.0, help="all attempts")
    p.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        help="host memory offload may use (default: MemAvailable of /proc/meminfo)",
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        default=80.0,
        help="GPU memory an attempt may use (a larger card is capped to it); 0: all of it",
    )
    p.add_argument(
        "--gpus",
        default="",
        help="GPU indices to spread the choices over, e.g. 0,1,2,3 (default: one GPU)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny preset, single, CPU, fp32")
    # attempt-only
    p.add_argument("--attempt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--choice", default="single", choices=list(CHOICES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    args.choices = [c for c in args.choices.split(",") if c]
    if unknown := set(args.choices) - set(CHOICES):
        p.error(f"unknown choices {sorted(unknown)}; choose from {list(CHOICES)}")
    if args.smoke and not args.attempt:
        args.models, args.choices = ["tiny"], ["single"]
        args.seq_len, args.steps, args.timeout_s = 64, 2, min(args.timeout_s, 90.0)
    if args.attempt and not (args.fragment and args.model):
        p.error("--attempt needs --fragment and --model")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if not args.attempt and not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("no CUDA device; run with --smoke for the CPU check")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.attempt:
        sys.exit(attempt_main(lambda: run_attempt(arguments), arguments.fragment))
    figures = driver_main(arguments)
    # a failure after a success is the measurement (where a choice stops); a choice that
    # trained nothing at all is an error
    sys.exit(1 if any(e["largest_model"] is None for e in figures["choices"].values()) else 0)
