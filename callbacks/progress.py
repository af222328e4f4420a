"""A rich progress bar that shows training speed in tokens and the time left."""

from __future__ import annotations

import datetime
import math
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar
from rich.console import Console

TOKENS_PER_SEC_KEY = "perf/tokens_per_sec"  # logged by ThroughputMonitor


def format_count(value: float) -> str:
    """``12345.6`` -> ``"12.3k"``; ``2.5e9`` -> ``"2.50G"``."""
    for threshold, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            scaled = value / threshold
            return f"{scaled:.3g}{suffix}" if scaled < 100 else f"{scaled:.0f}{suffix}"
    return f"{value:.3g}"


def format_duration(seconds: float) -> str:
    """Seconds as ``H:MM:SS`` (days shown when there are any)."""
    return str(datetime.timedelta(seconds=round(seconds)))


class TokenProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` with ``tok/s`` and ``eta``.

    ``tok/s`` is the latest ``perf/tokens_per_sec`` logged (by
    :class:`~recipes_lib.callbacks.ThroughputMonitor`); ``eta`` extrapolates the mean
    time per optimizer step since training started to the run's last step
    (``trainer.estimated_stepping_batches``).

    When standard output is not a terminal (a log file, CI), a live bar would only
    show at the end, so the bar turns itself off and prints one plain line every
    ``print_every_n_steps`` optimizer steps instead.

    Args:
        refresh_rate, leave, console_kwargs: As for ``RichProgressBar``.
        plain: Force the plain-line mode (True) or the live bar (False); None: plain
            when standard output is neither a terminal nor a notebook.
        print_every_n_steps: Steps between plain lines; None: the trainer's
            ``log_every_n_steps``.
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        console_kwargs: dict[str, Any] | None = None,
        plain: bool | None = None,
        print_every_n_steps: int | None = None,
    ):
        super().__init__(refresh_rate=refresh_rate, leave=leave, console_kwargs=console_kwargs)
        self.plain = plain
        self.print_every_n_steps = print_every_n_steps
        self._plain_mode = False
        self._start_time: float | None = None
        self._start_step = 0
        self._last_printed_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        plain = self.plain
        if plain is None:
            console = Console(**(self._console_kwargs or {}))
            plain = not (console.is_terminal or console.is_jupyter)
        self._plain_mode = plain
        if plain:
            self.disable()

    # ----------------------------------------------------------------- timing
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start_time = time.perf_counter()
        self._start_step = trainer.global_step

    def eta_seconds(self, trainer: L.Trainer) -> float | None:
        """Seconds until the last optimizer step at the mean pace so far, or None."""
        steps_done = trainer.global_step - self._start_step
        if self._start_time is None or steps_done <= 0:
            return None
        try:
            total = float(trainer.estimated_stepping_batches)
        except Exception:  # no training loader to measure
            return None
        if not math.isfinite(total):
            return None
        per_step = (time.perf_counter() - self._start_time) / steps_done
        return max(0.0, (total - trainer.global_step) * per_step)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        tokens_per_sec = trainer.callback_metrics.get(TOKENS_PER_SEC_KEY)
        if tokens_per_sec is not None:
            value = (
                tokens_per_sec.item()
                if isinstance(tokens_per_sec, torch.Tensor)
                else tokens_per_sec
            )
            items["tok/s"] = format_count(float(value))
        eta = self.eta_seconds(trainer) if trainer.training else None
        if eta is not None:
            items["eta"] = format_duration(eta)
        return items

    # ------------------------------------------------------------ plain lines
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self._plain_mode or not trainer.is_global_zero:
            return
        step = trainer.global_step
        every = self.print_every_n_steps or trainer.log_every_n_steps or 1
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if step == self._last_printed_step or (step % every and not last):
            return
        self._last_printed_step = step
        print(self.plain_line(trainer, pl_module), file=sys.stdout, flush=True)

    def plain_line(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        """``step 120/1000 | train/loss 3.412 | tok/s 52.1k | eta 0:04:10``."""
        try:
            total = float(trainer.estimated_stepping_batches)
        except Exception:
            total = math.inf
        parts = [f"step {trainer.global_step}" + (f"/{int(total)}" if math.isfinite(total) else "")]
        for name, value in self.get_metrics(trainer, pl_module).items():
            if name == "v_num":
                continue
            if isinstance(value, float):
                value = f"{value:.4g}"
            parts.append(f"{name} {value}")
        return " | ".join(parts)
