"""One progress line for training: optimizer step of total, loss, tokens per second, time left."""

from __future__ import annotations

import datetime
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks.progress import ProgressBar
from rich.console import Console
from rich.live import Live
from rich.text import Text

TOKENS_PER_SEC_KEY = "perf/tokens_per_sec"  # logged by ThroughputMonitor
SEPARATOR = " | "
BAR_CELLS = 20


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


def fit_fields(fields: Sequence[tuple[str, int]], width: int, sep: str = SEPARATOR) -> str:
    """Join ``(text, rank)`` fields in their order into a line of at most ``width`` characters.

    While the line is too wide, the field of the highest rank (the least needed; the
    later one of equal ranks) is left out; the last one left is cut short with ``…``.
    """
    kept = list(fields)
    line = sep.join(text for text, _ in kept)
    while len(line) > width and len(kept) > 1:
        drop = max(range(len(kept)), key=lambda i: (kept[i][1], i))
        del kept[drop]
        line = sep.join(text for text, _ in kept)
    if len(line) > width:
        line = line[: max(width - 1, 0)] + "…" if width > 0 else ""
    return line


class TokenProgressBar(ProgressBar):
    """One line, ``step 120/1000 | loss 3.412 | val/loss 3.520 | 52.1k tok/s | eta 0:04:10``,
    cut to the terminal's width (the least needed fields go first).

    ``step`` counts optimizer steps of the run; ``tok/s`` is the latest
    ``perf/tokens_per_sec`` logged (by :class:`~recipes_lib.callbacks.ThroughputMonitor`);
    ``eta`` extrapolates the mean time per optimizer step since training started to the
    last step; the other fields are the metrics logged with ``prog_bar=True``. On a
    terminal the line is redrawn in place, with a bar in front when there is room, and
    validation shows in it as ``validating 3/10``; log records print above it.

    When standard output is not a terminal (a log file, CI), a line redrawn in place
    would only show at the end, so the line is printed every ``print_every_n_steps``
    optimizer steps instead (plain mode).

    Args:
        refresh_rate: Redraws per second of the live line; 0 turns it off.
        leave: Keep the last line on the terminal when training ends.
        console_kwargs: Arguments of the ``rich.console.Console`` drawn on (``width``, ...).
        plain: Force plain mode (True) or the live line (False); None: plain when
            standard output is neither a terminal nor a notebook.
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
        super().__init__()
        self._refresh_rate = refresh_rate
        self.leave = leave
        self._console_kwargs = console_kwargs or {}
        self.plain = plain
        self.print_every_n_steps = print_every_n_steps
        self._enabled = True
        self._plain_mode = False
        self._console: Console | None = None
        self._live: Live | None = None
        self._next_draw = 0.0
        self._evaluating: str | None = None  # "validating 3/10" while validation runs
        self._start_time: float | None = None
        self._start_step = 0
        self._last_printed_step = -1

    @property
    def refresh_rate(self) -> int:
        return self._refresh_rate

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self._refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = Console(**self._console_kwargs)
        return self._console

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # disables the bar off global rank 0
        plain = self.plain
        if plain is None:
            plain = not (self.console.is_terminal or self.console.is_jupyter)
        self._plain_mode = plain
        if plain:
            self.disable()

    # ---------------------------------------------------------------- the line
    def total_steps(self, trainer: L.Trainer) -> int | None:
        """Optimizer steps of the run, when known without loading data."""
        if trainer.max_steps > 0:
            return trainer.max_steps
        if trainer.train_dataloader is None:  # estimating would load it (and say so)
            return None
        total = float(trainer.estimated_stepping_batches)
        return int(total) if math.isfinite(total) else None

    def eta_seconds(self, trainer: L.Trainer) -> float | None:
        """Seconds until the last optimizer step at the mean pace so far, or None."""
        steps_done = trainer.global_step - self._start_step
        total = self.total_steps(trainer)
        if self._start_time is None or steps_done <= 0 or total is None:
            return None
        per_step = (time.perf_counter() - self._start_time) / steps_done
        return max(0.0, (total - trainer.global_step) * per_step)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version: the run folder already says it
        items = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in items.items()}
        tokens_per_sec = trainer.callback_metrics.get(TOKENS_PER_SEC_KEY)
        if tokens_per_sec is not None:
            items["tok/s"] = format_count(float(tokens_per_sec))
        eta = self.eta_seconds(trainer) if trainer.training else None
        if eta is not None:
            items["eta"] = format_duration(eta)
        return items

    def line_fields(
        self, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> list[tuple[str, int]]:
        """The line's ``(text, rank)`` fields in display order; rank 0 is always shown."""
        total = self.total_steps(trainer)
        fields = [(f"step {trainer.global_step}" + (f"/{total}" if total else ""), 0)]
        if self._evaluating:
            fields.append((self._evaluating, 1))
        metrics = self.get_metrics(trainer, pl_module)
        tokens_per_sec, eta = metrics.pop("tok/s", None), metrics.pop("eta", None)
        # the training loss first, whichever metric was logged first (a validation at
        # the start logs val/loss before it)
        ordered = sorted(metrics.items(), key=lambda item: item[0] != "train/loss")
        for rank, (name, value) in enumerate(ordered, start=5):
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            label = name.removeprefix("train/")
            fields.append((f"{label} {text}", 2 if label == "loss" else rank))
        if tokens_per_sec is not None:
            fields.append((f"{tokens_per_sec} tok/s", 4))
        if eta is not None:
            fields.append((f"eta {eta}", 3))
        return fields

    def plain_line(
        self, trainer: L.Trainer, pl_module: L.LightningModule, width: int | None = None
    ) -> str:
        """``step 120/1000 | loss 3.412 | 52.1k tok/s | eta 0:04:10``, at most ``width``
        (default: the console's) characters."""
        fields = self.line_fields(trainer, pl_module)
        return fit_fields(fields, self.console.width if width is None else width)

    def live_text(self, trainer: L.Trainer, pl_module: L.LightningModule, width: int) -> Text:
        """The plain line with a bar in front when ``width`` leaves room for it."""
        line = self.plain_line(trainer, pl_module, width)
        total = self.total_steps(trainer)
        if not total or len(line) + BAR_CELLS + 1 > width:
            return Text(line, no_wrap=True, overflow="crop")
        done = min(BAR_CELLS, round(BAR_CELLS * trainer.global_step / total))
        text = Text(no_wrap=True, overflow="crop")
        text.append("━" * done, style="magenta")
        text.append("─" * (BAR_CELLS - done) + " ", style="bright_black")
        text.append(line)
        return text

    # -------------------------------------------------------------- live line
    def _draw(self, trainer: L.Trainer, pl_module: L.LightningModule, force: bool = False) -> None:
        now = time.monotonic()
        if self._live is None or (not force and now < self._next_draw):
            return
        self._next_draw = now + 1.0 / self._refresh_rate
        self._live.update(self.live_text(trainer, pl_module, self.console.width), refresh=True)

    def _start_live(self) -> None:
        if self._live is None and self.is_enabled:
            # auto_refresh off: the line changes only in the hooks below, never from a thread
            self._live = Live(console=self.console, auto_refresh=False, transient=not self.leave)
            self._live.start()

    def _stop_live(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_live()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_time = time.perf_counter()
        self._start_step = trainer.global_step
        self._start_live()
        self._draw(trainer, pl_module, force=True)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        total = self.total_steps(trainer)
        last = total is not None and trainer.global_step >= total
        if self._live is not None:
            self._draw(trainer, pl_module, force=last)
        elif self._plain_mode and trainer.is_global_zero:
            step = trainer.global_step
            # Lightning's logger connector sets log_every_n_steps, undeclared on the class
            every = self.print_every_n_steps or trainer.log_every_n_steps or 1  # type: ignore[attr-defined]
            if step != self._last_printed_step and (step % every == 0 or last):
                self._last_printed_step = step
                print(self.plain_line(trainer, pl_module), file=sys.stdout, flush=True)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_live()

    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.has_dataloader_changed(dataloader_idx)  # tracks the loader whose length is shown

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._live is None:
            return
        total = self.total_val_batches_current_dataloader
        what = "sanity check" if trainer.sanity_checking else "validating"
        self._evaluating = f"{what} {batch_idx + 1}" + (
            f"/{int(total)}" if math.isfinite(total) else ""
        )
        self._draw(trainer, pl_module, force=batch_idx + 1 == total)  # the count reaches N/N

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluating = None
        self.reset_dataloader_idx_tracker()
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._draw(trainer, pl_module, force=True)  # with the new validation metrics
        elif trainer.state.fn != "fit":
            self._stop_live()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._draw(trainer, pl_module, force=True)
        self._stop_live()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._stop_live()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_live()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_console"] = state["_live"] = None  # they hold locks and streams
        return state
