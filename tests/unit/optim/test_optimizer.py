import pytest
import torch
from torch import nn

from recipes_lib.config.schema import OptimConfig
from recipes_lib.errors import ConfigError
from recipes_lib.optim import build_optimizer, split_parameters


class ScaleNorm(nn.Module):
    """A norm the optimizer knows only by its class name."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.weight


class TinyLM(nn.Module):
    def __init__(self, tie: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 8)
        self.attn_norm = nn.RMSNorm(8)
        self.proj = nn.Linear(8, 8, bias=True)
        self.gate = nn.Linear(8, 16, bias=False)
        self.norm = ScaleNorm(8)
        self.scale = nn.Parameter(torch.ones(8))  # a bare 1-D parameter
        self.output = nn.Linear(8, 32, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight


def groups_by_name(optimizer):
    return {group["name"]: group for group in optimizer.param_groups}


def test_only_weight_matrices_are_decayed():
    model = TinyLM()
    split = split_parameters(model)
    assert sorted(split.decay_names) == ["gate.weight", "output.weight", "proj.weight"]
    assert sorted(split.no_decay_names) == [
        "attn_norm.weight",
        "norm.weight",
        "proj.bias",
        "scale",
        "tok_embeddings.weight",
    ]


def test_optimizer_groups_cover_every_trainable_parameter_once():
    model = TinyLM()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    groups = groups_by_name(optimizer)
    assert groups["decay"]["weight_decay"] == 0.1
    assert groups["no_decay"]["weight_decay"] == 0.0
    in_groups = [p for g in optimizer.param_groups for p in g["params"]]
    assert len({id(p) for p in in_groups}) == len(in_groups)
    assert sum(p.numel() for p in in_groups) == sum(p.numel() for p in model.parameters())
    assert optimizer.defaults["fused"] is True  # on the CPU too: several times faster
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)


def test_tied_output_weight_is_counted_once_as_an_embedding():
    model = TinyLM(tie=True)
    optimizer = build_optimizer(model, OptimConfig())
    in_groups = [p for g in optimizer.param_groups for p in g["params"]]
    assert sum(p is model.tok_embeddings.weight for p in in_groups) == 1
    assert any(
        p is model.tok_embeddings.weight for p in groups_by_name(optimizer)["no_decay"]["params"]
    )
    assert sum(p.numel() for p in in_groups) == sum(p.numel() for p in model.parameters())


def test_decay_embeddings_moves_the_table_to_the_decay_group():
    model = TinyLM()
    optimizer = build_optimizer(model, OptimConfig(decay_embeddings=True))
    decayed = groups_by_name(optimizer)["decay"]["params"]
    assert any(p is model.tok_embeddings.weight for p in decayed)


def test_frozen_parameters_are_left_out():
    model = TinyLM()
    for param in model.parameters():
        param.requires_grad_(False)
    model.proj.weight.requires_grad_(True)
    model.proj.bias.requires_grad_(True)
    optimizer = build_optimizer(model, OptimConfig())
    groups = groups_by_name(optimizer)
    assert [p is model.proj.weight for p in groups["decay"]["params"]] == [True]
    assert [p is model.proj.bias for p in groups["no_decay"]["params"]] == [True]


def test_no_trainable_parameters_is_an_error():
    model = TinyLM().requires_grad_(False)
    with pytest.raises(ConfigError, match="TinyLM has no trainable parameter"):
        build_optimizer(model, OptimConfig())


def test_bad_betas_name_the_key():
    with pytest.raises(ConfigError, match=r"optim.betas must hold two values, got \[0.9\]"):
        build_optimizer(TinyLM(), OptimConfig(betas=[0.9]))


def test_weight_decay_shrinks_only_decayed_parameters():
    model = TinyLM()
    optimizer = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    assert torch.allclose(model.proj.weight, before["proj.weight"] * (1 - 0.1 * 0.5))
    assert torch.equal(model.proj.bias, before["proj.bias"])
    assert torch.equal(model.tok_embeddings.weight, before["tok_embeddings.weight"])
