"""Context parallelism on two GPUs over NCCL: rows of 1,024 tokens split over both give
the one-GPU loss and gradients of a tiny decoder (fp32, within 1e-3: the flex kernel's
TF32 dots), with ``flex`` on its BlockMask path (no dense mask) and ``sdpa`` on the
dense one, packed documents and a local window crossing the shards. The comparison
runs inside each process (``tests/integration/context_parallel_worker.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_helpers import torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

WORKER = str(Path(__file__).parents[1] / "integration" / "context_parallel_worker.py")


@pytest.mark.parametrize(
    ("attention", "documents", "window"),
    [("flex", "docs", "plain"), ("flex", "docs", "window"), ("sdpa", "plain", "plain")],
)
def test_split_rows_on_two_gpus_give_the_one_gpu_loss_and_gradients(attention, documents, window):
    result = torchrun(2, WORKER, attention, documents, window, "cuda", timeout=300)
    assert result.stdout.count("worst grad diff") == 2
