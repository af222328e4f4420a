"""FSDP2 with context parallelism on GPUs over NCCL: the parameters sharded over every
GPU while each 1,024-token row is split over groups of them give the one-GPU loss and
gradients of a tiny decoder (fp32, within 1e-3: the flex kernel's TF32 dots), with
``flex`` on its BlockMask path and packed documents crossing the shards, and with
``sdpa`` on plain rows; losses scaled as if a group's gradients were averaged instead of
summed are caught. The comparison runs inside each process
(``tests/integration/fsdp_context_parallel_worker.py``)."""

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

WORKER = str(Path(__file__).parents[1] / "integration" / "fsdp_context_parallel_worker.py")


@pytest.mark.parametrize(
    ("documents", "mode"), [("docs", "sum"), ("plain", "sum"), ("docs", "average")]
)
def test_fsdp_with_split_rows_on_two_gpus_gives_the_one_gpu_loss_and_gradients(documents, mode):
    result = torchrun(2, WORKER, "2", documents, mode, "cuda", timeout=300)
    assert result.stdout.count("worst grad diff") == 2


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("degree", ["2", "4"])
def test_fsdp_with_split_rows_on_four_gpus_gives_the_one_gpu_loss_and_gradients(degree):
    result = torchrun(4, WORKER, degree, "docs", "sum", "cuda", timeout=300)
    assert result.stdout.count("worst grad diff") == 4
