"""A batch ramp from the command line's config: each optimizer step trains on the
schedule's micro-batches, the learning rate follows the square-root rule, validation falls at step
ends, and a run stopped mid-ramp resumes to the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from integration_helpers import tiny_overrides
from lightning.pytorch.callbacks import Callback
from tiny import StopAtStep

from recipes_lib.config import compose_config
from recipes_lib.config.schema import BatchRampConfig
from recipes_lib.errors import ConfigError
from recipes_lib.optim.batch_ramp import BatchSchedule
from recipes_lib.train import run

pytestmark = pytest.mark.slow

MICRO_TOKENS = 64 * 4  # data.seq_len x data.batch_size on one process
RAMP = [
    "trainer.accumulate_grad_batches=4",
    "stage.batch_ramp.start=1",
    f"stage.batch_ramp.tokens={12 * MICRO_TOKENS}",
    "stage.batch_ramp.lr=sqrt",
    "scheduler.name=constant",
    "scheduler.warmup=0",
    "trainer.max_steps=9",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "run.checkpoint_every_n_steps=3",
]
SCHEDULE = BatchSchedule.of(
    BatchRampConfig(start=1, tokens=12 * MICRO_TOKENS, lr="sqrt"), 4, MICRO_TOKENS
)


class RecordSteps(Callback):
    """Per optimizer step: the micro-batches the loader gave it, the backward passes run
    before the optimizer stepped, whether the first of them started from no gradients,
    and the learning rate."""

    def __init__(self):
        self.validated = []
        self.micro_batches: dict[int, int] = {}
        self.backwards: dict[int, int] = {}
        self.stepped_after: dict[int, int] = {}
        self.started_clean: dict[int, bool] = {}
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        self.micro_batches[step] = len(batch)  # one step's micro-batches
        self.backwards[step] = 0
        self.lrs[step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_before_backward(self, trainer, pl_module, loss):
        step = trainer.global_step
        if self.backwards[step] == 0:
            grads = [p.grad for p in pl_module.parameters()]
            self.started_clean[step] = all(g is None or not g.any() for g in grads)
        self.backwards[step] += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        self.stepped_after[step] = self.backwards[step]

    def on_validation_start(self, trainer, pl_module):
        self.validated.append(trainer.global_step)


def test_steps_follow_the_ramp_and_the_learning_rate_its_square_root(tmp_path, shared_cache):
    record = RecordSteps()
    result = run(compose_config(tiny_overrides(tmp_path, shared_cache, *RAMP)), [record])
    steps = result.global_step
    assert steps == 9
    sizes = [SCHEDULE.accumulation(s) for s in range(steps)]
    assert sizes[0] == 1 and sizes[-1] == 4 and len(set(sizes)) >= 3  # it ramps
    before = [SCHEDULE.micro_batches_before(s) for s in range(steps + 1)]
    by_step = dict(enumerate(sizes))
    assert record.micro_batches == by_step  # each step gets the schedule's micro-batches
    assert record.stepped_after == by_step  # and steps once, after all of them
    assert all(record.started_clean.values()) and len(record.started_clean) == steps
    lr = compose_config(tiny_overrides(tmp_path, shared_cache)).optim.lr
    for step, k in enumerate(sizes):
        assert record.lrs[step] == pytest.approx(lr * math.sqrt(k / 4), rel=1e-6)
    assert record.validated == [3, 6, 9]
    assert result.tokens_seen == SCHEDULE.tokens_before(steps)
    state = torch.load(result.last_checkpoint, map_location="cpu", weights_only=False)
    position = next(v for v in state.values() if isinstance(v, dict) and "consumed_samples" in v)
    assert position["consumed_samples"] == before[-1] * 4


def test_a_run_stopped_mid_ramp_resumes_to_the_same_weights(tmp_path, shared_cache):
    straight = run(compose_config(tiny_overrides(tmp_path / "straight", shared_cache, *RAMP)))
    split = tiny_overrides(tmp_path / "split", shared_cache, *RAMP)
    first = run(compose_config(split), [StopAtStep(3)])
    assert first.global_step == 3 and SCHEDULE.accumulation(3) < 4  # stopped mid-ramp
    resumed = run(compose_config(split))  # a rerun of the same command resumes
    assert resumed.global_step == straight.global_step == 9
    assert resumed.tokens_seen == straight.tokens_seen
    a = torch.load(straight.last_checkpoint, map_location="cpu", weights_only=False)
    b = torch.load(resumed.last_checkpoint, map_location="cpu", weights_only=False)
    for name, tensor in a["state_dict"].items():
        assert torch.equal(b["state_dict"][name], tensor), name


def test_a_ramp_past_the_full_batch_is_refused_before_the_run(tmp_path, shared_cache):
    overrides = tiny_overrides(tmp_path, shared_cache, *RAMP, "stage.batch_ramp.start=5")
    with pytest.raises(ConfigError, match="stage.batch_ramp.start=5"):
        run(compose_config(overrides))
    assert not (tmp_path / "run").exists()
