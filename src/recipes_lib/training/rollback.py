"""Going back from a bad step: the plan :func:`recipes_lib.train.run` follows when the
guard (:mod:`.guard`, ``guard.policy=rollback``) asks for a rollback, and the lower
learning rate a run may take for a while after one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.sharded import SHARDED_METADATA_NAME
from recipes_lib.checkpoint.weights import list_step_checkpoints, read_checkpoint
from recipes_lib.config.schema import GuardConfig
from recipes_lib.files import global_rank, move_aside
from recipes_lib.training.guard import Rollback, TrainingStopped


def scale_lr_in_window(scheduler: Any, start: int, end: int, factor: float) -> None:
    """Multiply a ``LambdaLR`` schedule by ``factor`` for steps ``start <= step < end``:
    the lower learning rate a run takes for a while after a rollback.

    Call it once the scheduler and optimizer are restored from the checkpoint being
    resumed: the learning rate of the next step is set here too (the restored one was
    computed without the window, and a scheduler only recomputes it after a step), and
    so is the rate ``get_last_lr()`` reports, through the scheduler's own state.
    """
    scheduler.lr_lambdas = [
        (lambda step, f=f: f(step) * (factor if start <= step < end else 1.0))
        for f in scheduler.lr_lambdas
    ]
    step = scheduler.last_epoch
    groups = scheduler.optimizer.param_groups
    for group, base, f in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * f(step)
    state = scheduler.state_dict()
    state["_last_lr"] = [group["lr"] for group in groups]  # torch's key for get_last_lr()
    scheduler.load_state_dict(state)


def _position_at(checkpoint: Any) -> int:
    """This rank's stream position a Lightning checkpoint's data module recorded (0 if it
    recorded none)."""
    for value in checkpoint.values() if isinstance(checkpoint, dict) else ():
        if isinstance(value, dict) and "consumed_samples" in value:
            return int(value["consumed_samples"])
    return 0


def plan_rollback(
    config: GuardConfig, run_dir: RunDir, request: Rollback, done: int, samples_per_step: int
) -> tuple[Path, int, tuple[int, int, float] | None, dict[str, Any]]:
    """Where a run goes back to after a bad step, and what it moves past.

    The newest step checkpoint that holds no update from the bad step on is the one to
    resume: one saved at or before ``request.bad_step``, or the one saved right after it
    (the bad update was skipped, so its weights are those before it). Newer ones are
    moved aside (``.rolled-back``, never deleted) so the restarted fit writes its own.
    The sampler moves ``guard.rollback_skip_batches`` steps' worth of samples past the
    resume point.

    Args:
        config: the ``guard`` config.
        run_dir: the run's folder.
        request: the rollback the guard asked for.
        done: rollbacks this run made already.
        samples_per_step: samples one rank reads per optimizer step.

    Returns:
        The checkpoint to resume, the samples to skip per rank, the learning-rate window
        (``(start, end, factor)`` or None) and the record of the rollback.

    Raises:
        TrainingStopped: ``guard.max_rollbacks`` are used up, or no checkpoint predates
            the bad step.
    """
    saved = list_step_checkpoints(run_dir.checkpoints)
    if done >= config.max_rollbacks:
        kept = f"; the newest checkpoint, {saved[-1][1]} (step {saved[-1][0]}), is kept"
        raise TrainingStopped(
            f"step {request.bad_step} had {request.reason} after {done} rollback(s) "
            f"(guard.max_rollbacks={config.max_rollbacks}): training diverged"
            + (kept if saved else "")
        )
    earlier = [(step, path) for step, path in saved if step <= request.bad_step + 1]
    if not earlier:
        raise TrainingStopped(
            f"step {request.bad_step} had {request.reason}, and no checkpoint at or before it "
            f"is in {run_dir.checkpoints} to roll back to (guard.policy=rollback)"
        )
    step, target = earlier[-1]
    if global_rank() == 0:
        newer = [path for s, path in saved if s > step]
        last = run_dir.last_checkpoint
        if (last.exists() or last.is_symlink()) and last.resolve() != target.resolve():
            newer.append(last)  # the restarted fit writes its own
        for path in newer:
            move_aside(path, "rolled-back")
    # a sharded folder keeps the loops' and data module's state in its metadata file
    state_file = target if target.is_file() else target / SHARDED_METADATA_NAME
    position = _position_at(read_checkpoint(state_file))
    skip = config.rollback_skip_batches * samples_per_step
    window = None
    if config.rollback_lr_steps > 0 and config.rollback_lr_factor != 1.0:
        window = (step, step + config.rollback_lr_steps, config.rollback_lr_factor)
    entry = {
        "bad_step": request.bad_step,
        "reason": request.reason,
        "resumed_from_step": step,
        "checkpoint": target.name,
        "skipped_batches": config.rollback_skip_batches,
        # this rank's positions in its sample stream that are moved past, [start, end)
        "skipped_positions": [position, position + skip],
    }
    return target, skip, window, entry
