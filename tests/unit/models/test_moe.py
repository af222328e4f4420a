"""The mixture-of-experts MLP: routing, the grouped path against the loop, the losses
it leaves for the objective, and what compiling and activation checkpointing keep."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.models import Transformer
from recipes_lib.models.moe import MoEFeedForward, moe_layers
from recipes_lib.training.experts import load_metrics, moe_losses

MOE = dict(family="qwen3_moe", qk_norm="head", moe_experts=4, moe_top_k=2, moe_ffn_dim=16)


def _layer(**changes) -> MoEFeedForward:
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(**{**MOE, **changes}))
    return model.layers[0].feed_forward


def _reference(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its experts one at a time, weighted: the definition."""
    flat = x.reshape(-1, x.shape[-1])
    _, chosen, weights, _ = layer.route(flat)
    out = torch.zeros_like(flat)
    e = layer.experts
    for n in range(flat.shape[0]):
        for j in range(layer.top_k):
            k = int(chosen[n, j])
            h = torch.nn.functional.silu(e.w1.weight[k] @ flat[n]) * (e.w3.weight[k] @ flat[n])
            out[n] += weights[n, j] * (e.w2.weight[k] @ h)
    if layer.shared is not None:
        out += layer.shared(flat)
    return out.view_as(x)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"moe_renormalize": False, "moe_top_k": 3},
        {"moe_shared_experts": 2},
        {"moe_router": "sigmoid"},
    ],
)
def test_the_layer_is_its_definition(changes):
    layer = _layer(**changes).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x), atol=1e-5, rtol=1e-5)


def test_the_grouped_gemm_path_equals_the_loop():
    layer = _layer()
    x, counts = torch.randn(12, 32), torch.tensor([3, 0, 7, 2])
    torch.testing.assert_close(
        layer.experts._grouped(x, counts), layer.experts._loop(x, counts), atol=1e-5, rtol=1e-5
    )


def test_topk_renormalisation_and_the_sigmoid_bias_choose_as_documented():
    layer = _layer()
    _, _, weights, probs = layer.route(torch.randn(6, 32))
    torch.testing.assert_close(weights.sum(-1), torch.ones(6))
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    sigmoid = _layer(moe_router="sigmoid")
    with torch.no_grad():
        sigmoid.expert_bias.copy_(torch.tensor([0.0, 0.0, 100.0, 100.0]))
    _, chosen, _, _ = sigmoid.route(torch.randn(6, 32))
    assert sorted(chosen[0].tolist()) == [2, 3]  # the bias alone decides here
    sigmoid.update_bias(torch.tensor([10, 0, 30, 0]), rate=0.5)
    # experts 0 and 2 above the mean of 10 tokens go down, 1 and 3 go up
    assert sigmoid.expert_bias.tolist() == [0.0, 0.5, 99.5, 100.5]


def test_routing_gives_the_balance_loss_of_transformers():
    layer = _layer().train()
    with torch.no_grad():
        layer.router.weight.zero_()  # every probability 1/4, ties broken by index
    layer(torch.randn(2, 8, 32))
    # two experts take every token: f = (1, 1, 0, 0) (tokens over tokens), P = 1/4 each:
    # 4 * (1/4 + 1/4) = 2, what a balanced router also scores (k)
    assert layer.balance_loss.item() == pytest.approx(2.0)
    assert sorted(layer.expert_counts.tolist()) == [0, 0, 16, 16]
    assert layer.z_loss.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)
    metrics = load_metrics(layer.expert_counts[None])
    assert metrics["moe/load_max_mean/0"].item() == pytest.approx(2.0)
    assert metrics["moe/load_min_mean/0"].item() == 0.0


def _aux_grads(model: Transformer, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    aux, _ = moe_losses(moe_layers(model), model.config)  # clears anything earlier
    logits = model(x)
    aux, metrics = moe_losses(moe_layers(model), model.config)
    (logits.square().mean() + aux).backward()
    return aux.detach(), [m.router.weight.grad.clone() for m in moe_layers(model)]


def test_compiled_and_checkpointed_blocks_keep_the_auxiliary_losses():
    config = tiny_model_config(**MOE, moe_aux_loss_coef=0.5, moe_z_loss_coef=0.1)
    torch.manual_seed(0)
    model = Transformer(config).train()
    x = torch.randint(0, 64, (2, 16))
    aux, grads = _aux_grads(model, x)
    assert aux > 0 and all(g.abs().sum() > 0 for g in grads)
    model.set_activation_checkpointing(True)
    aux_ac, grads_ac = _aux_grads(model, x)
    torch.testing.assert_close(aux_ac, aux)
    for g, want in zip(grads_ac, grads, strict=True):
        torch.testing.assert_close(g, want)
    model.set_activation_checkpointing(False)
    for layer in model.layers:
        layer.compile(backend="aot_eager")  # dynamo and autograd, no code generation
    aux_c, grads_c = _aux_grads(model, x)
    torch.testing.assert_close(aux_c, aux, atol=1e-5, rtol=1e-5)
    for g, want in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4)


def test_no_losses_are_left_outside_training():
    model = Transformer(tiny_model_config(**MOE)).eval()
    model(torch.randint(0, 64, (1, 8)))
    assert moe_losses(moe_layers(model), model.config) == (None, {})


def test_flops_count_the_active_experts():
    model = Transformer(tiny_model_config(**MOE))
    per_expert = 3 * 32 * 16
    assert model.inactive_params() == 2 * (4 - 2) * per_expert  # E - k experts, 2 layers
    active = model.num_params(exclude_embeddings=True) - model.inactive_params()
    attention = 12.0 * 2 * 4 * 8 * 8  # 12 * layers * heads * head_dim * seq
    assert model.flops_per_token(8) == 6.0 * active + attention


def test_padding_moves_no_balance_loss_z_loss_or_count():
    """A row padded with tokens the mask leaves out gives the losses and counts of the
    real tokens alone (right padding: causal attention keeps their hidden states)."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(**MOE)).train()
    real = torch.randint(0, 64, (2, 6))
    padded = torch.cat([real, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    mask = torch.arange(11) < 6
    model(real)
    alone = [(m.balance_loss, m.z_loss, m.expert_counts) for m in moe_layers(model)]
    model(padded, token_mask=mask.expand(2, 11))
    masked = [(m.balance_loss, m.z_loss, m.expert_counts) for m in moe_layers(model)]
    for got, want in zip(masked, alone, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    model(padded)  # without the mask the padding counts: 22 tokens' worth
    assert all(int(m.expert_counts.sum()) == 22 * 2 for m in moe_layers(model))


def test_kernels_experts_chooses_the_path_of_every_mixture_layer():
    from recipes_lib.models.moe import set_expert_path

    model = Transformer(tiny_model_config(**MOE))
    set_expert_path(model, "grouped")
    assert [m.experts.path for m in moe_layers(model)] == ["grouped", "grouped"]
