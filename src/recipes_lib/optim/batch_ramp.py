"""The global batch of each optimizer step: constant, or ramped up by gradient accumulation.

A step accumulates ``k(s)`` micro-batches of ``data.batch_size`` sequences on every rank.
Without a ramp ``k(s)`` is ``trainer.accumulate_grad_batches`` (``K``) throughout. With
``stage.batch_ramp.tokens=T`` it starts at ``stage.batch_ramp.start`` (``k0``) and grows
linearly with the tokens trained on before the step::

    k(s) = min(K, k0 + floor((K - k0) * tokens_before(s) / T))

so the global batch goes from ``k0 x data.batch_size x world`` sequences to the full
``K x data.batch_size x world`` once ``T`` tokens are behind it, in whole micro-batches.
Everything that counts samples from steps (the data position in checkpoints, the
loader's length, token durations, a rollback's window) reads it here, so a run resumed
mid-ramp continues exactly where it stopped: the schedule is a function of the config
and the world size alone.

With ``stage.batch_ramp.lr=sqrt`` the learning rate of a step is scaled by
``sqrt(k(s) / K)`` (the square-root rule for a smaller batch); ``constant`` leaves it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from recipes_lib.config.schema import BatchRampConfig
from recipes_lib.errors import ConfigError

LR_RULES = ("constant", "sqrt")


def check_batch_ramp(ramp: BatchRampConfig, accumulate: int) -> None:
    """Refuse a ramp that cannot run, naming the keys.

    Raises:
        ConfigError: a negative length, a start outside ``[1, accumulate]`` or an
            unknown learning-rate rule.
    """
    if ramp.tokens < 0:
        raise ConfigError(f"stage.batch_ramp.tokens={ramp.tokens} must not be negative")
    if ramp.lr not in LR_RULES:
        raise ConfigError(f"stage.batch_ramp.lr={ramp.lr!r} is not one of {', '.join(LR_RULES)}")
    if ramp.tokens and not 1 <= ramp.start <= accumulate:
        raise ConfigError(
            f"stage.batch_ramp.start={ramp.start} must be between 1 and "
            f"trainer.accumulate_grad_batches={accumulate} (the full batch it ramps up to)"
        )


@dataclass(frozen=True)
class BatchSchedule:
    """Micro-batches per optimizer step, and the counts that follow from them.

    Args:
        final: ``trainer.accumulate_grad_batches``, the accumulation after the ramp.
        tokens_per_micro_batch: tokens of one micro-batch on every rank together
            (``data.seq_len x data.batch_size x world size``).
        start: the accumulation of the first step (``final``: no ramp).
        ramp_tokens: tokens over which the accumulation grows to ``final``.
        lr_rule: ``constant`` or ``sqrt``.
    """

    final: int
    tokens_per_micro_batch: int
    start: int = 0
    ramp_tokens: int = 0
    lr_rule: str = "constant"
    # the ramp's steps: accumulation of each, micro-batches before each (and after the last)
    _ramp: list[int] = field(init=False, repr=False, compare=False)
    _before: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ramp, before = [], [0]
        if self.ramp_tokens > 0 and self.start < self.final:
            spread = self.final - self.start
            while True:
                tokens = before[-1] * self.tokens_per_micro_batch
                k = min(self.final, self.start + spread * tokens // self.ramp_tokens)
                if k >= self.final:
                    break
                ramp.append(k)
                before.append(before[-1] + k)
        object.__setattr__(self, "_ramp", ramp)
        object.__setattr__(self, "_before", before)

    @classmethod
    def of(cls, ramp: BatchRampConfig, accumulate: int, tokens_per_micro_batch: int):
        """The schedule of ``stage.batch_ramp`` for ``trainer.accumulate_grad_batches``."""
        check_batch_ramp(ramp, accumulate)
        if ramp.tokens == 0:
            return cls(final=accumulate, tokens_per_micro_batch=tokens_per_micro_batch)
        return cls(
            final=accumulate,
            tokens_per_micro_batch=tokens_per_micro_batch,
            start=ramp.start,
            ramp_tokens=ramp.tokens,
            lr_rule=ramp.lr,
        )

    @property
    def ramp_steps(self) -> int:
        """Optimizer steps before the accumulation reaches ``final``."""
        return len(self._ramp)

    def accumulation(self, step: int) -> int:
        """Micro-batches of optimizer step ``step`` (counted from 0)."""
        return self._ramp[step] if step < len(self._ramp) else self.final

    def micro_batches_before(self, step: int) -> int:
        """Micro-batches every rank trains on in the steps before ``step``."""
        ramp = len(self._ramp)
        if step <= ramp:
            return self._before[step]
        return self._before[ramp] + (step - ramp) * self.final

    def tokens_before(self, step: int) -> int:
        """Tokens all ranks train on in the steps before ``step``."""
        return self.micro_batches_before(step) * self.tokens_per_micro_batch

    def step_of(self, micro_batches: int) -> int:
        """The step that micro-batch number ``micro_batches`` (from 0) belongs to."""
        ramp_end = self._before[-1]
        if micro_batches < ramp_end:
            return bisect.bisect_right(self._before, micro_batches) - 1
        return len(self._ramp) + (micro_batches - ramp_end) // self.final

    def ends_a_step(self, micro_batches: int) -> bool:
        """Whether the first ``micro_batches`` micro-batches end an optimizer step."""
        return micro_batches > 0 and self.micro_batches_before(self.step_of(micro_batches)) == (
            micro_batches
        )

    def steps_for_tokens(self, tokens: int) -> int:
        """The fewest optimizer steps that train on at least ``tokens`` tokens (at least 1)."""
        ramp_tokens = self.tokens_before(len(self._ramp))
        if tokens <= ramp_tokens:
            micro = math.ceil(tokens / self.tokens_per_micro_batch)
            return max(1, bisect.bisect_left(self._before, micro))
        rest = math.ceil((tokens - ramp_tokens) / (self.final * self.tokens_per_micro_batch))
        return max(1, len(self._ramp) + rest)

    def lr_factor(self, step: int) -> float:
        """The learning rate's multiplier at ``step``: ``sqrt(k / final)`` under the
        square-root rule during the ramp, else 1."""
        if self.lr_rule != "sqrt":
            return 1.0
        return math.sqrt(self.accumulation(step) / self.final)
