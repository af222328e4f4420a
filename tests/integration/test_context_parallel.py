"""Context parallelism on the CPU over gloo: each row split over 2 and 4 processes gives
the one-process loss and gradients of a tiny decoder (fp32, within 1e-5), with plain
causal rows, packed rows whose documents cross the shards, and local-window layers.
The comparison runs inside each process (``context_parallel_worker.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_helpers import torchrun

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

WORKER = str(Path(__file__).with_name("context_parallel_worker.py"))


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
