import gc

import lightning as L
import pytest
from callback_helpers import random_batches, tiny_causal_lm
from tiny import quiet_trainer, step_loader

from recipes_lib.callbacks import GarbageCollection
from recipes_lib.config.schema import SchedulerConfig

STEPS = 6


class CollectorProbe(L.Callback):
    """Records whether the automatic collector is on at every training batch."""

    def __init__(self, fail_at: int | None = None):
        self.enabled: list[bool] = []
        self.fail_at = fail_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.enabled.append(gc.isenabled())
        if batch_idx == self.fail_at:
            raise RuntimeError("stop here")


def run(callbacks, accumulate: int = 1) -> None:
    module = tiny_causal_lm(STEPS, SchedulerConfig(name="constant"))
    data = random_batches(STEPS * accumulate)
    trainer = quiet_trainer(STEPS, callbacks)
    trainer.fit(module, step_loader(data, accumulate))  # a batch: one step's micro-batches


@pytest.mark.parametrize("accumulate", [1, 2])
def test_collects_at_fixed_optimizer_steps_with_the_automatic_collector_off(accumulate):
    assert gc.isenabled()
    collector, probe = GarbageCollection(every_n_steps=2), CollectorProbe()
    run([collector, probe], accumulate=accumulate)
    assert probe.enabled == [False] * STEPS
    assert collector.collected_at == [2, 4, 6]  # once per optimizer step, not per micro-batch
    assert gc.isenabled()


def test_turns_the_collector_back_on_when_the_fit_fails():
    probe = CollectorProbe(fail_at=3)
    with pytest.raises(RuntimeError, match="stop here"):
        run([GarbageCollection(every_n_steps=2), probe])
    assert probe.enabled == [False] * 4
    assert gc.isenabled()


def test_leaves_a_collector_that_was_off_off():
    gc.disable()
    try:
        run([GarbageCollection(every_n_steps=3)])
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"generation": 3}])
def test_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GarbageCollection(**kwargs)
