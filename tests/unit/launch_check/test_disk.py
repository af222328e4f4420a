"""The pre-launch check's checkpoint space: one checkpoint's size from the config (weights
as stored and the optimizer's state), how many the retention keeps at once, and a row
that fails when they would not fit the free space of the run folder's disk."""

from __future__ import annotations

import collections
import functools
import math
import shutil

import pytest
import torch

import recipes_lib.launch_check.check as check
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.launch_check import check_launch
from recipes_lib.launch_check.check import FAIL, OK
from recipes_lib.launch_check.disk import checkpoint_bytes, kept_checkpoints
from recipes_lib.models import Transformer

Usage = collections.namedtuple("Usage", "total used free")
TINY = ("model=tiny", "trainer.accelerator=cpu")


@functools.cache
def cfg_of(*overrides: str):
    return to_run_config(compose_config([*TINY, *overrides]))


def _shapes(cfg) -> list[tuple[int, ...]]:
    with torch.device("meta"):
        return [tuple(p.shape) for p in Transformer(cfg.model).parameters()]


# The state each optimizer keeps per parameter tensor of n elements, in elements of the
# tensor's dtype, and the fixed bytes beside them:
# - AdamW: two moments (2n) and a 0-d fp32 step count (4 bytes);
# - Adafactor: a matrix's second moment factored into one row and one column (rows +
#   cols), a vector's whole (n), and the step count (4 bytes);
# - SGD with momentum: one momentum buffer (n) and no step count.
def _adamw(shape):
    return 2 * math.prod(shape), 4


def _adafactor(shape):
    return (sum(shape) if len(shape) == 2 else math.prod(shape)), 4


def _sgd_momentum(shape):
    return math.prod(shape), 0


@pytest.mark.parametrize(
    ("optimizer", "state"),
    [
        ((), _adamw),
        (("optim=adafactor",), _adafactor),
        (("optim.name=SGD", "+optim.args.momentum=0.9"), _sgd_momentum),
    ],
)
def test_a_checkpoint_is_the_weights_and_the_optimizer_state(optimizer, state):
    for precision, width in (("32-true", 4), ("bf16-true", 2)):  # state in the weights' dtype
        cfg = cfg_of(f"precision={precision}", *optimizer)
        shapes = _shapes(cfg)
        weights = sum(math.prod(s) for s in shapes) * width
        kept = sum(state(s)[0] * width + state(s)[1] for s in shapes)
        assert checkpoint_bytes(cfg) == weights + kept


def test_the_tiny_models_checkpoint_with_adamw_in_figures():
    # 1,442,432 parameters in 20 tensors: fp32 weights and two fp32 moments are 12 bytes
    # a parameter, and each tensor's step count 4 bytes more
    assert checkpoint_bytes(cfg_of("precision=32-true")) == 1_442_432 * 12 + 20 * 4


@pytest.mark.parametrize(
    ("overrides", "kept"),
    [
        (("run.keep_last_checkpoints=2",), 3),  # two, and the next one as it lands
        (("run.keep_last_checkpoints=-1",), 10),  # every one written
        (("run.keep_last_checkpoints=2", "run.keep_every_n_steps=400"), 8),
        (("run.keep_last_checkpoints=2", "stage.average_last_k=4"), 5),
        (("run.keep_last_checkpoints=2", "run.checkpoint_every_n_steps=800"), 2),
        (("run.save_top_k=0",), 1),
    ],
)
def test_the_checkpoints_kept_at_once_follow_the_retention(overrides, kept):
    cfg = cfg_of("run.checkpoint_every_n_steps=200", *overrides)
    assert kept_checkpoints(cfg, steps=2000) == kept


def test_the_row_fails_when_the_kept_checkpoints_do_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "_live", lambda cfg, world, report: None)  # estimates only
    overrides = (f"run.dir={tmp_path / 'run'}", "trainer.max_steps=1000")
    cfg = compose_config([*TINY, *overrides])
    each = checkpoint_bytes(to_run_config(cfg))  # three kept at once (2 and the next)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(2**40, 0, 2 * each))
    rows = {r.check: r for r in check_launch(cfg).rows}
    assert rows["checkpoint space"].status == FAIL
    assert "3 checkpoint(s) of about" in rows["checkpoint space"].figure
    assert f"on the disk of {tmp_path / 'run'}" in rows["checkpoint space"].figure
    assert "they do not fit" in rows["checkpoint space"].figure
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(2**40, 0, 100 * each))
    assert {r.check: r.status for r in check_launch(cfg).rows}["checkpoint space"] == OK
