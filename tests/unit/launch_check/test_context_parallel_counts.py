"""Under ``strategy.context_parallel=N`` the ranks of a group share their rows: a step's
tokens, rows and FLOPs count ``world / N`` data-parallel replicas, in the run's
token arithmetic, the launch check and the throughput callback alike."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from recipes_lib.assembly import batch_schedule, tokens_per_step, total_steps
from recipes_lib.callbacks import ThroughputMonitor
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.launch_check.budget import step_flops, token_budget
from recipes_lib.launch_check.live import training_samples

WORLD = 4


@functools.cache
def cfg_of(degree: int, *extra: str):
    overrides = [
        "recipe=pretrain/tiny",
        "strategy=ddp",
        f"trainer.devices={WORLD}",
        "data.seq_len=64",
        "kernels.attention=flex",
        f"strategy.context_parallel={degree}",
        *extra,
    ]
    return to_run_config(compose_config(overrides))


@pytest.mark.parametrize("degree", [2, 4])
def test_a_step_counts_the_replicas_not_the_ranks(degree):
    whole, split = cfg_of(1), cfg_of(degree)
    replicas = WORLD // degree
    assert tokens_per_step(split, WORLD) * WORLD == tokens_per_step(whole, WORLD) * replicas
    assert token_budget(split, WORLD).tokens_per_step == tokens_per_step(split, WORLD)
    assert step_flops(split, WORLD) * WORLD == pytest.approx(step_flops(whole, WORLD) * replicas)
    samples = [training_samples(c, 10, WORLD) for c in (whole, split)]
    assert samples[1] * WORLD == samples[0] * replicas


def test_a_token_duration_takes_as_many_more_steps():
    tokens = "stage.max_tokens=1000000"
    whole, split = cfg_of(1, tokens), cfg_of(2, tokens)
    steps = [total_steps(c, batch_schedule(c, WORLD)) for c in (whole, split)]
    assert steps[1] == pytest.approx(2 * steps[0], abs=1)


def test_the_throughput_fallback_counts_each_row_once_per_group():
    monitor = ThroughputMonitor(window=100)
    strategy = SimpleNamespace(context_parallel=2)
    trainer = SimpleNamespace(
        world_size=WORLD, strategy=strategy, global_step=0, log_every_n_steps=0
    )
    batch = {"input_ids": torch.zeros(3, 64, dtype=torch.long)}
    monitor._batch_step = 1
    monitor.on_train_batch_end(trainer, SimpleNamespace(), None, batch, 0)  # type: ignore[arg-type]
    assert monitor._tokens == 3 * 64 * 2  # two replicas of a row each
