"""The training guard on its own: what it calls a bad update, and how a bad update is
kept from the weights."""

from __future__ import annotations

import math

import pytest
import torch

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.schema import GuardConfig
from recipes_lib.errors import ConfigError
from recipes_lib.preflight import check_guard
from recipes_lib.training.guard import (
    Rollback,
    StepGuard,
    TrainingStopped,
    check_guard_config,
    resolve_policy,
    skip_bad_update,
)
from recipes_lib.training.rollback import plan_rollback, scale_lr_in_window


def _guard(**changes) -> StepGuard:
    return StepGuard(GuardConfig(**{"window": 8, "min_history": 4, "spikes": True, **changes}))


def _judge(guard: StepGuard, loss: float, norm: float) -> bool:
    bad, _ = guard.check(torch.tensor(loss), torch.tensor(norm))
    return bool(bad)


def test_non_finite_values_are_bad_from_the_first_step():
    guard = _guard()
    assert _judge(guard, math.nan, 1.0)
    assert _judge(guard, 1.0, math.inf)
    assert not _judge(guard, 2.0, 1.0)
    assert int(guard.skipped) == 2


def test_a_spike_is_an_upward_jump_and_the_window_learns_a_lasting_one():
    guard = _guard(sigmas=6.0)
    for step in range(6):  # a falling loss, noisy norms: nothing here is a spike
        assert not _judge(guard, 3.0 - 0.1 * step, 1.0 + 0.05 * (step % 2))
    assert _judge(guard, 3.0, 50.0)  # the gradient norm jumps
    assert not _judge(guard, 0.1, 0.01)  # a drop is no spike
    assert not _judge(guard, 2.5, 1.0)  # an ordinary step is still ordinary
    # the jump joined the window: the same norm again is no longer 6 sigmas out
    assert not _judge(guard, 2.5, 50.0)
    assert int(guard.skipped) == 1


def test_spikes_are_judged_only_when_asked_for():
    guard = _guard(spikes=False)
    for _ in range(6):
        assert not _judge(guard, 3.0, 1.0)
    assert not _judge(guard, 3.0, 1e6)
    assert _judge(guard, 3.0, math.nan)


def test_before_min_history_only_non_finite_values_count():
    guard = _guard(min_history=4)
    assert not _judge(guard, 1.0, 1.0)
    assert not _judge(guard, 1.0, 1000.0)  # a jump, but too little history to call it one


def _optimizer(fused: bool) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 0.5)
    return param, torch.optim.AdamW([param], lr=0.1, fused=fused, foreach=not fused or None)


@pytest.mark.parametrize("fused", [True, False])
def test_a_bad_update_leaves_weights_and_moments_alone(fused):
    param, optimizer = _optimizer(fused)
    skip_bad_update(optimizer, torch.tensor(True))
    optimizer.step()
    assert torch.equal(param.detach(), torch.ones(4))
    state = optimizer.state.get(param, {})
    assert not state or float(state["step"]) == 0.0
    param.grad = torch.full((4,), 0.5)
    skip_bad_update(optimizer, torch.tensor(False))
    optimizer.step()
    assert not torch.equal(param.detach(), torch.ones(4))


def test_too_many_bad_steps_in_a_row_stop_the_run():
    guard = _guard(max_skipped=3)
    for step in range(3):
        bad, non_finite = guard.check(torch.tensor(math.nan), torch.tensor(1.0))
        guard.publish(step, bad, non_finite)
        if step < 2:
            guard.poll()
    with pytest.raises(TrainingStopped, match="3 updates in a row were skipped"):
        guard.poll()


def test_the_stop_policy_stops_at_the_first_bad_step_and_rollback_asks_for_one():
    stop = _guard(policy="stop")
    bad, non_finite = stop.check(torch.tensor(math.nan), torch.tensor(1.0))
    stop.publish(7, bad, non_finite)
    with pytest.raises(TrainingStopped, match=r"step 7 had a non-finite loss.*guard.policy=stop"):
        stop.poll()
    rollback = _guard(policy="rollback")
    bad, non_finite = rollback.check(torch.tensor(math.nan), torch.tensor(1.0))
    rollback.publish(9, bad, non_finite)
    rollback.poll()
    assert rollback.rollback is not None and rollback.rollback.bad_step == 9


def test_the_learning_rate_window_after_a_rollback():
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scale_lr_in_window(scheduler, 2, 4, 0.1)
    assert [scheduler.lr_lambdas[0](s) for s in range(6)] == [1.0, 1.0, 0.1, 0.1, 1.0, 1.0]


def test_the_window_holds_from_the_first_step_of_a_restored_run():
    # a rollback resumes a checkpoint saved at step 2 whose optimizer holds the full rate
    def fresh():
        param = torch.nn.Parameter(torch.ones(1))
        optimizer = torch.optim.SGD([param], lr=1.0)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))

    optimizer, scheduler = fresh()
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict(), scheduler.state_dict()
    optimizer, scheduler = fresh()
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 / 3)  # restored, unscaled
    scale_lr_in_window(scheduler, 2, 4, 0.1)
    assert scheduler.get_last_lr() == [pytest.approx(0.1 / 3)]  # what a run reports, too
    rates = []
    for _ in range(3):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.1 / 3, 0.1 / 4, 1 / 5])


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"policy": "retry"}, "guard.policy"),
        ({"window": 1}, "guard.window"),
        ({"min_history": 200}, "guard.min_history"),
        ({"sigmas": 0.0}, "guard.sigmas"),
        ({"inject": "zero"}, "guard.inject"),
    ],
)
def test_bad_settings_name_the_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        check_guard_config(GuardConfig(**changes))


def test_flags_published_before_a_poll_are_all_judged_in_order():
    guard = StepGuard(GuardConfig(policy="skip", max_skipped=2))
    bad, good = torch.tensor(True), torch.tensor(False)
    guard.publish(3, bad, good)
    guard.publish(4, bad, good)
    with pytest.raises(TrainingStopped, match="2 updates in a row.*up to step 4"):
        guard.poll()
    assert [event.step for event in guard.events] == [3, 4]


def test_auto_skips_where_updates_can_be_judged_and_deepspeed_must_say_off():
    assert resolve_policy(GuardConfig(), "fsdp").policy == "skip"
    assert resolve_policy(GuardConfig(), "deepspeed_zero3").policy == "off"
    assert resolve_policy(GuardConfig(policy="stop"), "ddp").policy == "stop"
    recipe = ["recipe=pretrain/tiny", "strategy=deepspeed_zero2"]
    check_guard(to_run_config(compose_config(recipe)))  # auto: no refusal
    cfg = to_run_config(compose_config([*recipe, "guard.policy=rollback"]))
    with pytest.raises(ConfigError, match="guard.policy=rollback with strategy=deepspeed_zero2"):
        check_guard(cfg)


def _saved_run(root) -> RunDir:
    run_dir = RunDir(root)
    run_dir.checkpoints.mkdir(parents=True)
    for step in (4, 8, 12):
        state = {"global_step": step, "PretrainDataModule": {"consumed_samples": 4 * step}}
        torch.save(state, run_dir.step_checkpoint(step))
    return run_dir


@pytest.mark.parametrize(("bad_step", "resumed"), [(10, 8), (11, 12), (12, 12)])
def test_a_rollback_resumes_the_newest_checkpoint_without_the_bad_update(
    tmp_path, bad_step, resumed
):
    # step N's checkpoint holds updates 0..N-1; update N-1 was skipped if it was the bad one
    run_dir = _saved_run(tmp_path)
    config = GuardConfig(policy="rollback", rollback_skip_batches=3)
    target, skip, window, entry = plan_rollback(config, run_dir, Rollback(bad_step, "x"), 0, 4)
    assert target == run_dir.step_checkpoint(resumed) and skip == 12 and window is None
    assert entry["skipped_positions"] == [4 * resumed, 4 * resumed + 12]
    newer = sorted(p.name.split(".")[0] for p in run_dir.checkpoints.glob("*.rolled-back-*"))
    assert newer == (["step000012"] if resumed == 8 else [])


def test_a_rollback_with_nothing_to_go_back_to_or_none_left_stops(tmp_path):
    run_dir = _saved_run(tmp_path)
    config = GuardConfig(policy="rollback", max_rollbacks=1)
    with pytest.raises(TrainingStopped, match="no checkpoint at or before it"):
        plan_rollback(config, run_dir, Rollback(2, "x"), 0, 4)
    with pytest.raises(TrainingStopped, match=r"after 1 rollback\(s\).*diverged"):
        plan_rollback(config, run_dir, Rollback(10, "x"), 1, 4)
