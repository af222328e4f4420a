"""Checkpoints of GPU tensors (``pytest -m gpu``): a foreground save streams each storage
through two pinned buffers, after the kernels queued for it, in many pieces; a background
save writes its pinned host copy while training changes the weights. Both load back
bit for bit."""

from __future__ import annotations

import pytest
import torch

from recipes_lib.checkpoint import torch_file
from recipes_lib.checkpoint.integrity import (
    forget_verified,
    save_torch_checkpoint,
    verify_checkpoint,
)
from recipes_lib.checkpoint.io import VerifiedCheckpointIO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _state() -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(1024, 1000, device="cuda", generator=generator)  # ~4 MB
    return {
        "global_step": 5,
        "state_dict": {
            "weight": weight,
            "row": weight[3],
            "norm": torch.randn(999, device="cuda", generator=generator).bfloat16(),
            "on_cpu": torch.arange(10),
        },
    }


def _assert_loads_as(path, expected: dict) -> None:
    forget_verified()
    assert verify_checkpoint(path)
    found = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name
    assert found["row"].data_ptr() == found["weight"].data_ptr() + 3 * 1000 * 4


def test_a_foreground_save_streams_gpu_storages_in_pieces_after_their_kernels(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(torch_file, "PIECE", 1 << 20)  # four pieces of the weight, and a rest
    state = _state()
    torch.cuda.synchronize()
    state["state_dict"]["weight"].mul_(3.0)  # queued, perhaps unfinished, when the save starts
    save_torch_checkpoint(state, tmp_path / "a.ckpt")
    expected = {k: v.cpu() for k, v in state["state_dict"].items()}
    _assert_loads_as(tmp_path / "a.ckpt", expected)


def test_a_background_save_of_gpu_tensors_keeps_the_weights_it_was_given(tmp_path):
    state = _state()
    expected = {k: v.cpu() for k, v in state["state_dict"].items()}
    plugin = VerifiedCheckpointIO(asynchronous=True)
    plugin.save_checkpoint(state, tmp_path / "step000005.ckpt")
    state["state_dict"]["weight"].add_(1.0)  # the next optimizer step, while it is written
    plugin.teardown()
    _assert_loads_as(tmp_path / "step000005.ckpt", expected)
