"""Where the time to a run's first optimizer step goes.

A run that starts slowly is slow for one of a few reasons: importing torch and the
library, reading and tokenizing its data, building and loading the model, or
compiling it. :class:`StartClock` splits the time from the process's start to the end
of the first training batch into those parts, so the run's summary can say which one
to look at. ``compile`` is the time dynamo reports spending on compiling before the
first step ended (the sanity validation's graphs included); ``first_step`` is the rest
of the time from the start of fitting to the end of the first batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L


def process_age() -> float | None:
    """Seconds since this process started, or None where the system does not say (Linux
    only: from ``/proc``)."""
    try:
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, since_boot - started)


def compile_seconds() -> float:
    """Seconds dynamo has spent compiling in this process."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


class StartClock(L.Callback):
    """Times the start of a run: ``import``, ``data``, ``load``, ``compile``,
    ``first_step`` and their ``total``, in seconds (:attr:`seconds`; empty until the
    first batch ends).

    Args:
        started: ``time.perf_counter()`` when the run was asked for; what came before
            it in the process counts as ``import``.
    """

    def __init__(self, started: float) -> None:
        self.started = started
        age = process_age()
        self.imported = 0.0 if age is None else max(0.0, age - (time.perf_counter() - started))
        self.compiled_before = compile_seconds()
        self.marks: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.marks.setdefault("data", time.perf_counter())  # the data module's setup ran

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.marks.setdefault("load", time.perf_counter())  # the model is built and loaded

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.seconds or "load" not in self.marks:
            return
        now = time.perf_counter()
        data = self.marks.get("data", self.marks["load"])
        compiling = compile_seconds() - self.compiled_before
        self.seconds = {
            "import": round(self.imported, 2),
            "data": round(data - self.started, 2),
            "load": round(self.marks["load"] - data, 2),
            "compile": round(compiling, 2),
            "first_step": round(max(0.0, now - self.marks["load"] - compiling), 2),
            "total": round(self.imported + now - self.started, 2),
        }
