"""Updates that never reach the weights: non-finite or spiking losses and gradient norms.

After every backward pass (in :meth:`CausalLMModule.configure_gradient_clipping`, where
the gradient norm is computed anyway) :class:`StepGuard` decides on the device, without
waiting for it, whether the update is bad: a non-finite loss or gradient norm, or (with
``guard.spikes``) a spike, more than ``guard.sigmas`` standard deviations above the mean
of the last ``guard.window`` steps (after ``guard.min_history`` of them; every finite
step joins the window, spikes too, so a lasting shift is learnt, as in OLMo-core's
skip-step optimizers; only upward jumps count). A bad update is skipped: torch's fused
AdamW reads the flag as its ``found_inf`` and leaves weights, moments and step count as
they were (no host synchronisation); any other optimizer has its gradients dropped after
one host read of the flag. Bad updates are counted.

What happens next is ``guard.policy``: ``skip`` goes on; ``stop`` saves and stops the
run, which ends non-zero with one line; ``rollback`` stops it and asks the caller
(:func:`recipes_lib.train.run`) to start again from the newest good checkpoint at or
before the bad step, with the sampler moved ``guard.rollback_skip_batches`` batches
further on (:mod:`.rollback`). The host learns of a bad step one step late, through a
pinned copy, so it does not wait for the device, except before a step that ends with a
step checkpoint: no checkpoint is written past a bad step the host has not seen.
``guard.max_skipped`` bad updates in a row, or more than ``guard.max_rollbacks``
rollbacks, end the run as diverged.

``guard.inject_step`` (a drill, and the tests): the batch the uninterrupted run would
train on at that step gets a NaN (``guard.inject=nan``) or a loss 10^4 times too
large (``spike``); keyed to the data, so a rollback that moves past it does not see
it again.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.weights import list_step_checkpoints
from recipes_lib.config.schema import GuardConfig
from recipes_lib.errors import ConfigError, RecipesError
from recipes_lib.parallel.strategy import get_strategy

GUARD_POLICIES = ("auto", "skip", "rollback", "stop", "off")
SPIKE_FACTOR = 1e4  # what guard.inject=spike multiplies the loss by


class TrainingStopped(RecipesError):
    """The guard stopped training: it diverged, or a bad step under ``guard.policy=stop``."""


@dataclass
class Rollback:
    """A rollback the guard asks for: go back to a checkpoint at or before ``bad_step``."""

    bad_step: int
    reason: str


@dataclass
class GuardEvent:
    """One thing the guard did, for the metrics and the stage manifest."""

    kind: str  # skip | rollback | stop
    step: int
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)


class StepGuard:
    """The device-side detector and the host-side policy of one run (see module docs).

    Args:
        config: the ``guard`` config.
        checkpoint_every: the step-checkpoint interval; the host waits for the flags before
            a step whose end saves one, so no checkpoint is written past an unseen bad step.
    """

    def __init__(self, config: GuardConfig, checkpoint_every: int = 0):
        self.config = config
        self.checkpoint_every = checkpoint_every
        self.enabled = config.policy != "off"
        self._history: Tensor | None = None  # (2, window): loss, grad norm of past steps
        self._seen: Tensor | None = None  # finite steps recorded, 0-d int64
        self._skipped: Tensor | None = None  # bad updates of this fit, 0-d int64
        self._pending: deque[tuple[Tensor, Any, int]] = deque()  # (pinned flags, event, step)
        self.consecutive_bad = 0  # read on the host, one step late
        self.rollback: Rollback | None = None  # set when the policy asks for one
        self.events: list[GuardEvent] = []
        self._loss_sum: Tensor | None = None  # this step's micro-batch losses
        self._losses = 0

    # ------------------------------------------------------------ the module's steps
    def add_loss(self, loss: Tensor) -> None:
        """One micro-batch's loss of the coming update."""
        if self.enabled:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._losses += 1

    def after_backward(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[Tensor],
        grad_norm: Tensor | None,
        strategy: Any,
        step: int,
    ) -> None:
        """Judge the coming update and make the optimizer skip a bad one.

        Args:
            optimizer: the optimizer about to step.
            params: its parameters.
            grad_norm: the total gradient norm, when clipping computed it.
            strategy: the Lightning strategy: the loss is averaged over ranks, so every
                rank judges the same numbers (the norm is global already).
            step: the index of the update (``trainer.global_step`` before it).
        """
        if grad_norm is None:
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(grad_norm, "full_tensor"):  # a sharded (DTensor) norm
            grad_norm = grad_norm.full_tensor()
        loss = self._loss_sum / max(self._losses, 1) if self._loss_sum is not None else grad_norm
        self._loss_sum, self._losses = None, 0
        loss = strategy.reduce(loss, reduce_op="mean")
        bad, non_finite = self.check(loss, grad_norm)
        skip_bad_update(optimizer, bad)
        self.publish(step, bad, non_finite)

    def act(self, trainer: Any, wait: bool = False) -> bool:
        """Apply the policy to what the host has learnt: a rollback stops the fit (the
        caller restarts it); ``stop`` saves the current weights (the bad update was
        skipped) before it ends the run.

        Returns:
            True when the fit must stop before the coming step (a rollback is asked for).

        Raises:
            TrainingStopped: see :meth:`poll`.
        """
        every = self.checkpoint_every
        saves = every > 0 and (trainer.global_step + 1) % every == 0
        try:
            self.poll(wait or saves)
        except TrainingStopped as stop:
            run_dir = RunDir(trainer.default_root_dir)
            if self.config.policy == "stop" and self.consecutive_bad < self.config.max_skipped:
                trainer.save_checkpoint(run_dir.step_checkpoint(trainer.global_step))
                raise
            # diverged: what is on disk stays as it is (every bad update was skipped)
            kept = list_step_checkpoints(run_dir.checkpoints)
            where = (
                f"the newest checkpoint, {kept[-1][1]} (step {kept[-1][0]}), is kept"
                if kept
                else "no checkpoint had been written"
            )
            raise TrainingStopped(f"{stop}; {where}") from None
        if self.rollback is not None:
            trainer.should_stop = True
        return self.rollback is not None

    # ---------------------------------------------------------------- device side
    def _state(self, device: torch.device) -> None:
        if self._history is None:
            window = self.config.window
            self._history = torch.zeros(2, window, dtype=torch.float32, device=device)
            self._seen = torch.zeros((), dtype=torch.int64, device=device)
            self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        elif self._history.device != device:  # restored from a checkpoint, on the CPU
            assert self._seen is not None and self._skipped is not None  # kept with it
            self._history = self._history.to(device)
            self._seen = self._seen.to(device)
            self._skipped = self._skipped.to(device)

    def check(self, loss: Tensor, grad_norm: Tensor) -> tuple[Tensor, Tensor]:
        """``(bad, non_finite)``: 0-d bool tensors for this step's update. Finite steps
        join the history the spike test compares with; nothing here waits for the device."""
        self._state(grad_norm.device)
        assert self._history is not None and self._seen is not None and self._skipped is not None
        values = torch.stack([loss.detach().float(), grad_norm.detach().float()])  # (2,)
        non_finite = ~torch.isfinite(values).all()
        window = self.config.window
        n = torch.clamp(self._seen, max=window)
        valid = torch.arange(window, device=values.device) < n  # (window,)
        count = n.clamp(min=1).float()
        mean = (self._history * valid).sum(1) / count  # (2,)
        var = (((self._history - mean[:, None]) * valid) ** 2).sum(1) / count
        threshold = mean + self.config.sigmas * var.sqrt()
        enough = self._seen >= self.config.min_history
        spike = enough & (values > threshold).any() & ~non_finite & self.config.spikes
        bad = non_finite | spike
        slot = (self._seen % window).reshape(1)
        kept = torch.where(non_finite, self._history.index_select(1, slot)[:, 0], values)
        self._history.index_copy_(1, slot, kept[:, None])
        self._seen += (~non_finite).long()
        self._skipped += bad.long()
        return bad, non_finite

    @property
    def skipped(self) -> Tensor | None:
        """Bad updates skipped in this fit (a device tensor; logging reads it)."""
        return self._skipped

    def publish(self, step: int, bad: Tensor, non_finite: Tensor) -> None:
        """Start copying this step's flags to the host; :meth:`poll` reads them later."""
        flags = torch.stack([bad, non_finite]).to(torch.uint8)
        if flags.device.type == "cuda":
            pinned = torch.empty(2, dtype=torch.uint8, pin_memory=True)
            pinned.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((pinned, event, step))
        else:
            self._pending.append((flags, None, step))

    # ------------------------------------------------------------------ host side
    def poll(self, wait: bool = False) -> None:
        """Act on the published steps' flags, in order, that the device has sent (all of
        them with ``wait``; the host never runs more than one step behind): count bad
        steps in a row and apply the policy.

        Raises:
            TrainingStopped: diverged (``guard.max_skipped`` bad steps in a row), or a bad
                step under ``guard.policy=stop``.
        """
        while self._pending:
            flags, event, step = self._pending[0]
            if event is not None and not (wait or len(self._pending) > 1 or event.query()):
                return
            if event is not None:
                event.synchronize()
            self._pending.popleft()
            self._judge(step, *(bool(v) for v in flags.tolist()))

    def _judge(self, step: int, bad: bool, non_finite: bool) -> None:
        if not bad:
            self.consecutive_bad = 0
            return
        self.consecutive_bad += 1
        reason = (
            "a non-finite loss or gradient norm"
            if non_finite
            else (
                f"a loss or gradient-norm spike (over {self.config.sigmas:g} standard deviations "
                f"above the last {self.config.window} steps)"
            )
        )
        self.events.append(GuardEvent("skip", step, reason))
        if self.consecutive_bad >= self.config.max_skipped:
            raise TrainingStopped(
                f"training diverged: {self.consecutive_bad} updates in a row were skipped for "
                f"{reason}, up to step {step} (guard.max_skipped={self.config.max_skipped}): "
                "lower optim.lr or check the data"
            )
        if self.config.policy == "stop":
            self.events.append(GuardEvent("stop", step, reason))
            raise TrainingStopped(f"step {step} had {reason} (guard.policy=stop)")
        if self.config.policy == "rollback" and self.rollback is None:
            self.rollback = Rollback(step, reason)

    # ------------------------------------------------------------ fault injection
    def inject(self, loss: Tensor, trainer: Any, batch_size: int, into_step: int) -> Tensor:
        """``loss`` made bad when its batch is the one the uninterrupted run trains on at
        ``guard.inject_step``: this rank's sample positions of that step's micro-batches
        in its stream (the data module's ``consumed_samples`` counts
        what a rollback moved past, so the drill's batch is passed over with the rest).
        ``into_step``: the micro-batch's index within its optimizer step."""
        step = self.config.inject_step
        if step is None:
            return loss
        datamodule: Any = getattr(trainer, "datamodule", None)
        if hasattr(datamodule, "micro_batches_before"):  # step sizes may vary (a ramp)
            before = datamodule.micro_batches_before
            consumed = datamodule.consumed_samples
        else:
            accumulate = trainer.accumulate_grad_batches
            before = lambda s: s * accumulate  # noqa: E731
            consumed = before(trainer.global_step) * batch_size
        first_sample = consumed + into_step * batch_size
        start, end = before(step) * batch_size, before(step + 1) * batch_size
        if not start <= first_sample < end:
            return loss
        if self.config.inject == "spike":
            return loss * SPIKE_FACTOR
        return loss + float("nan")

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        history = self._history.cpu() if self._history is not None else None
        seen = int(self._seen) if self._seen is not None else 0
        return {"history": history, "seen": seen, "consecutive_bad": self.consecutive_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history = state.get("history")
        if history is not None:
            self._history = history.float()
            self._seen = torch.tensor(int(state.get("seen", 0)))
            self._skipped = torch.zeros((), dtype=torch.int64)
        self.consecutive_bad = int(state.get("consecutive_bad", 0))


def skip_bad_update(optimizer: torch.optim.Optimizer, bad: Tensor) -> None:
    """Make ``optimizer``'s coming step leave the weights alone when ``bad`` is true.

    torch's fused Adam(W) reads ``found_inf`` itself (as for gradient scaling), so the
    decision stays on the device; any other optimizer skips parameters whose gradient is
    None, which needs one read of ``bad`` on the host.
    """
    if optimizer.defaults.get("fused"):
        # 0-d, as the fused kernels expect; torch reads the attribute without declaring it
        optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
        return
    if bool(bad):
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None


def resolve_policy(config: GuardConfig, strategy: str) -> GuardConfig:
    """``config`` with ``guard.policy=auto`` made: ``skip``, or ``off`` under a strategy
    that keeps the optimizer step to itself (DeepSpeed)."""
    if config.policy != "auto":
        return config
    return dataclasses.replace(
        config, policy="skip" if not get_strategy(strategy).steps_in_engine else "off"
    )


def check_guard_config(config: GuardConfig) -> None:
    """Refuse guard settings that cannot work, naming the key."""
    if config.policy not in GUARD_POLICIES:
        policies = ", ".join(GUARD_POLICIES)
        raise ConfigError(f"guard.policy={config.policy!r} is not one of: {policies}")
    for key, value, least in (
        ("guard.window", config.window, 2),
        ("guard.min_history", config.min_history, 2),
        ("guard.max_skipped", config.max_skipped, 1),
        ("guard.max_rollbacks", config.max_rollbacks, 0),
        ("guard.rollback_skip_batches", config.rollback_skip_batches, 0),
    ):
        if value < least:
            raise ConfigError(f"{key}={value} must be at least {least}")
    if config.min_history > config.window:
        raise ConfigError(
            f"guard.min_history={config.min_history} cannot exceed guard.window={config.window}"
        )
    if not config.sigmas > 0:
        raise ConfigError(f"guard.sigmas={config.sigmas} must be positive")
    if config.inject not in ("nan", "spike"):
        raise ConfigError(f"guard.inject={config.inject!r} is not one of: nan, spike")
