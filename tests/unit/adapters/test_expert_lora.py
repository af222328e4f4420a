"""LoRA on a mixture's routed experts (``adapter.target_modules: [.., experts]``): each
expert's stacked weights take a rank-r update through PEFT's ``target_parameters``; it
trains, merges into plain weights that compute what the adapted model does, and is
bypassed when the adapters are off."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.adapters import (
    adapters_disabled,
    apply_adapter,
    has_expert_adapter,
    merge_adapter,
    save_adapter,
)
from recipes_lib.adapters.lora import check_adapter_config
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.models import Transformer

MOE = dict(family="qwen3_moe", qk_norm="head", moe_experts=4, moe_top_k=2, moe_ffn_dim=16)
EXPERTS = AdapterConfig(kind="lora", r=4, alpha=8, dropout=0.0, target_modules=["wq", "experts"])


def test_expert_adapters_train_merge_and_switch_off():
    torch.manual_seed(0)
    config = tiny_model_config(**MOE)
    model = Transformer(config)
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        base = model(x)
    apply_adapter(model, EXPERTS)
    assert has_expert_adapter(model)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_" in n for n in trained)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained} == {"wq", "w1", "w2", "w3"}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    experts = model.layers[0].feed_forward.experts
    # PEFT's (E, out, in) layout: A reads the inputs (E * r, in), B writes the outputs
    assert experts.w1.lora_A["default"].weight.shape == (4 * 4, 32)  # in: the model's 32
    assert experts.w2.lora_B["default"].weight.shape == (32, 4 * 4)  # out: the model's 32
    expert_b = experts.w2.lora_B["default"].weight
    assert expert_b.abs().sum() > 0  # the experts' own factors moved
    with torch.no_grad():
        adapted = model(x)
        with adapters_disabled(model):
            torch.testing.assert_close(model(x), base)
    plain = Transformer(config)
    plain.load_state_dict(merge_adapter(model), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), adapted, atol=1e-5, rtol=1e-5)
    assert (adapted - base).abs().max() > 1e-3


def test_expert_adapters_are_refused_where_they_cannot_work(tmp_path):
    with pytest.raises(ConfigError, match="adapter.dropout=0.05 with adapter.target_modules: ex"):
        check_adapter_config(AdapterConfig(kind="lora", dropout=0.05, target_modules=["experts"]))
    with pytest.raises(ConfigError, match="this model has none \\(model.moe_experts=0\\)"):
        apply_adapter(Transformer(tiny_model_config()), EXPERTS)
    model = apply_adapter(Transformer(tiny_model_config(**MOE)), EXPERTS)
    with pytest.raises(CheckpointError, match="adapters on a mixture's experts have no PEFT"):
        save_adapter(model, tmp_path / "adapter", EXPERTS)
    assert not (tmp_path / "adapter").exists()
