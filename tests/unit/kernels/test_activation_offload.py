"""Activation offload on the CPU: the checkpointed blocks' inputs go through the host-copy
hooks (a plain copy here), and the loss and gradients are those of the same model
without offload, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recipes_lib.config.schema import KernelsConfig, ModelConfig, PrecisionConfig, StrategyConfig
from recipes_lib.kernels.offload import ActivationOffload
from recipes_lib.training.build import ModelBuild, build_model

CONFIG = ModelConfig(
    vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32
)


def _loss_and_grads(kernels: KernelsConfig, doc_ids: torch.Tensor | None = None):
    torch.manual_seed(0)
    plan = ModelBuild(CONFIG, kernels, PrecisionConfig(), StrategyConfig())
    model = build_model(plan, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 32), generator=generator)
    labels = torch.randint(0, 64, (2, 32), generator=generator)
    logits = model(input_ids, doc_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return model, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_offloaded_block_inputs_give_the_same_loss_and_gradients(checkpointing):
    kept = KernelsConfig(activation_checkpointing=checkpointing)
    moved = KernelsConfig(activation_checkpointing=checkpointing, activation_offload=True)
    _, loss, grads = _loss_and_grads(kept)
    model, offloaded_loss, offloaded_grads = _loss_and_grads(moved)
    assert model.activation_offload is not None
    # one block input per checkpointed block (selective: blocks 0 and 2 of 3)
    assert model.activation_offload.copies == (3 if checkpointing == "full" else 2)
    assert torch.equal(loss, offloaded_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, offloaded_grads[name]), name


def test_nothing_is_offloaded_without_a_gradient():
    kernels = KernelsConfig(activation_checkpointing="full", activation_offload=True)
    model, _, _ = _loss_and_grads(kernels)
    offload = model.activation_offload
    assert isinstance(offload, ActivationOffload)
    before = offload.copies
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))
    assert offload.copies == before


def test_offload_without_checkpointing_is_refused():
    with pytest.raises(ValueError, match="kernels.activation_offload=true"):
        KernelsConfig(activation_checkpointing="off", activation_offload=True)
