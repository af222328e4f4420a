"""On a CUDA GPU, each optimizer spec's state bytes equal the bytes of the state a real
step makes, 8-bit AdamW (bitsandbytes, CUDA only) included, and the allocator's figure
agrees (``pytest -m gpu``; seconds). The CPU twin is tests/unit/optim."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from optimizer_probe import ProbeModel, measured_and_estimated

from recipes_lib.config.schema import OptimConfig
from recipes_lib.optim import OPTIMIZERS, build_optimizer, optimizer_state_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# the caching allocator hands out blocks of 512 bytes at least (a 0-d step counter: 4)
ALLOCATOR_ROUNDING = 512


def _runs(name: str) -> None:
    package = OPTIMIZERS[name].needs_package
    if package and importlib.util.find_spec(package[0]) is None:
        pytest.skip(f"optim.name={name} needs {package[0]}: {package[1]}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_estimate_is_the_state_a_cuda_step_makes(name, dtype):
    _runs(name)
    measured, estimated = measured_and_estimated(OptimConfig(name=name), "cuda", dtype)
    assert measured > 0
    assert estimated == measured


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_allocator_holds_the_estimate_after_a_step(name):
    """What stays allocated after the first step is the estimate, less what the
    optimizer keeps on the host (Adafactor's step counters), give or take the allocator
    rounding each of the state's small tensors up to 512 bytes."""
    _runs(name)
    torch.manual_seed(0)
    model = ProbeModel().cuda()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    config = OptimConfig(name=name)
    optimizer = build_optimizer(model, config)
    optimizer.step()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before
    with torch.device("meta"):
        estimated = optimizer_state_bytes(ProbeModel(), config)
    values = [v for entry in optimizer.state.values() for v in entry.values()]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    on_host = sum(v.numel() * v.element_size() for v in tensors if v.device.type == "cpu")
    on_device = estimated - on_host
    assert on_device <= allocated <= on_device + len(tensors) * ALLOCATOR_ROUNDING
