"""The pre-launch check: one row per check, each OK, WARN, FAIL or SKIP, in this order.

1. **pre-flight**: the config converts to typed dataclasses and passes every cross-key
   check :func:`recipes_lib.train.run` makes before it touches data or weights;
2. **memory**: the per-GPU estimate (:func:`~recipes_lib.launch_check.estimate_memory`)
   against the visible GPU's memory (FAIL above it, WARN above 90% of it), after
   ``kernels.activation_checkpointing=auto`` is resolved as the run would
   (:mod:`.autofit`; FAIL where nothing fits);
3. **token budget**: steps x global batch x sequence length against the parameters
   and Chinchilla's ~20 tokens per parameter;
4. **step time**: the FLOPs of a step at an assumed MFU of the card's peak;
5. **checkpoint space**: the checkpoints the run keeps at once against the free space
   of ``run.dir``'s disk (FAIL when they do not fit, WARN above 90% of it; :mod:`.disk`);
6. **data**: the objective's data prepared and set up; what each source holds and how
   many times the run reads it (WARN above :data:`~.live.MAX_DATA_REPEATS`);
7. **forward/backward**: two optimizer steps of one micro-batch of that data, as the
   run builds them; on a GPU the measured peak against the estimate;
8. **checkpoint round trip**: the trained state saved and loaded back, bitwise equal.

The live checks (6-8) train in a scratch folder and take no lock on ``run.dir``, so
the check may run while a run trains there. They are skipped after a failed
pre-flight, and the training steps when the estimate does not fit the GPU (or, on a
CPU, the host's available memory).
Any FAIL makes :attr:`LaunchReport.exit_code` 1.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from recipes_lib.assembly import batch_schedule, check_run_config, tokens_per_step, total_steps
from recipes_lib.checkpoint.source import fill_model_from_init
from recipes_lib.config import RunConfig, to_run_config
from recipes_lib.errors import ConfigError
from recipes_lib.launch_check import live
from recipes_lib.launch_check.autofit import FitChoice, fit_memory
from recipes_lib.launch_check.budget import step_time, token_budget
from recipes_lib.launch_check.disk import checkpoint_space
from recipes_lib.launch_check.memory import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    rows_per_micro_batch,
)
from recipes_lib.objectives import objective_of
from recipes_lib.parallel.precision import resolve_device_choices, trains_on_cuda
from recipes_lib.parallel.strategy import get_strategy, planned_world_size

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
CHECKS = (
    "pre-flight",
    "memory",
    "token budget",
    "step time",
    "checkpoint space",
    "data",
    "forward/backward",
    "checkpoint round trip",
)
MEMORY_WARN_SHARE = 0.9  # of the GPU's memory: little room for fragmentation
DISK_WARN_SHARE = 0.9  # of the free space: logs and the output weights need some too
ESTIMATE_TOLERANCE = 0.15  # measured peak against the estimate before it is flagged
MESSAGE_CHARS = 400  # an error's text in a row


@dataclass
class CheckRow:
    check: str
    status: str
    figure: str


@dataclass
class LaunchReport:
    """The rows of a pre-launch check and the figures behind them."""

    rows: list[CheckRow] = field(default_factory=list)
    world_size: int = 1
    estimate: MemoryEstimate | None = None
    measured_peak: int | None = None  # CUDA bytes of the live steps
    memory_fit: FitChoice | None = None  # what kernels.activation_checkpointing=auto chose

    def add(self, check: str, status: str, figure: str) -> None:
        self.rows.append(CheckRow(check, status, " ".join(str(figure).split())))

    def status(self, check: str) -> str | None:
        return next((r.status for r in self.rows if r.check == check), None)

    @property
    def failed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.status == FAIL]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def check_launch(cfg: RunConfig | DictConfig) -> LaunchReport:
    """Run every check of the module docstring on ``cfg`` (a composed config or a typed
    one) and return their rows; nothing is written outside a temporary folder."""
    report = LaunchReport()
    try:
        if isinstance(cfg, DictConfig):
            cfg = fill_model_from_init(cfg)  # model=from_init: the shape of stage.init_from
            cfg = to_run_config(cfg)
        cfg = resolve_device_choices(cfg)
    except Exception as err:  # a config that cannot be read is the pre-flight's failure
        report.add("pre-flight", FAIL, _message(err))
        for check in CHECKS[1:]:
            report.add(check, SKIP, "the config could not be read")
        return report
    preflight_ok = _preflight(cfg, report)
    world = report.world_size = planned_world_size(cfg)
    try:  # kernels.activation_checkpointing=auto: checked as the run would choose
        cfg, report.memory_fit = fit_memory(cfg, world)
    except ConfigError as err:
        report.add("memory", FAIL, _message(err))
    else:
        _guarded(report, "memory", lambda: _memory(cfg, world, report))
    _guarded(report, "token budget", lambda: _budget(cfg, world, report))
    _guarded(report, "step time", lambda: _step_time(cfg, world, report))
    _guarded(report, "checkpoint space", lambda: _checkpoint_space(cfg, world, report))
    if not preflight_ok:
        for check in CHECKS[CHECKS.index("data") :]:
            report.add(check, SKIP, "the pre-flight failed")
        return report
    with live.quiet_lightning():
        _live(cfg, world, report)
    return report


def _message(err: BaseException) -> str:
    """An error as one line (its first), with its type where it is not one of ours."""
    from recipes_lib.errors import RecipesError

    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    if text.endswith(":") and len(lines) > 1:  # "Error(s) in loading state_dict for X:"
        text = f"{text} {lines[1]}"
    if len(text) > MESSAGE_CHARS:
        text = text[: MESSAGE_CHARS - 3] + "..."
    return text if isinstance(err, RecipesError) else f"{type(err).__name__}: {text}"


def _guarded(report: LaunchReport, check: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as err:
        report.add(check, FAIL, _message(err))


def _preflight(cfg: RunConfig, report: LaunchReport) -> bool:
    # the check itself runs with run.launch_check=true, which run() refuses to train with
    checked = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, launch_check=False))
    try:
        check_run_config(checked)
    except Exception as err:
        report.add("pre-flight", FAIL, _message(err))
        return False
    spec = get_strategy(cfg.strategy.name)
    report.add(
        "pre-flight",
        OK,
        f"{cfg.stage.objective}, model {cfg.model.name}, {cfg.precision.name}, "
        f"strategy {spec.name}, adapter {cfg.adapter.kind}: every cross-key check passed",
    )
    return True


def _size(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


_PARTS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer", "optimizer state"),
    ("activations", "activations"),
    ("logits", "logits"),
    ("transient", "weight copies"),
    ("buffers", "buffers"),
)


def _memory(cfg: RunConfig, world: int, report: LaunchReport) -> None:
    est = report.estimate = estimate_memory(cfg, world)
    on_cuda = trains_on_cuda(cfg)
    parts = ", ".join(
        f"{label} {_size(getattr(est, name))}"
        for name, label in _PARTS
        if getattr(est, name) >= 2**20
    )
    figure = f"{_size(est.total)} per {'GPU' if on_cuda else 'device'} at the {est.phase}: {parts}"
    if est.overhead:
        figure += f", CUDA context and allocator slack {_size(est.overhead)}"
    if est.phase == "build":
        figure += f" (building the model peaks at {_size(est.build)})"
    if est.notes:
        figure += "; " + "; ".join(est.notes)
    if report.memory_fit is not None:
        figure = f"{report.memory_fit.line()}; {figure}"
    if not on_cuda:
        report.add("memory", OK, f"{figure}; no GPU visible to compare")
        return
    index = torch.cuda.current_device()
    capacity = torch.cuda.get_device_properties(index).total_memory
    where = f"{_size(capacity)} of {torch.cuda.get_device_name(index)}"
    if est.total > capacity:
        report.add("memory", FAIL, f"{figure}: more than the {where}")
    elif est.total > MEMORY_WARN_SHARE * capacity:
        report.add("memory", WARN, f"{figure}: {est.total / capacity:.0%} of the {where}")
    else:
        report.add("memory", OK, f"{figure}: {est.total / capacity:.0%} of the {where}")


def _budget(cfg: RunConfig, world: int, report: LaunchReport) -> None:
    report.add("token budget", OK, token_budget(cfg, world).summary())


def _step_time(cfg: RunConfig, world: int, report: LaunchReport) -> None:
    expected = step_time(cfg, world)
    report.add("step time", OK if expected.seconds is not None else SKIP, expected.summary())


def _checkpoint_space(cfg: RunConfig, world: int, report: LaunchReport) -> None:
    space = checkpoint_space(cfg, total_steps(cfg, batch_schedule(cfg, world)))
    figure = (
        f"{space.count} checkpoint(s) of about {_size(space.each)} at once "
        f"(run.keep_last_checkpoints={cfg.run.keep_last_checkpoints}, one more while the "
        f"next lands): {_size(space.needed)}; {_size(space.free)} free on the disk of "
        f"{space.folder}"
    )
    if space.existing:
        figure += f", and {_size(space.existing)} in checkpoints already there"
    if space.needed > space.available:
        report.add("checkpoint space", FAIL, f"{figure}: they do not fit")
    elif space.needed > DISK_WARN_SHARE * space.available:
        report.add("checkpoint space", WARN, f"{figure}: little room left for the rest")
    else:
        report.add("checkpoint space", OK, figure)


def _available_host_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (Linux), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _live(cfg: RunConfig, world: int, report: LaunchReport) -> None:
    step_tokens = tokens_per_step(cfg, world)
    steps = total_steps(cfg, batch_schedule(cfg, world))
    scratch = Path(tempfile.mkdtemp(prefix="recipes-check-"))
    try:
        datamodule = _data(cfg, steps, world, report)
        if datamodule is None:
            report.add("forward/backward", SKIP, "no data")
            report.add("checkpoint round trip", SKIP, "no data")
            return
        trained = _steps(cfg, datamodule, steps, step_tokens, scratch, report)
        if trained is None:
            report.add("checkpoint round trip", SKIP, "no trained state")
            return
        trainer, module = trained
        _guarded(
            report, "checkpoint round trip", lambda: _round_trip(trainer, module, scratch, report)
        )
        trainer.strategy.barrier("launch_check")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _data(cfg: RunConfig, steps: int, world: int, report: LaunchReport):
    try:
        datamodule = live.build_data(cfg, steps, world)
        samples = live.training_samples(cfg, steps, world)
        sizes = live.source_sizes(datamodule, samples)
    except Exception as err:
        report.add("data", FAIL, _message(err))
        return None
    unit = objective_of(cfg).example_noun or f"rows of {cfg.data.seq_len}"
    figure = "; ".join(
        f"{s.name}: {s.holds + ', ' if s.holds else ''}{s.items:,} {unit}, "
        f"read {s.passes:.2g} times"
        for s in sizes
    )
    empty = [s.name for s in sizes if s.items == 0]
    repeated = [s for s in sizes if s.passes > live.MAX_DATA_REPEATS]
    if empty:
        report.add("data", FAIL, f"{', '.join(empty)} gives no training {unit}: {figure}")
        return None
    if repeated:
        worst = max(repeated, key=lambda s: s.passes)
        report.add(
            "data",
            WARN,
            f"{figure}: the run reads {worst.name} {worst.passes:.2g} times, more than "
            f"{live.MAX_DATA_REPEATS:g} (repeated data helps less)",
        )
    else:
        report.add("data", OK, figure)
    return datamodule


def _steps(cfg, datamodule, steps, step_tokens, scratch, report):
    est = report.estimate
    if report.status("memory") == FAIL:
        report.add("forward/backward", SKIP, "the memory estimate does not fit the GPU")
        return None
    host = _available_host_bytes()
    if est is not None and not trains_on_cuda(cfg) and host and est.allocated > host:
        report.add(
            "forward/backward",
            SKIP,
            f"the steps need about {_size(est.allocated)} and this host has "
            f"{_size(host)} available; run the check where the run will train",
        )
        return None
    live_cfg = live.live_config(cfg, scratch)
    try:
        trainer, module, result = live.train_steps(
            live_cfg, datamodule, total_steps=steps, tokens_per_step=step_tokens
        )
    except Exception as err:
        report.add("forward/backward", FAIL, _message(err))
        return None
    rows = rows_per_micro_batch(cfg)
    losses = " -> ".join(f"{x:.4g}" for x in result.losses)
    figure = (
        f"{len(result.losses)} steps of {rows} x {cfg.data.seq_len} tokens: loss {losses}, "
        f"last step {result.step_seconds[-1]:.2f} s"
    )
    if not all(math.isfinite(x) for x in result.losses):
        report.add("forward/backward", FAIL, f"{figure}: the loss is not finite")
        return None
    status = OK
    if result.peak_allocated is not None and est is not None:
        report.measured_peak = result.peak_allocated
        error = est.allocated / result.peak_allocated - 1
        figure += (
            f"; peak {_size(result.peak_allocated)} measured, "
            f"{_size(est.allocated)} estimated ({error:+.0%})"
        )
        if abs(error) > ESTIMATE_TOLERANCE:
            status = WARN
            figure += f": the estimate is off by more than {ESTIMATE_TOLERANCE:.0%}"
    report.add("forward/backward", status, figure)
    return trainer, module


def _round_trip(trainer, module, scratch: Path, report: LaunchReport) -> None:
    trip = live.checkpoint_round_trip(trainer, module, scratch)
    timing = (
        f"{trip.size_bytes / 2**20:,.1f} MiB, saved in {trip.save_seconds:.1f} s, "
        f"loaded in {trip.load_seconds:.1f} s"
    )
    if trip.differing:
        shown = ", ".join(trip.differing[:3])
        report.add(
            "checkpoint round trip",
            FAIL,
            f"{len(trip.differing)} of {trip.tensors} tensors differ after loading "
            f"({shown}{', ...' if len(trip.differing) > 3 else ''}); {timing}",
        )
    else:
        report.add(
            "checkpoint round trip",
            OK,
            f"{trip.tensors} model and optimizer tensors bitwise equal after loading; {timing}",
        )


STATUS_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def print_report(report: LaunchReport, title: str, console: Console | None = None) -> None:
    """The rows as a Rich table on stdout, then one line with the verdict."""
    table = Table(title=title)
    for column, justify in (("check", "left"), ("status", "left"), ("figure", "left")):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in report.rows:
        style = STATUS_STYLE.get(row.status, "")
        table.add_row(row.check, f"[{style}]{row.status}[/]" if style else row.status, row.figure)
    if console is None:
        # a terminal's own width; a file or pipe gets room for long figures
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 160))
    console.print(table)
    failed = report.failed
    if failed:
        console.print(
            f"pre-launch check: {len(failed)} problem(s): " + ", ".join(r.check for r in failed)
        )
    else:
        console.print("pre-launch check: ready to launch")
