"""Auto-fit: what ``kernels.activation_checkpointing=auto`` becomes before the model is built.

The run is fitted to a memory budget: ``run.memory_budget_gib``, else the total memory
of the CUDA card it trains on. Candidates are tried in order of expected speed, and the
first whose estimate (:func:`~recipes_lib.launch_check.estimate_memory`) is at most
:data:`FIT_SHARE` of the budget is taken:

1. the configured micro-batch first, then smaller ones (the divisors of
   ``data.batch_size``), each with more gradient accumulation so that the rows of an
   optimizer step stay the same: a smaller micro-batch loses the most speed;
2. within one micro-batch: checkpointing off, then every 4th, 3rd and 2nd block
   recomputed, then every block (each recomputed block costs another forward);
3. within those: the fused loss in chunks of 4,096 rows, then 1,024, then the configured
   ``kernels.loss_chunk_size`` (fewer, larger chunks launch fewer kernels). An unfused
   loss (null) stays unfused;
4. when none of those fits: every block recomputed and their inputs in host memory
   (``kernels.activation_offload``, :mod:`recipes_lib.kernels.offload`), which costs
   host-device copies on top of the recomputation, from the configured micro-batch down
   and with each loss chunk as above. With ``kernels.activation_offload=true`` set,
   only these are tried.

With no card and no budget (a CPU run), ``auto`` is off. A budget that no candidate
fits is a :class:`~recipes_lib.errors.ConfigError` naming the smallest estimate, and the
choices auto-fit does not make itself (8-bit AdamW moments, bf16 weights without an fp32
master copy) that would fit, with their estimates.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError
from recipes_lib.launch_check.memory import (
    GIB,
    estimate_memory,
    recomputed_block_count,
    rows_per_micro_batch,
)
from recipes_lib.parallel.precision import trains_on_cuda

# Of the budget, what the estimate may take: the estimate was within 5% of measured peaks,
# and the launch check warns above 90% of a card.
FIT_SHARE = 0.9
SELECTIVE_STRIDES = (4, 3, 2)  # every N-th block recomputed, fewest recomputed first
LARGE_LOSS_CHUNKS = (4096, 1024)  # tried before the configured chunk, largest first


@dataclass(frozen=True)
class FitChoice:
    """What auto-fit chose, or why it chose nothing (``estimate`` None: off, no budget).

    Attributes:
        stride: every how many blocks one is recomputed (0: none, 1: every block).
        loss_chunk_size: rows of the fused loss's chunks (None: unfused).
        batch_size: ``data.batch_size`` (examples per micro-batch).
        accumulate: ``trainer.accumulate_grad_batches``.
        rows: sequences per micro-batch (a preference pair is two).
        seq_len: tokens per sequence.
        offload: the recomputed blocks' inputs go to host memory.
        estimate: the estimated bytes at the peak (None: nothing was estimated).
        budget: the bytes fitted to (None: no card and no budget).
        budget_from: ``run.memory_budget_gib``, the card's name, or why there is none.
    """

    stride: int
    loss_chunk_size: int | None
    batch_size: int
    accumulate: int
    rows: int
    seq_len: int
    offload: bool = False
    estimate: int | None = None
    budget: int | None = None
    budget_from: str = ""

    def settings(self) -> str:
        """The choice in words: checkpointing, loss chunk, micro-batch."""
        parts = [f"activation checkpointing {_blocks_phrase(self.stride)}"]
        if self.offload:
            parts.append("their inputs offloaded to host memory")
        if self.loss_chunk_size is not None:
            parts.append(f"loss chunk {self.loss_chunk_size}")
        rows = f"{self.rows} x {self.seq_len} rows"
        if self.accumulate > 1:
            rows += f" with {self.accumulate} accumulation steps"
        return ", ".join([*parts, rows])

    def line(self) -> str:
        """The one line printed before training."""
        if self.estimate is None or self.budget is None:
            return f"auto-fit: {self.budget_from}: activation checkpointing off"
        return (
            f"auto-fit: {self.settings()}: est. {self.estimate / GIB:.1f} of "
            f"{self.budget / GIB:.1f} GiB ({self.budget_from})"
        )

    def as_dict(self) -> dict[str, Any]:
        """For the run's result and its manifest."""
        mode = {0: "off", 1: "full"}.get(self.stride, "selective")
        return {
            "activation_checkpointing": mode,
            "checkpoint_every": self.stride,
            "activation_offload": self.offload,
            "loss_chunk_size": self.loss_chunk_size,
            "batch_size": self.batch_size,
            "accumulate_grad_batches": self.accumulate,
            "estimate_gib": None if self.estimate is None else round(self.estimate / GIB, 2),
            "budget_gib": None if self.budget is None else round(self.budget / GIB, 2),
            "budget_from": self.budget_from,
            "line": self.line(),
        }

    def apply(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` with this choice in its kernels, micro-batch and accumulation."""
        mode = {0: "off", 1: "full"}.get(self.stride, "selective")
        kernels = dataclasses.replace(
            cfg.kernels,
            activation_checkpointing=mode,
            checkpoint_every=self.stride if mode == "selective" else cfg.kernels.checkpoint_every,
            loss_chunk_size=self.loss_chunk_size,
            activation_offload=self.offload,
        )
        factor = self.accumulate // cfg.trainer.accumulate_grad_batches
        ramp = cfg.stage.batch_ramp  # its start counts micro-batches
        stage = dataclasses.replace(
            cfg.stage, batch_ramp=dataclasses.replace(ramp, start=ramp.start * factor)
        )
        return dataclasses.replace(
            cfg,
            kernels=kernels,
            data=dataclasses.replace(cfg.data, batch_size=self.batch_size),
            trainer=dataclasses.replace(cfg.trainer, accumulate_grad_batches=self.accumulate),
            stage=stage,
        )


def _blocks_phrase(stride: int) -> str:
    if stride <= 0:
        return "off"
    if stride == 1:
        return "every block"
    suffix = {2: "nd", 3: "rd"}.get(stride, "th")  # codespell:ignore nd
    return f"every {stride}{suffix} block"


def candidates(cfg: RunConfig) -> list[FitChoice]:
    """Every configuration auto-fit may take for ``cfg``, fastest expected first
    (the module docstring's order); estimates not yet made."""
    batch, accumulate = cfg.data.batch_size, cfg.trainer.accumulate_grad_batches
    layers = cfg.model.n_layers
    by_count: dict[int, int] = {}  # blocks recomputed -> the smallest stride giving it
    for stride in SELECTIVE_STRIDES:
        count = recomputed_block_count(layers, stride)
        if 0 < count < layers:
            by_count[count] = min(stride, by_count.get(count, stride))
    strides = [0, *(by_count[c] for c in sorted(by_count)), 1]
    configured = cfg.kernels.loss_chunk_size
    chunks: list[int | None] = [configured]
    if configured is not None:
        ascending = sorted({*(c for c in LARGE_LOSS_CHUNKS if c > configured), configured})
        chunks = list(reversed(ascending))
    # offloading needs recomputed blocks (every block: selective would keep the others'
    # activations whole); asked for, it is kept in every candidate
    passes = [True] if cfg.kernels.activation_offload else [False, True]
    out = []
    for offload in passes:
        for micro in (b for b in range(batch, 0, -1) if batch % b == 0):
            data = dataclasses.replace(cfg.data, batch_size=micro)
            rows = rows_per_micro_batch(dataclasses.replace(cfg, data=data))
            # a rank's tokens (its share of each row under context parallelism): a chunk
            # as large as them holds them all, larger ones are alike
            tokens = rows * cfg.data.seq_len // max(1, cfg.strategy.context_parallel)
            sizes = [c for c in chunks if c is None or c == configured or c <= tokens]
            for stride in strides if not offload else [1]:
                for chunk in sizes:
                    steps = accumulate * batch // micro
                    out.append(
                        FitChoice(stride, chunk, micro, steps, rows, cfg.data.seq_len, offload)
                    )
    return out


def choose(
    cfg: RunConfig,
    budget: int,
    estimate: Callable[[RunConfig], int],
    *,
    budget_from: str = "run.memory_budget_gib",
) -> FitChoice:
    """The first of :func:`candidates` whose ``estimate`` (bytes) is at most
    :data:`FIT_SHARE` of ``budget`` (bytes).

    Raises:
        ConfigError: none fits; the line names the smallest estimate and its settings.
    """
    smallest: FitChoice | None = None
    for choice in candidates(cfg):
        needed = int(estimate(choice.apply(cfg)))
        choice = dataclasses.replace(
            choice, estimate=needed, budget=budget, budget_from=budget_from
        )
        if needed <= FIT_SHARE * budget:
            return choice
        if smallest is None or needed < (smallest.estimate or 0):
            smallest = choice
    assert smallest is not None  # there is always the configured micro-batch
    if cfg.run.memory_budget_gib is not None:
        what = f"run.memory_budget_gib={cfg.run.memory_budget_gib:g}"
    else:
        what = f"kernels.activation_checkpointing=auto on the {budget / GIB:.1f} GiB {budget_from}"
    fits = [
        f"{override} (est. {needed / GIB:.1f} GiB)"
        for override, needed in _other_numerics(smallest.apply(cfg), estimate, budget)
    ]
    other = f", or train with {' or '.join(fits)}" if fits else ""
    raise ConfigError(
        f"{what}: the smallest configuration ({smallest.settings()}) needs an estimated "
        f"{(smallest.estimate or 0) / GIB:.1f} GiB, more than {FIT_SHARE:.0%} of "
        f"{budget / GIB:.1f} GiB; give more memory, a shorter data.seq_len or a smaller "
        f"model{other}"
    )


def _other_numerics(
    cfg: RunConfig, estimate: Callable[[RunConfig], int], budget: int
) -> list[tuple[str, int]]:
    """Choices auto-fit never makes itself, since they change what is computed and not
    only where it is kept, that would fit ``budget`` from ``cfg`` (the smallest
    candidate), each with its estimate: 8-bit moments for AdamW, bf16 weights with no
    fp32 master copy for a mixed-precision run that trains its whole model (what TRL does
    with a bf16 folder), and both at once when neither alone fits."""
    found = []
    optim = dataclasses.replace(cfg.optim, name="adamw_8bit")
    bf16 = dataclasses.replace(cfg.precision, name="bf16-true")
    eight_bit = cfg.optim.name == "adamw"
    narrow = cfg.precision.name == "bf16-mixed" and cfg.adapter.kind == "none"
    if eight_bit:
        found.append(("optim.name=adamw_8bit", estimate(dataclasses.replace(cfg, optim=optim))))
    if narrow:
        found.append(("precision=bf16-true", estimate(dataclasses.replace(cfg, precision=bf16))))
    fits = [(override, int(needed)) for override, needed in found if needed <= FIT_SHARE * budget]
    if not fits and eight_bit and narrow:
        needed = estimate(dataclasses.replace(cfg, optim=optim, precision=bf16))
        if needed <= FIT_SHARE * budget:
            fits.append(("optim.name=adamw_8bit precision=bf16-true", int(needed)))
    return fits


def fit_memory(cfg: RunConfig, world_size: int = 1) -> tuple[RunConfig, FitChoice | None]:
    """``cfg`` with ``kernels.activation_checkpointing=auto`` resolved, and the choice
    (None when the config does not ask for auto).

    The budget is ``run.memory_budget_gib``, else the total memory of the CUDA card the
    run trains on (``LOCAL_RANK``'s); with neither, checkpointing is off.

    Raises:
        ConfigError: no candidate fits the budget (:func:`choose`).
    """
    if cfg.kernels.activation_checkpointing != "auto":
        if cfg.run.memory_budget_gib is not None:
            raise ConfigError(
                f"run.memory_budget_gib={cfg.run.memory_budget_gib:g} is fitted only with "
                "kernels.activation_checkpointing=auto (it is "
                f"{cfg.kernels.activation_checkpointing}): set it to auto, or drop the budget"
            )
        return cfg, None
    budget, budget_from = _budget(cfg)
    if budget is None:
        off = FitChoice(
            0,
            cfg.kernels.loss_chunk_size,
            cfg.data.batch_size,
            cfg.trainer.accumulate_grad_batches,
            rows_per_micro_batch(cfg),
            cfg.data.seq_len,
            budget_from=budget_from,
        )
        return off.apply(cfg), off
    choice = choose(
        cfg, budget, lambda c: estimate_memory(c, world_size).total, budget_from=budget_from
    )
    return choice.apply(cfg), choice


def _budget(cfg: RunConfig) -> tuple[int | None, str]:
    """The bytes to fit, and where they come from."""
    if cfg.run.memory_budget_gib is not None:
        if cfg.run.memory_budget_gib <= 0:
            raise ConfigError(
                f"run.memory_budget_gib={cfg.run.memory_budget_gib:g}: give a positive number "
                "of GiB, or null for the card's memory"
            )
        return int(cfg.run.memory_budget_gib * GIB), "run.memory_budget_gib"
    if not trains_on_cuda(cfg):
        return None, "no CUDA card and no run.memory_budget_gib"
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    properties = torch.cuda.get_device_properties(index)
    return int(properties.total_memory), properties.name
