"""A tiny mixture of experts trains on the CPU as the dense tiny model does, with its
load balanced and its auxiliary losses logged, and resumes bitwise."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import tiny_overrides
from lightning.pytorch.callbacks import Callback
from tiny import StopAtStep

from recipes_lib.config import compose_config
from recipes_lib.train import run


def _overrides(tmp_path, cache, recipe: str, *extra: str) -> list[str]:
    base = tiny_overrides(tmp_path, cache, *extra)
    return [f"recipe={recipe}", *base[1:]]


class RecordLoad(Callback):
    """Each step's logged per-layer load and balance loss."""

    def __init__(self):
        self.load: list[float] = []
        self.balance: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.load.append(max(float(metrics[f"moe/load_max_mean/{i}"]) for i in range(2)))
        self.balance.append(float(metrics["train/moe_balance_loss"]))


def test_tiny_moe_learns_as_the_dense_model_does_with_balanced_load(tmp_path, shared_cache):
    steps = [
        "trainer.max_steps=64",
        "data.batch_size=8",
        "trainer.val_check_interval=64",
        "trainer.limit_val_batches=4",
    ]
    dense = run(
        compose_config(_overrides(tmp_path / "dense", shared_cache, "pretrain/tiny", *steps))
    )
    record = RecordLoad()
    moe_steps = [*steps, "model.moe_aux_loss_coef=0.05"]
    moe = run(
        compose_config(_overrides(tmp_path / "moe", shared_cache, "pretrain/moe_tiny", *moe_steps)),
        callbacks=[record],
    )
    assert moe.global_step == 64
    # ln(512) = 6.24 at the start; both fall well below it, the experts about as far
    assert dense.metrics["val/loss"] < 5.5
    assert moe.metrics["val/loss"] < dense.metrics["val/loss"] * 1.05
    # the first steps' large updates crowd the tokens onto a few experts (the busiest of 8
    # near 4x the mean: every token's first choice); the balance loss spreads them again
    last = sum(record.load[-8:]) / 8
    assert max(record.load[:16]) > 3 and last < 2.5 and last < 0.75 * max(record.load)
    # k = 2 when balanced (transformers' convention)
    assert 2.0 <= min(record.balance) and sum(record.balance[-8:]) / 8 < 2.2
    assert 0 < moe.metrics["train/moe_z_loss"]


def _final_model(result):
    state = torch.load(result.last_checkpoint, map_location="cpu", weights_only=False)
    return state["state_dict"]


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_a_resumed_moe_run_matches_an_uninterrupted_one(tmp_path, shared_cache, router):
    extra = [f"model.moe_router={router}"]
    if router == "sigmoid":
        extra.append("model.moe_bias_update_rate=0.01")
    straight = run(
        compose_config(_overrides(tmp_path / "a", shared_cache, "pretrain/moe_tiny", *extra))
    )
    split = tmp_path / "b"
    run(
        compose_config(_overrides(split, shared_cache, "pretrain/moe_tiny", *extra)),
        callbacks=[StopAtStep(8)],
    )
    resumed = run(
        compose_config(
            _overrides(split, shared_cache, "pretrain/moe_tiny", *extra, "run.ckpt_path=last")
        )
    )
    assert resumed.global_step == straight.global_step == 16
    ours, theirs = _final_model(resumed), _final_model(straight)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)
    if router == "sigmoid":  # the balancing bias moved, and is part of the checkpoint
        biases = [t for n, t in theirs.items() if n.endswith("expert_bias")]
        assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)
