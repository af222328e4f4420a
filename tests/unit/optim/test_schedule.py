import math

import pytest
import torch

from recipes_lib.config.schema import SchedulerConfig
from recipes_lib.errors import ConfigError
from recipes_lib.optim import build_lr_lambda, build_scheduler


def curve(config: SchedulerConfig, total_steps: int, tokens_per_step: int = 1) -> list[float]:
    fn = build_lr_lambda(config, total_steps, tokens_per_step)
    return [fn(step) for step in range(total_steps + 1)]


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_warmup_rises_linearly_to_one(name):
    lr = curve(SchedulerConfig(name=name, warmup=4, decay=2), total_steps=20)
    assert lr[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a < b for a, b in zip(lr[:4], lr[1:5], strict=True))


def test_no_warmup_starts_at_full_rate():
    assert build_lr_lambda(SchedulerConfig(name="cosine", warmup=0), 10, 1)(0) == 1.0


def test_cosine_midpoint_and_floor():
    config = SchedulerConfig(name="cosine", warmup=10, min_lr_ratio=0.1)
    fn = build_lr_lambda(config, total_steps=110, tokens_per_step=1)
    assert fn(10) == pytest.approx(1.0)
    assert fn(60) == pytest.approx(0.55)  # halfway: floor + (1 - floor) / 2
    assert fn(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert fn(110) == pytest.approx(0.1)
    assert fn(500) == pytest.approx(0.1)  # past the end: stays at the floor


def test_linear_decay_is_a_straight_line():
    fn = build_lr_lambda(SchedulerConfig(name="linear", min_lr_ratio=0.0), 100, 1)
    assert [fn(s) for s in (0, 25, 50, 100)] == pytest.approx([1.0, 0.75, 0.5, 0.0])


def test_constant_stays_flat_after_warmup():
    lr = curve(SchedulerConfig(name="constant", warmup=3, min_lr_ratio=0.1), 50)
    assert lr[3:] == [1.0] * 48


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_stable_then_decays_over_last_steps(shape):
    config = SchedulerConfig(name="wsd", warmup=10, decay=20, decay_shape=shape, min_lr_ratio=0.0)
    fn = build_lr_lambda(config, total_steps=100, tokens_per_step=1)
    assert [fn(s) for s in range(10, 81)] == [1.0] * 71  # stable through step 80
    assert fn(81) < 1.0
    expected_mid = {"linear": 0.5, "cosine": 0.5, "sqrt": 1 - math.sqrt(0.5)}[shape]
    assert fn(90) == pytest.approx(expected_mid)
    assert fn(100) == pytest.approx(0.0)
    decay = [fn(s) for s in range(80, 101)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))


def test_wsd_default_decay_is_a_fifth_of_the_run():
    fn = build_lr_lambda(SchedulerConfig(name="wsd", min_lr_ratio=0.0), 50, 1)
    assert fn(40) == 1.0  # decay covers steps 40..50
    assert fn(41) < 1.0
    assert fn(45) == pytest.approx(0.5)


def test_token_unit_converts_with_ceil():
    config = SchedulerConfig(name="wsd", unit="tokens", warmup=1000, decay=2500, min_lr_ratio=0.0)
    fn = build_lr_lambda(config, total_steps=20, tokens_per_step=512)
    # warmup ceil(1000 / 512) = 2 steps, decay ceil(2500 / 512) = 5 steps -> decay starts at 15
    assert fn(0) == pytest.approx(1 / 3)
    assert fn(2) == 1.0
    assert fn(15) == 1.0
    assert fn(16) == pytest.approx(0.8)
    assert fn(20) == 0.0


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"name": "exponential"}, "scheduler.name='exponential' is not one of cosine, linear"),
        ({"unit": "epochs"}, "scheduler.unit='epochs' is not one of steps, tokens"),
        ({"name": "wsd", "decay_shape": "step"}, "scheduler.decay_shape='step'"),
        ({"warmup": -1}, "scheduler.warmup=-1"),
        ({"min_lr_ratio": 1.5}, "scheduler.min_lr_ratio=1.5"),
    ],
)
def test_bad_values_name_the_key_and_choices(overrides, fragment):
    with pytest.raises(ConfigError) as excinfo:
        build_lr_lambda(SchedulerConfig(**overrides), total_steps=100, tokens_per_step=1)
    assert fragment in str(excinfo.value)


def test_warmup_plus_decay_longer_than_run_is_rejected():
    with pytest.raises(ConfigError, match=r"scheduler.warmup \(60 steps\) plus scheduler.decay"):
        build_lr_lambda(SchedulerConfig(name="wsd", warmup=60, decay=50), 100, 1)
    with pytest.raises(ConfigError, match="exceed the run's 10 steps"):
        build_lr_lambda(SchedulerConfig(name="cosine", unit="tokens", warmup=4096), 10, 256)


def test_scheduler_drives_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scheduler = build_scheduler(optimizer, SchedulerConfig(name="linear", warmup=1), 5, 1)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.25, 0.5, 0.3875, 0.275, 0.1625, 0.05])
