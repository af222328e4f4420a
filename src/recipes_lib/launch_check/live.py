"""The checks that build real things: the data, two training steps, a checkpoint.

They run what :func:`recipes_lib.train.run` runs, on this machine, into a scratch folder
that is removed afterwards: the objective's data module (prepared and set up, so a
missing or empty source fails here), its LightningModule under the configured
strategy and precision for two optimizer steps of one micro-batch each (the second
has the optimizer's state, so its memory is the run's steady state), and a save and load of
that trained state through the strategy's own checkpoint path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from recipes_lib.assembly import batch_schedule, build_stage, build_trainer
from recipes_lib.config import RunConfig
from recipes_lib.data.mixture import MixtureDataset
from recipes_lib.data.module import dataset_length
from recipes_lib.data.text.shards import TokenShard
from recipes_lib.launch_check.budget import human
from recipes_lib.objectives import build_data as build_objective_data
from recipes_lib.parallel.context import data_parallel_size

# Training on the same data more often than this many times is worth a warning:
# Muennighoff et al. (2023) find up to about 4 epochs of repeated data nearly as good
# as fresh data, and quickly diminishing returns after that.
MAX_DATA_REPEATS = 4.0
LIVE_STEPS = 2  # the second step has the optimizer's state: the steady state's memory
_FINGERPRINT_CHUNK = 1 << 24  # bytes hashed per kernel launch
_FINGERPRINT_PRIME = 65521


@dataclass
class SourceSize:
    """One training source: what it holds and how often the run reads it."""

    name: str
    holds: str  # e.g. "1,204 documents, 3.1M tokens"
    items: int  # training rows (or pairs) it gives
    share: float  # of the training stream
    passes: float = 0.0  # times the run reads it


def training_samples(cfg: RunConfig, steps: int, world_size: int) -> int:
    """Rows (or pairs) every data-parallel replica together reads over ``steps``
    optimizer steps (the ranks of a context-parallel group read the same rows)."""
    micro_batches = batch_schedule(cfg, world_size).micro_batches_before(steps)
    return micro_batches * cfg.data.batch_size * _replicas(cfg, world_size)


def _replicas(cfg: RunConfig, world_size: int) -> int:
    return data_parallel_size(world_size, cfg.strategy.context_parallel)


def build_data(cfg: RunConfig, steps: int, world_size: int = 1) -> L.LightningDataModule:
    """The objective's data module, prepared and set up as a run's would be."""
    per_rank = training_samples(cfg, steps, world_size) // _replicas(cfg, world_size)
    datamodule = build_objective_data(cfg, total_train_samples=per_rank)
    datamodule.prepare_data()
    datamodule.setup("fit")
    # prepared once: the training steps' fit would prepare (and report) it again
    datamodule.prepare_data = _prepared
    return datamodule


def _prepared() -> None:
    """A data module's ``prepare_data`` once it has run."""


def source_sizes(datamodule: L.LightningDataModule, samples: int) -> list[SourceSize]:
    """What each training source holds and how many times ``samples`` rows read it."""
    dataset = getattr(datamodule, "train_dataset", None)
    if isinstance(dataset, MixtureDataset):  # one entry per source
        parts = list(zip(dataset.names, dataset.lengths, dataset.shares, strict=True))
    else:
        names = _source_names(datamodule)
        parts = [(" + ".join(names) or "data", dataset_length(dataset, "train_dataset"), 1.0)]
    sizes = []
    for name, items, share in parts:
        size = SourceSize(name, _holds(datamodule, name), items, share)
        size.passes = samples * share / items if items else math.inf
        sizes.append(size)
    return sizes


def _source_names(datamodule: L.LightningDataModule) -> list[str]:
    prepared = getattr(datamodule, "prepared", None)
    shards = getattr(prepared, "train_shards", None)
    if shards:
        return list(shards)
    return list(getattr(datamodule, "sources", {}) or {})


def _holds(datamodule: L.LightningDataModule, name: str) -> str:
    """A source's size in its own terms: documents and tokens (pretraining text),
    records and conversations (chat)."""
    prepared = getattr(datamodule, "prepared", None)
    shards = getattr(prepared, "train_shards", None) or {}
    if name in shards:
        shard = TokenShard.open(shards[name])
        return f"{shard.n_docs:,} documents, {human(shard.n_tokens)} tokens"
    stats = getattr(datamodule, "stats", {}).get(name)
    if stats is not None:
        return f"{stats.records:,} records, {stats.train:,} training conversations"
    return ""  # preference pairs: the pairs themselves are the items


@dataclass
class StepsResult:
    """What the training steps showed."""

    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    peak_allocated: int | None = None  # CUDA bytes, model build included


class _StepProbe(L.Callback):
    """Each step's loss and wall time."""

    def __init__(self, result: StepsResult) -> None:
        self.result = result
        self.started = 0.0

    def _sync(self, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.result.step_seconds.append(time.perf_counter() - self.started)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self.result.losses.append(float(loss.detach().float()))


def live_config(cfg: RunConfig, scratch: Path) -> RunConfig:
    """``cfg`` for the live steps: two optimizer steps of one micro-batch, no
    validation, callbacks, loggers or output averaging, written under ``scratch``."""
    trainer = dataclasses.replace(
        cfg.trainer,
        max_steps=LIVE_STEPS,
        accumulate_grad_batches=1,
        val_check_interval=None,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    stage = dataclasses.replace(cfg.stage, average_last_k=None, ema_decay=None)
    run = dataclasses.replace(cfg.run, dir=str(scratch), ckpt_path=None)
    return dataclasses.replace(cfg, trainer=trainer, stage=stage, run=run, callbacks={}, logger={})


def train_steps(
    cfg: RunConfig, datamodule: L.LightningDataModule, *, total_steps: int, tokens_per_step: int
) -> tuple[L.Trainer, L.LightningModule, StepsResult]:
    """Train ``cfg`` (a :func:`live_config`) for its steps on ``datamodule``; the module
    is built as the run builds it (its schedule spans the run's ``total_steps``)."""
    result = StepsResult()
    L.seed_everything(cfg.run.seed, workers=True, verbose=False)
    trainer = build_trainer(cfg, [_StepProbe(result)])
    # Lightning adds a checkpoint callback of its own; the round trip saves explicitly
    # (Lightning's callback connector sets Trainer.callbacks, which the class does not declare)
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    kept = [cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)]
    trainer.callbacks = kept  # type: ignore[attr-defined]
    module = build_stage(cfg, total_steps=total_steps, tokens_per_step=tokens_per_step)
    cuda = trainer.strategy.root_device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
    trainer.fit(module, datamodule=datamodule)
    if cuda:
        result.peak_allocated = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
    if len(result.losses) < cfg.trainer.max_steps:
        raise RuntimeError(
            f"training stopped after {len(result.losses)} of {cfg.trainer.max_steps} steps"
        )
    return trainer, module, result


# ------------------------------------------------------------------ checkpoint round trip
@dataclass
class RoundTrip:
    """A save and load of the trained state through the strategy's checkpoint path."""

    tensors: int  # model and optimizer tensors compared
    differing: list[str]  # their names where the loaded state differs
    size_bytes: int
    save_seconds: float
    load_seconds: float


def checkpoint_round_trip(trainer: L.Trainer, module: L.LightningModule, folder: Path) -> RoundTrip:
    """Save the trained state, change every float weight and optimizer state, load the
    checkpoint back and compare each tensor's bytes with what was saved.

    Each tensor is compared by a position-weighted sum of its bytes computed on its
    device (a copy of the whole state would not fit the host for large models): one
    changed byte always changes it. Every rank compares its own shards; the names of
    differing tensors are gathered from all of them.
    """
    path = Path(trainer.strategy.broadcast(str(folder / "round_trip.ckpt")))
    before = dict(_fingerprints(trainer, module))
    started = time.perf_counter()
    trainer.save_checkpoint(path)
    saved = time.perf_counter()
    _perturb(trainer, module)
    loading = time.perf_counter()
    checkpoint = trainer.strategy.load_checkpoint(path)
    trainer.strategy.load_model_state_dict(checkpoint, strict=True)
    trainer.strategy.load_optimizer_state_dict(checkpoint)
    loaded = time.perf_counter()
    after = dict(_fingerprints(trainer, module))
    differing = sorted(k for k, v in before.items() if after.get(k) != v)
    differing += sorted(set(after) - set(before))
    flags = torch.tensor([float(len(differing))], device=trainer.strategy.root_device)
    others = int(trainer.strategy.reduce(flags, reduce_op="sum").item()) - len(differing)
    if others > 0:
        differing.append(f"{others} tensor(s) on other ranks")
    return RoundTrip(
        tensors=len(before),
        differing=differing,
        size_bytes=_size(path),
        save_seconds=saved - started,
        load_seconds=loaded - loading,
    )


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's shard on this rank, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _states(trainer: L.Trainer, module: L.LightningModule) -> Iterator[tuple[str, Tensor]]:
    """Every model tensor of the state dict and every optimizer state tensor, by name."""
    yield from module.state_dict().items()
    for index, optimizer in enumerate(trainer.optimizers):
        for group, params in enumerate(optimizer.param_groups):
            for position, param in enumerate(params["params"]):
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, Tensor):
                        yield f"optimizer{index}.group{group}.{position}.{key}", value


def _fingerprints(trainer: L.Trainer, module: L.LightningModule) -> Iterator[tuple[str, int]]:
    with torch.no_grad():
        for name, tensor in _states(trainer, module):
            yield name, tensor_fingerprint(tensor)


def tensor_fingerprint(tensor: Tensor) -> int:
    """A number that changes whenever any byte of ``tensor`` (its local shard) does:
    each byte times its position's weight, summed in int64 chunk by chunk on the
    tensor's own device, the chunk sums chained modulo a Mersenne prime."""
    raw = _local(tensor).detach().contiguous().reshape(-1).view(torch.uint8)
    total = raw.numel()
    for start in range(0, raw.numel(), _FINGERPRINT_CHUNK):
        part = raw[start : start + _FINGERPRINT_CHUNK].to(torch.int64)
        weights = torch.arange(1, part.numel() + 1, device=part.device, dtype=torch.int64)
        chunk = int((part * (weights % _FINGERPRINT_PRIME + 1)).sum())
        total = (total * 1_000_003 + chunk) % (2**61 - 1)
    return total


def _perturb(trainer: L.Trainer, module: L.LightningModule) -> None:
    """Add one to every float parameter and optimizer state tensor, in place, so a load
    that restores nothing is caught."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point():
                param.add_(1.0)
        for optimizer in trainer.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, Tensor) and value.is_floating_point():
                        value.add_(1.0)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's own info lines (GPU available, ...) left out of the check's output."""
    import logging

    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
