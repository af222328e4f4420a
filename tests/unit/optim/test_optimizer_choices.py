"""The optimizers ``optim.name`` chooses: each over the weight-decay groups, Muon on the
blocks' matrices only, unknown names and arguments refused naming the key."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.schema import OptimConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.optim import build_optimizer
from recipes_lib.optim.choices import CombinedOptimizer
from recipes_lib.preflight import check_strategy


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_model_config(tie_embeddings=False))


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("adamw", torch.optim.AdamW),
        ("adafactor", torch.optim.Adafactor),
        ("RAdam", torch.optim.RAdam),
    ],
)
def test_each_optimizer_keeps_the_weight_decay_groups(name, cls):
    optimizer = build_optimizer(_model(), OptimConfig(name=name, weight_decay=0.05))
    assert type(optimizer) is cls
    decay = {g["name"]: g["weight_decay"] for g in optimizer.param_groups}
    assert decay == {"decay": 0.05, "no_decay": 0.0}


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(name="muon", args={"momentum": 0.9}))
    assert isinstance(optimizer, CombinedOptimizer)
    muon, adamw = optimizer.parts["muon"], optimizer.parts["adamw"]
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon == {
        f"layers.{i}.{part}.weight"
        for i in range(2)
        for part in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= in_adamw
    assert not in_muon & in_adamw and len(in_muon | in_adamw) == len(names)
    assert muon.param_groups[0]["momentum"] == 0.9
    # one schedule sets both: the groups are the parts' own
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (OptimConfig(name="adam_w"), "optim.name='adam_w' is not one of adamw"),
        (
            OptimConfig(name="SGD", args={"betas": [0.9, 0.9]}),
            "optim.args.betas is not an argument of SGD",
        ),
        (
            OptimConfig(name="muon", args={"beta": 0.9}),
            "optim.args.beta is not an argument of Muon",
        ),
    ],
)
def test_unknown_optimizers_and_arguments_are_refused_naming_the_key(config, match):
    with pytest.raises(ConfigError, match=match):
        build_optimizer(_model(), config)


def test_muon_given_a_1d_parameter_is_refused_by_name():
    """``optim.name=Muon`` (the torch class itself, over every parameter) meets the
    norm gains: one line, before training."""
    with pytest.raises(ConfigError, match="optim.name=Muon refused its arguments"):
        build_optimizer(torch.nn.Sequential(torch.nn.LayerNorm(4)), OptimConfig(name="Muon"))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["optim=muon", "strategy=deepspeed_zero2"],
            "optim.name=muon cannot be stepped by strategy=deepspeed_zero2, which steps its "
            "own optimizer; use strategy=single, ddp, fsdp, hsdp",
        ),
        (
            ["optim=adamw_8bit", "strategy=fsdp"],
            "optim.name=adamw_8bit steps whole tensors, and strategy=fsdp shards the parameters",
        ),
        (["optim.name=adam8bit"], "optim.name='adam8bit' is not one of adamw, adamw_8bit"),
        (
            ["optim.name=SGD", "+optim.args.lr_decay=1"],
            "optim.args.lr_decay is not an argument of SGD",
        ),
        (
            ["optim=adafactor", "stage.init_optimizer=true", "stage.init_from=x.ckpt"],
            "stage.init_optimizer=true carries AdamW's moments; optim.name=adafactor",
        ),
    ],
)
def test_the_preflight_refuses_an_optimizer_that_cannot_run(overrides, match):
    cfg = to_run_config(compose_config(["recipe=pretrain/tiny", *overrides]))
    with pytest.raises(ConfigError, match=match):
        check_strategy(cfg)


def _stepped_muon(seed: int) -> tuple[torch.nn.Module, CombinedOptimizer]:
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(name="muon"))
    generator = torch.Generator().manual_seed(seed)  # another batch: another state
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator)
    model(tokens).float().square().mean().backward()
    optimizer.step()
    return model, optimizer


def test_muons_state_dict_is_one_optimizers_layout_and_loads_either_layout():
    """One ``state`` by parameter index over the parts' groups in order (what
    torch.distributed.checkpoint reads); loaded into a fresh Muon+AdamW, every part's
    state is the saved one; a dict of one entry per part (earlier checkpoints) too."""
    _, saved = _stepped_muon(0)
    layout = saved.state_dict()
    assert set(layout) == {"state", "param_groups"}
    indices = [i for g in layout["param_groups"] for i in g["params"]]
    assert indices == list(range(len(indices))) and set(layout["state"]) == set(indices)
    per_part = {name: part.state_dict() for name, part in saved.parts.items()}
    for given in (layout, per_part):
        _, fresh = _stepped_muon(1)
        before = fresh.parts["muon"].state_dict()["state"][0]["momentum_buffer"].clone()
        assert not torch.equal(before, per_part["muon"]["state"][0]["momentum_buffer"])
        fresh.load_state_dict(given)
        for name, part in saved.parts.items():
            theirs, ours = part.state_dict()["state"], fresh.parts[name].state_dict()["state"]
            assert theirs.keys() == ours.keys()
            for index, entry in theirs.items():
                for key, value in entry.items():
                    torch.testing.assert_close(ours[index][key], value, rtol=0, atol=0)
