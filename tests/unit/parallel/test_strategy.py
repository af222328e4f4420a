"""The ``strategy`` group: Lightning strategy objects, checks before training, and
activation checkpointing (the same gradients with less stored)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.schema import ModelConfig, StrategyConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.parallel import FSDP2Strategy, build_strategy, trainer_devices
from recipes_lib.parallel.strategy import STRATEGIES
from recipes_lib.preflight import check_strategy

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _cfg(*overrides: str):
    return to_run_config(compose_config(["recipe=pretrain/tiny", *overrides]))


@pytest.mark.parametrize(
    ("name", "expected"),
    [("single", str), ("ddp", DDPStrategy), ("fsdp", FSDP2Strategy)],
)
def test_each_name_builds_its_lightning_strategy(name, expected):
    strategy = build_strategy(StrategyConfig(name=name))
    assert isinstance(strategy, expected)
    if name == "single":
        assert strategy == "auto"


def test_the_fused_head_is_declared_for_the_strategies_it_is_tested_under():
    fused = {name for name, spec in STRATEGIES.items() if spec.fused_head}
    assert fused == {"single", "ddp", "fsdp", "hsdp"}
    check_strategy(_cfg("strategy=fsdp", "kernels.loss_chunk_size=64"))  # allowed


def test_strategy_group_composes_and_single_means_one_device():
    cfg = _cfg("strategy=fsdp", "strategy.cpu_offload=true")
    assert cfg.strategy.name == "fsdp" and cfg.strategy.cpu_offload
    assert trainer_devices(_cfg("trainer.devices=auto")) == 1
    assert trainer_devices(_cfg("strategy=ddp", "trainer.devices=2")) == 2


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (("strategy.name=zero9",), ["strategy.name"]),
        (("trainer.devices=2",), ["strategy=single", "trainer.devices=2"]),
        (("strategy=ddp", "strategy.cpu_offload=true"), ["strategy.cpu_offload"]),
        (("strategy=fsdp", "stage.average_last_k=2"), ["stage.average_last_k"]),
        (("strategy=fsdp", "stage.ema_decay=0.99"), ["stage.ema_decay"]),
        (("strategy=ddp", "strategy.expert_parallel=true"), ["strategy.expert_parallel"]),
        (("strategy=fsdp", "strategy.expert_parallel=true"), ["model.moe_experts"]),
        (
            (
                "strategy=fsdp",
                "strategy.expert_parallel=true",
                "model=moe_tiny",
                "model.moe_experts=6",
                "trainer.devices=4",
            ),
            ["model.moe_experts=6", "4 ranks"],
        ),
    ],
)
def test_impossible_strategies_fail_naming_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as err:
        check_strategy(_cfg(*overrides))
    for key in keys:
        assert key in str(err.value)


@pytest.mark.skipif(HAS_DEEPSPEED, reason="checks the message shown without deepspeed")
def test_deepspeed_without_the_package_says_how_to_install_it():
    with pytest.raises(ConfigError, match=r"recipes-lib\[deepspeed\]"):
        check_strategy(_cfg("strategy=deepspeed_zero2"))


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    config = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_dim=128)
    torch.manual_seed(0)
    model = Transformer(config)
    ids = torch.randint(0, 128, (2, 16))

    def grads(checkpointing: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        model.set_activation_checkpointing(checkpointing)
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, plain = grads(False)
    loss_ac, checkpointed = grads(True)
    assert torch.equal(loss, loss_ac)
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert all(layer.checkpoint_activations for layer in model.layers)
