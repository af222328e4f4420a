"""The batch schedule: micro-batches per step, linear in tokens from the start to the full
accumulation, and every count that follows from it."""

from __future__ import annotations

import math

import pytest

from recipes_lib.config.schema import BatchRampConfig
from recipes_lib.errors import ConfigError
from recipes_lib.optim.batch_ramp import BatchSchedule, check_batch_ramp

MICRO = 256  # tokens of one micro-batch over every rank


def ramp(start=1, tokens=20 * MICRO, lr="constant", final=8):
    return BatchSchedule.of(BatchRampConfig(start=start, tokens=tokens, lr=lr), final, MICRO)


def test_without_a_ramp_every_step_is_the_full_accumulation():
    schedule = BatchSchedule.of(BatchRampConfig(), 4, MICRO)
    assert schedule.ramp_steps == 0
    assert [schedule.accumulation(s) for s in range(5)] == [4] * 5
    assert schedule.micro_batches_before(7) == 28
    assert schedule.steps_for_tokens(4 * MICRO * 10) == 10
    assert schedule.steps_for_tokens(4 * MICRO * 10 + 1) == 11
    assert schedule.lr_factor(0) == 1.0


def test_the_accumulation_grows_linearly_in_tokens_to_the_full_batch():
    schedule = ramp(start=2, tokens=40 * MICRO, final=8)
    sizes = [schedule.accumulation(s) for s in range(schedule.ramp_steps + 3)]
    assert sizes[0] == 2 and sizes[-1] == 8
    assert sizes == sorted(sizes) and set(range(2, 9)) <= set(sizes)
    for step, k in enumerate(sizes):
        tokens = schedule.tokens_before(step)
        assert tokens == sum(sizes[:step]) * MICRO
        assert k == min(8, 2 + 6 * tokens // (40 * MICRO))
    assert schedule.tokens_before(schedule.ramp_steps) >= 40 * MICRO * 5 / 6


def test_step_edges_and_token_durations_agree_with_the_sizes():
    schedule = ramp()
    edges = {schedule.micro_batches_before(s) for s in range(1, 41)}
    for micro in range(schedule.micro_batches_before(40)):
        step = schedule.step_of(micro)
        assert (
            schedule.micro_batches_before(step) <= micro < schedule.micro_batches_before(step + 1)
        )
        assert schedule.ends_a_step(micro + 1) == (micro + 1 in edges)
    assert not schedule.ends_a_step(0)
    for tokens in (1, MICRO, 7 * MICRO + 3, 100 * MICRO, 1000 * MICRO):
        steps = schedule.steps_for_tokens(tokens)
        assert schedule.tokens_before(steps) >= tokens > schedule.tokens_before(steps - 1)


def test_the_square_root_rule_scales_the_learning_rate_during_the_ramp():
    schedule = ramp(start=2, lr="sqrt", final=8)
    assert schedule.lr_factor(0) == pytest.approx(math.sqrt(2 / 8))
    assert schedule.lr_factor(schedule.ramp_steps) == 1.0
    assert ramp(start=2, final=8).lr_factor(0) == 1.0


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (BatchRampConfig(tokens=-1), "stage.batch_ramp.tokens=-1"),
        (BatchRampConfig(tokens=10, start=0), "stage.batch_ramp.start=0"),
        (BatchRampConfig(tokens=10, start=9), "stage.batch_ramp.start=9"),
        (BatchRampConfig(tokens=10, lr="cube"), "stage.batch_ramp.lr='cube'"),
    ],
)
def test_a_ramp_that_cannot_run_is_refused_naming_its_key(config, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        check_batch_ramp(config, 8)
