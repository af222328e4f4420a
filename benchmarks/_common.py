"""Timing, hardware and JSON helpers shared by the benchmark scripts.

Every benchmark prints one JSON object to stdout; these helpers keep the way steps are
timed, peaks are looked up and memory is released the same across scripts.
"""

from __future__ import annotations

import gc
import json
import math
import platform
import shlex
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

# Dense bf16 tensor-core peak per card (TFLOP/s, no sparsity), from the vendors' datasheets.
# Looked up by substring of torch.cuda.get_device_name(), most specific first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.5),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.5),  # SXM
    ("A100", 312.0),
)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def peak_bf16_tflops(name: str) -> float | None:
    """Peak dense bf16 TFLOP/s of the card called ``name``, or None when unknown."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key in name:
            return peak
    return None


def package_versions(*names: str) -> dict[str, str | None]:
    """Installed version of each distribution, None for one that is missing."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["torch"] = torch.__version__  # the imported build (+cuXXX), not the dist name
    versions["cuda"] = torch.version.cuda
    return versions


def command_line() -> str:
    return " ".join(shlex.quote(arg) for arg in [Path(sys.executable).name, *sys.argv])


def benchmark_device(smoke: bool) -> torch.device:
    """The first GPU (TF32 allowed for fp32 matmuls), or the CPU for ``--smoke``.

    Raises:
        SystemExit: no CUDA device and not a smoke run.
    """
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device; run with --smoke for the CPU check")
    torch.set_float32_matmul_precision("high")
    return torch.device("cuda:0")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Times a run of training steps without synchronizing inside it.

    ``start()`` synchronizes and reads the wall clock; ``step_end()`` after each step
    records a CUDA event (a wall-clock reading on CPU); ``stop()`` synchronizes again.
    The total is wall time from ``start`` to ``stop``; each step's time is the gap
    between consecutive boundaries on the GPU's timeline, which also counts the time
    the GPU waited for the host to launch work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._boundaries: list = []
        self._t0 = self._t1 = 0.0

    def _mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._boundaries.append(event)
        else:
            self._boundaries.append(time.perf_counter())

    def start(self) -> None:
        synchronize(self.device)
        self._boundaries = []
        self._t0 = time.perf_counter()
        self._mark()

    def step_end(self) -> None:
        self._mark()

    def stop(self) -> None:
        synchronize(self.device)
        self._t1 = time.perf_counter()

    @property
    def started(self) -> bool:
        return bool(self._boundaries)

    @property
    def window(self) -> tuple[float, float]:
        """The ``time.perf_counter()`` readings at ``start()`` and ``stop()``."""
        return self._t0, self._t1

    @property
    def total_s(self) -> float:
        return self._t1 - self._t0

    def step_times_ms(self) -> list[float]:
        marks = self._boundaries
        if self.device.type == "cuda":
            return [a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)]


class GcPauses:
    """Records every pause of Python's garbage collector while it is active.

    ``with GcPauses() as pauses: ...`` hooks ``gc.callbacks``; :meth:`summary` then gives
    the collections that started between two ``time.perf_counter()`` readings (a timed
    window), their total and longest pause, and how many were full (generation 2).
    """

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self._started: float | None = None

    def _hook(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            self.pauses.append((self._started, now - self._started, int(info["generation"])))
            self._started = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._hook)

    def summary(self, t0: float = -math.inf, t1: float = math.inf) -> dict:
        inside = [(s, g) for start, s, g in self.pauses if t0 <= start <= t1]
        return {
            "collections": len(inside),
            "full_collections": sum(1 for _, g in inside if g == 2),
            "total_ms": round(sum(s for s, _ in inside) * 1e3, 3),
            "max_ms": round(max((s for s, _ in inside), default=0.0) * 1e3, 3),
        }


def step_time_stats(step_ms: list[float]) -> dict:
    """Mean, median, min and max of per-step times (ms)."""
    return {
        "mean": round(statistics.fmean(step_ms), 3),
        "median": round(statistics.median(step_ms), 3),
        "min": round(min(step_ms), 3),
        "max": round(max(step_ms), 3),
    }


def throughput_report(
    timer: StepTimer,
    *,
    tokens_per_step: int,
    flops_per_token: float,
    peak_tflops: float | None,
    final_loss: float,
) -> dict:
    """Figures of one measured run: tokens/s, step times, TFLOP/s, MFU, peak memory, loss."""
    step_ms = timer.step_times_ms()
    tokens_per_sec = tokens_per_step * len(step_ms) / timer.total_s
    tflops = tokens_per_sec * flops_per_token / 1e12
    peak_memory = None
    if timer.device.type == "cuda":
        peak_memory = torch.cuda.max_memory_allocated(timer.device) / 2**30
    return {
        "tokens_per_sec": round(tokens_per_sec, 1),
        "step_time_ms": step_time_stats(step_ms),
        "measured_steps": len(step_ms),
        "tflops": round(tflops, 3),
        "mfu": round(tflops / peak_tflops, 4) if peak_tflops else None,
        "peak_memory_gib": round(peak_memory, 3) if peak_memory is not None else None,
        "final_loss": final_loss if math.isfinite(final_loss) else str(final_loss),
    }


def reset_memory(device: torch.device) -> None:
    """Release what earlier runs left behind and restart the peak-memory counter."""
    gc.collect()
    torch._dynamo.reset()  # drop compiled graphs (and the tensors they hold)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def emit(result: dict, out: str | None) -> None:
    """Print ``result`` as JSON to stdout and, when ``out`` is set, write it there too."""
    text = json.dumps(result, indent=2)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)
