"""The sigmoid router (DeepSeek-V3, GLM-4.5) computes its logits in float32 as transformers
does: in a bfloat16 model and under bfloat16 autocast its logits and choices are
transformers' router's, its gradients are the float32 computation's, and no float32 copy
of the tokens is kept for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import model_config_from_hf
from recipes_lib.models import Transformer
from recipes_lib.models.moe import MoEFeedForward

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3TopkRouter,
)

# 64 experts in 8 groups, 6 per token within the 4 best groups: DeepSeek-V3's routing
ROUTING = dict(
    vocab_size=64,
    hidden_size=256,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    first_k_dense_replace=0,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    max_position_embeddings=64,
)


def routers(dtype: torch.dtype) -> tuple[MoEFeedForward, DeepseekV3TopkRouter]:
    """Our sigmoid router's layer in ``dtype`` and transformers' router holding the same
    values (its weight float32, as transformers keeps it; the values exact in bfloat16)."""
    hf_config = transformers.DeepseekV3Config(**ROUTING)
    config = model_config_from_hf(hf_config.to_dict())
    torch.manual_seed(0)
    layer = Transformer(config).layers[0].feed_forward
    theirs = DeepseekV3TopkRouter(hf_config)
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(64, 256, generator=gen) * 0.05).to(torch.bfloat16).float()
    bias = torch.randn(64, generator=gen) * 0.01
    with torch.no_grad():
        layer.router.weight.copy_(weight)
        layer.expert_bias.copy_(bias)
        theirs.weight.copy_(weight)
        theirs.e_score_correction_bias.copy_(bias)
    return layer.to(dtype), theirs


def hidden(n: int = 512, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_a_bfloat16_model_routes_as_transformers():
    layer, theirs = routers(torch.bfloat16)
    x = hidden()
    with torch.no_grad():
        logits, chosen, weights, _ = layer.route(x)
        their_logits, their_weights, their_chosen = theirs(x)
    assert layer.router.weight.dtype == torch.bfloat16  # the parameter keeps the model's dtype
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, their_logits, atol=1e-6, rtol=1e-6)
    ours = chosen.sort(-1)
    torch.testing.assert_close(ours.values, their_chosen.sort(-1).values)
    torch.testing.assert_close(
        weights.gather(-1, ours.indices), their_weights.gather(-1, their_chosen.argsort(-1))
    )
    # what the bfloat16 matmul gives instead: other logits, and other experts for some tokens
    narrow = layer.router(x).float()
    assert (narrow - their_logits).abs().max() > 1e-3


def test_under_autocast_the_logits_are_the_float32_computation():
    layer, theirs = routers(torch.float32)  # bf16-mixed: float32 weights
    x = hidden().float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer.route(x)[0]
        narrow = layer.router(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(x, theirs.weight), atol=1e-6, rtol=1e-6)
    assert narrow.dtype == torch.bfloat16 and (narrow.float() - logits).abs().max() > 1e-3


def test_near_ties_are_broken_as_transformers_breaks_them():
    """Over enough tokens some experts' scores tie within a bfloat16 step: the float32
    logits choose as transformers does, where the bfloat16 matmul chose others."""
    layer, theirs = routers(torch.bfloat16)
    x = hidden(2048)
    with torch.no_grad():
        chosen = layer.route(x)[1].sort(-1).values
        their_chosen = theirs(x)[2].sort(-1).values
        layer._logits = lambda x: layer.router(x)  # the model's-dtype matmul it replaced
        narrow = layer.route(x)[1].sort(-1).values
    assert torch.equal(chosen, their_chosen)
    assert (narrow != their_chosen).any(-1).sum() > 0


def test_gradients_are_the_float32_computation_in_the_models_dtype():
    layer, theirs = routers(torch.bfloat16)
    x = hidden(128).requires_grad_()
    logits = layer.route(x)[0]
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    logits.backward(grad)
    wide_x = x.detach().float().requires_grad_()
    wide_w = layer.router.weight.detach().float().requires_grad_()
    F.linear(wide_x, wide_w).backward(grad)
    assert x.grad.dtype == torch.bfloat16 and layer.router.weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, wide_x.grad.to(torch.bfloat16))
    torch.testing.assert_close(layer.router.weight.grad, wide_w.grad.to(torch.bfloat16))


def test_no_float32_copy_of_the_tokens_is_kept_for_the_backward():
    layer, _ = routers(torch.bfloat16)
    x = hidden(256).requires_grad_()
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        layer.route(x)
    tokens = [t for t in saved if t.shape == x.shape]
    assert tokens and all(t.dtype == torch.bfloat16 for t in tokens)


def test_a_softmax_router_computes_in_the_models_dtype():
    """Qwen3-MoE, Mixtral, gpt-oss: transformers computes those routers' logits in the
    model's dtype, and so does the library."""
    config = tiny_model_config(family="qwen3_moe", qk_norm="head", moe_experts=4, moe_top_k=2)
    layer = Transformer(config).layers[0].feed_forward.to(torch.bfloat16)
    logits = layer.route(torch.randn(8, 32).to(torch.bfloat16))[0]
    assert logits.dtype == torch.bfloat16
