"""How much a run trains and how long a step should take, from its config alone.

:func:`token_budget` counts the tokens the run will consume (optimizer steps x global
batch x sequence length) against the model's parameters; Chinchilla's compute-optimal
ratio (Hoffmann et al., 2022) is about 20 tokens per parameter. :func:`step_time` turns
the FLOPs of a step into seconds at an assumed model FLOPs utilisation of the card's
dense peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recipes_lib.assembly import batch_schedule, tokens_per_step, total_steps
from recipes_lib.callbacks.throughput import peak_tflops_for, precision_arithmetic
from recipes_lib.config.schema import RunConfig
from recipes_lib.launch_check.activations import DecoderShape
from recipes_lib.launch_check.memory import recomputed_block_count, rows_per_micro_batch
from recipes_lib.launch_check.parameters import ParameterCounts
from recipes_lib.models.hf_fallback import model_shapes
from recipes_lib.objectives import objective_of
from recipes_lib.parallel.context import data_parallel_size
from recipes_lib.parallel.precision import lightning_precision, trains_on_cuda

CHINCHILLA_TOKENS_PER_PARAM = 20.0
# Model FLOPs utilisation assumed for the expected step time: what this library's bf16
# pretraining reaches on an H100/H200 with compiled blocks (48-56%,
# benchmarks/results/NOTES.md), rounded down for eager kernels, smaller models and
# data loading.
ASSUMED_MFU = 0.4
# Activation checkpointing runs each block's forward twice: 8 instead of 6 FLOPs per
# parameter and token of matmul work, all of it on the card's clock.
CHECKPOINTING_FLOPS = 8 / 6


@dataclass(frozen=True)
class TokenBudget:
    """What the run will consume, against its size.

    Attributes:
        steps: optimizer steps (``stage.max_tokens`` or ``trainer.max_steps``).
        tokens_per_step: tokens of one optimizer step over every rank.
        tokens: every step's tokens (``steps x tokens_per_step`` without a batch ramp).
        parameters: the decoder's parameters (a tied head counted once).
        trainable: the parameters the run trains (an adapter's only, with LoRA).
        from_scratch: pretraining without starting weights: the case Chinchilla's ratio
            is about.
    """

    steps: int
    tokens_per_step: int
    tokens: int
    parameters: int
    trainable: int
    from_scratch: bool

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens / self.parameters

    @property
    def chinchilla_share(self) -> float:
        """Tokens per parameter as a share of Chinchilla's ~20."""
        return self.tokens_per_parameter / CHINCHILLA_TOKENS_PER_PARAM

    def summary(self) -> str:
        """One line: tokens, tokens per parameter, and against Chinchilla's ~20."""
        ratio = self.tokens_per_parameter
        if not self.from_scratch:
            verdict = "fine-tuning: Chinchilla's ~20 is about pretraining from scratch"
        elif ratio < CHINCHILLA_TOKENS_PER_PARAM:
            verdict = f"under Chinchilla's ~20 ({self.chinchilla_share:.2g}x)"
        else:
            verdict = f"over Chinchilla's ~20 ({self.chinchilla_share:.2g}x)"
        return (
            f"{self.steps:,} steps x {self.tokens_per_step:,} tokens = {human(self.tokens)} "
            f"tokens for {human(self.parameters)} parameters: {ratio:.3g} per parameter, "
            f"{verdict}"
        )


def human(n: float) -> str:
    """``n`` with a k / M / B / T suffix (three significant digits)."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.3g}"


def token_budget(cfg: RunConfig, world_size: int = 1) -> TokenBudget:
    """The tokens ``cfg`` trains on over ``world_size`` ranks, against its parameters."""
    schedule = batch_schedule(cfg, world_size)
    steps = total_steps(cfg, schedule)
    # a preference pair is two sequences (chosen, rejected) of up to data.seq_len tokens
    rows = rows_per_micro_batch(cfg)
    step_tokens = tokens_per_step(cfg, world_size) * rows // cfg.data.batch_size
    tokens = schedule.tokens_before(steps) * rows // cfg.data.batch_size
    shape = DecoderShape.of(cfg)
    counts = ParameterCounts.of(shape, cfg)
    return TokenBudget(
        steps=steps,
        tokens_per_step=step_tokens,
        tokens=tokens,
        parameters=counts.total,
        trainable=counts.trainable,
        from_scratch=objective_of(cfg).from_scratch and cfg.stage.init_from is None,
    )


@dataclass(frozen=True)
class StepTime:
    """The expected time of one optimizer step.

    Attributes:
        flops: training FLOPs of one optimizer step over every rank.
        device: the card the time is for (``torch.cuda.get_device_name``), or None.
        peak_tflops: its dense peak in the run's arithmetic, or None when unknown.
        seconds: the expected step time, None on an unknown card or a CPU.
    """

    flops: float
    device: str | None
    peak_tflops: float | None
    seconds: float | None
    world_size: int

    def summary(self) -> str:
        flops = f"{self.flops / 1e12:.3g} TFLOP per step"
        if self.seconds is None:
            where = self.device or "no CUDA GPU visible"
            return f"{flops}; unknown card ({where}): no expected time"
        return (
            f"{flops} over {self.world_size} x {self.device} at {self.peak_tflops:g} "
            f"TFLOP/s peak and {ASSUMED_MFU:.0%} MFU: {_seconds(self.seconds)} per step"
        )


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def step_flops(cfg: RunConfig, world_size: int = 1) -> float:
    """Training FLOPs of one optimizer step: ``Transformer.flops_per_token`` (6 per
    parameter and token, plus attention) times the step's tokens; a DPO reference's
    forward adds a third, activation checkpointing's second forward another third of
    the matmul work."""
    model = model_shapes(cfg.model)  # shapes only, on the meta device
    per_token = model.flops_per_token(cfg.data.seq_len)
    if _reference_each_step(cfg):
        per_token *= 4 / 3
    # the recomputed blocks' second forward (every block: a third more matmul work)
    recomputed = recomputed_block_count(cfg.model.n_layers, cfg.kernels.checkpoint_stride())
    per_token *= 1 + (CHECKPOINTING_FLOPS - 1) * recomputed / cfg.model.n_layers
    replicas = data_parallel_size(world_size, cfg.strategy.context_parallel)  # whole rows
    rows = rows_per_micro_batch(cfg) * cfg.trainer.accumulate_grad_batches * replicas
    return per_token * rows * cfg.data.seq_len


def _reference_each_step(cfg: RunConfig) -> bool:
    """A frozen model of the policy's shape runs a forward at every step (a reference
    whose log-probs are not precomputed, even one that is the policy without its
    adapters): its forward adds a third of the policy's training work."""
    spec = objective_of(cfg)
    frozen = spec.frozen_models(cfg, spec.settings_of(cfg))
    return any(f.forward_each_step and f.model == cfg.model for f in frozen)


def step_time(cfg: RunConfig, world_size: int = 1, device_name: str | None = None) -> StepTime:
    """The expected time of one optimizer step on ``world_size`` cards named
    ``device_name`` (default: the visible CUDA GPU, when the run trains on one).

    ``seconds = flops / (world_size x peak x ASSUMED_MFU)``, the peak in the
    arithmetic of ``precision`` (bf16 for the mixed ones, TF32 or fp32 for 32-true).
    """
    flops = step_flops(cfg, world_size)
    if device_name is None and trains_on_cuda(cfg):
        device_name = torch.cuda.get_device_name(0)
    arithmetic = precision_arithmetic(lightning_precision(cfg.precision))
    peak = peak_tflops_for(device_name, arithmetic) if device_name else None
    seconds = None if peak is None else flops / (world_size * peak * 1e12 * ASSUMED_MFU)
    return StepTime(flops, device_name, peak, seconds, world_size)
