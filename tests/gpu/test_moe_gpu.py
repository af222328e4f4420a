"""On a GPU the experts' grouped GEMM computes what the loop over experts does, forward
and backward, in bf16 (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from recipes_lib.config.schema import ModelConfig
from recipes_lib.models.blocks import FeedForward
from recipes_lib.models.moe import MoEFeedForward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(layer: MoEFeedForward, x: torch.Tensor, path: str):
    layer.experts.path = path
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.float().square().mean().backward()
    grads = [p.grad.float().clone() for p in layer.experts.parameters()]
    return y.float().detach(), x.grad.float(), grads


@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (64, 8)])
def test_grouped_gemm_matches_the_loop_over_experts(experts, top_k):
    config = ModelConfig(
        family="qwen3_moe",
        dim=512,
        n_layers=1,
        moe_experts=experts,
        moe_top_k=top_k,
        moe_ffn_dim=256,
    )
    torch.manual_seed(0)
    layer = MoEFeedForward(config, FeedForward).cuda()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(2, 1000, 512, device="cuda")  # counts not multiples of anything
    y, dx, grads = _run(layer, x, "grouped")
    y_ref, dx_ref, grads_ref = _run(layer, x, "loop")
    torch.testing.assert_close(y, y_ref, atol=2e-2 * y_ref.abs().max().item(), rtol=2e-2)
    torch.testing.assert_close(dx, dx_ref, atol=2e-2 * dx_ref.abs().max().item(), rtol=2e-2)
    for g, ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


def test_an_idle_expert_gets_zero_gradients_on_the_grouped_path():
    """Experts no row reached: their weight gradients are zeros, as on the loop (a
    grouped GEMM's empty groups must not leave what the memory held)."""
    from recipes_lib.models.moe import Experts

    torch.manual_seed(0)
    experts = Experts(4, 64, 32, "silu").cuda()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(40, 64, device="cuda")
    counts = torch.tensor([15, 0, 25, 0], device="cuda")
    grads = {}
    for path in ("grouped", "loop"):
        experts.path = path
        experts.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = experts(x, counts)
        y.float().square().sum().backward()
        grads[path] = [p.grad.float().clone() for p in experts.parameters()]
    for g in grads["grouped"]:
        assert g[1].abs().sum() == 0 and g[3].abs().sum() == 0
    for g, ref in zip(grads["grouped"], grads["loop"], strict=True):
        torch.testing.assert_close(g, ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
