"""A run stopped mid-way and resumed with run.ckpt_path=last matches an uninterrupted run."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from integration_helpers import tiny_overrides
from lightning.pytorch.callbacks import Callback
from tiny import StopAtStep

from recipes_lib.config import compose_config
from recipes_lib.train import run


def step_input_ids(batch) -> torch.Tensor:
    """The input rows of one optimizer step's micro-batches, in order."""
    return torch.cat([micro["input_ids"] for micro in batch])


class RecordFirstStep(Callback):
    """Records the LR, step, tokens and first batch that a (resumed) fit starts with."""

    def __init__(self):
        self.seen: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.seen is None:
            self.seen = {
                "step": trainer.global_step,
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "tokens_seen": pl_module.tokens_seen,
                "input_ids": step_input_ids(batch).clone(),
            }


class RecordBatches(Callback):
    def __init__(self):
        self.batches: dict[int, torch.Tensor] = {}
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches[trainer.global_step] = step_input_ids(batch).clone()
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def _weights(ckpt_path):
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    return state["state_dict"], state


def test_resumed_run_matches_uninterrupted(tmp_path, shared_cache):
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight_dir.mkdir()
    split_dir.mkdir()
    record = RecordBatches()
    straight = run(compose_config(tiny_overrides(straight_dir, shared_cache)), callbacks=[record])
    assert straight.global_step == 16

    first = run(compose_config(tiny_overrides(split_dir, shared_cache)), callbacks=[StopAtStep(8)])
    assert first.global_step == 8
    start = RecordFirstStep()
    resumed = run(
        compose_config(tiny_overrides(split_dir, shared_cache, "run.ckpt_path=last")),
        callbacks=[start],
    )

    # continues from the saved step, learning rate, token count and sampler position
    assert start.seen["step"] == 8
    assert start.seen["lr"] == record.lrs[8]
    assert start.seen["tokens_seen"] == 8 * 4 * 64
    assert torch.equal(start.seen["input_ids"], record.batches[8])
    assert resumed.global_step == 16
    assert resumed.tokens_seen == straight.tokens_seen == 16 * 4 * 64

    w_straight, ck_straight = _weights(straight.last_checkpoint)
    w_resumed, ck_resumed = _weights(resumed.last_checkpoint)
    for name, tensor in w_straight.items():
        torch.testing.assert_close(w_resumed[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert (
        ck_resumed["lr_schedulers"][0]["last_epoch"]
        == ck_straight["lr_schedulers"][0]["last_epoch"]
    )


OPTIMIZERS = {
    "muon": ["optim=muon", "+optim.args.momentum=0.9"],
    "adafactor": ["optim=adafactor", "optim.lr=0.03"],
    "sgd": ["optim.name=SGD", "optim.lr=0.3", "+optim.args.momentum=0.9"],
}


HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
OPTIMIZERS["adamw_8bit"] = ["optim=adamw_8bit"]


@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name == "adamw_8bit" and not HAS_BNB, reason="needs bitsandbytes (qlora extra)"
            ),
        )
        for name in OPTIMIZERS
    ],
)
def test_each_optimizer_trains_and_resumes_bitwise(tmp_path, shared_cache, optimizer):
    chosen = OPTIMIZERS[optimizer]
    straight = run(compose_config(tiny_overrides(tmp_path / "straight", shared_cache, *chosen)))
    assert straight.metrics["val/loss"] < 6.0  # ln(512) = 6.24 at the start
    split = tmp_path / "split"
    run(compose_config(tiny_overrides(split, shared_cache, *chosen)), callbacks=[StopAtStep(8)])
    resumed = run(
        compose_config(tiny_overrides(split, shared_cache, *chosen, "run.ckpt_path=last"))
    )
    assert resumed.global_step == straight.global_step == 16
    ours, _ = _weights(resumed.last_checkpoint)
    theirs, _ = _weights(straight.last_checkpoint)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
