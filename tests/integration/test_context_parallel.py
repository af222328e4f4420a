"""Context parallelism on the CPU over gloo: each row split over 2 and 4 processes gives
the one-process loss and gradients of a tiny decoder (fp32, within 1e-5), with plain
causal rows, packed rows whose documents cross the shards, and local-window layers.
The comparison runs inside each process (``context_parallel_worker.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from integration_helpers import metric_series, read_metrics, tiny_overrides
from run_helpers import torchrun

from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config
from recipes_lib.train import run

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

WORKER = str(Path(__file__).with_name("context_parallel_worker.py"))
RUNNER = str(Path(__file__).with_name("context_parallel_run.py"))


@pytest.mark.parametrize(
    ("processes", "attention", "documents", "window"),
    [
        (2, "sdpa", "plain", "plain"),
        (2, "flex", "docs", "plain"),
        (4, "flex", "docs", "window"),
    ],
)
def test_split_rows_give_the_one_process_loss_and_gradients(
    processes, attention, documents, window
):
    result = torchrun(processes, WORKER, attention, documents, window, timeout=120, omp_threads=1)
    assert result.stdout.count("worst grad diff") == processes


def test_a_pretraining_run_with_split_rows_follows_the_one_process_run(tmp_path):
    """``recipes_lib.train.run`` with strategy.context_parallel=2 over two gloo processes
    (one data-parallel replica) trains on the one-process run's rows, packed documents
    masked, and logs its loss curve within 1e-4."""
    cache = tmp_path / "cache"
    common = (
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "run.checkpoint_every_n_steps=4",
        "scheduler.warmup=2",
        "data.batch_size=2",
        "kernels.attention=flex",
        "data.document_mask=true",
    )

    def overrides(name: str, *extra: str) -> list[str]:
        items = tiny_overrides(tmp_path, cache, *common, *extra)
        return [o if not o.startswith("run.dir=") else f"run.dir={tmp_path / name}" for o in items]

    run(compose_config(overrides("single")))
    split_args = overrides("split", "strategy=ddp", "strategy.context_parallel=2")
    torchrun(2, RUNNER, *split_args, "trainer.devices=2", omp_threads=1)
    for rank in (0, 1):  # each rank attended from half of every 64-token row
        spied = json.loads((tmp_path / "split" / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0 and spied["lengths"] == [32]
    single = metric_series(read_metrics(tmp_path / "single"), "train/loss")
    split = metric_series(read_metrics(tmp_path / "split"), "train/loss")
    assert len(single) == 4
    assert [s for s, _ in split] == [s for s, _ in single]
    assert [v for _, v in split] == pytest.approx([v for _, v in single], abs=1e-4)
    assert single[-1][1] < single[0][1]  # it trained
    a = load_weights(tmp_path / "single" / "model.safetensors")
    b = load_weights(tmp_path / "split" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
