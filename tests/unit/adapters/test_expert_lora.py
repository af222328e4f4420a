"""LoRA on a mixture's routed experts (``adapter.target_modules: [.., experts]``): each
expert's stacked weights take a rank-r update through PEFT's ``target_parameters``; it
trains, merges into plain weights that compute what the adapted model does, is bypassed
when the adapters are off, and is written as a PEFT folder that PEFT loads over
transformers' model of each mixture family with the same logits."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.adapters import (
    adapters_disabled,
    apply_adapter,
    base_state_dict,
    has_expert_adapter,
    merge_adapter,
    save_adapter,
)
from recipes_lib.adapters.lora import check_adapter_config
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.errors import ConfigError
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


def test_expert_adapters_are_refused_where_they_cannot_work():
    with pytest.raises(ConfigError, match="adapter.dropout=0.05 with adapter.target_modules: ex"):
        check_adapter_config(AdapterConfig(kind="lora", dropout=0.05, target_modules=["experts"]))
    with pytest.raises(ConfigError, match="this model has none \\(model.moe_experts=0\\)"):
        apply_adapter(Transformer(tiny_model_config()), EXPERTS)


FAMILIES = {  # each mixture family's shape; Qwen3-MoE with its middle layer dense
    "qwen3_moe": dict(qk_norm="head", n_layers=3, moe_dense_layers=[1]),
    "olmoe": dict(qk_norm="full", moe_renormalize=False),
    "mixtral": dict(),
}


@pytest.mark.parametrize(
    "family,targets",
    [
        ("qwen3_moe", ["wq", "wv", "experts"]),
        ("olmoe", ["wq", "wk", "wo", "experts"]),
        ("mixtral", ["experts"]),
    ],
)
def test_expert_adapters_load_in_peft_on_the_transformers_model(tmp_path, family, targets):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    shape = dict(family=family, vocab_size=64, moe_experts=4, moe_top_k=2, moe_ffn_dim=16)
    config = tiny_model_config(**shape, **FAMILIES[family])
    adapter = AdapterConfig(kind="lora", r=4, alpha=8, dropout=0.0, target_modules=targets)
    model = apply_adapter(Transformer(config), adapter).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero: give every factor values to compare
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    base_dir = export_hf_checkpoint(base_state_dict(model), config, tmp_path / "base")
    folder = save_adapter(model, tmp_path / "adapter", adapter, base_model_name_or_path="base")

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(hf, folder).eval()
    loaded = peft.get_peft_model_state_dict(hf)
    saved = peft.utils.load_peft_weights(str(folder))
    assert sorted(loaded) == sorted(saved)  # every saved factor has its place, none missed
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, atol=0, rtol=0, msg=key)
    x = torch.randint(0, 64, (2, 12), generator=generator)
    with torch.no_grad():
        ours, theirs = model(x), hf(input_ids=x).logits
        with adapters_disabled(model), hf.disable_adapter():
            ours_base, theirs_base = model(x), hf(input_ids=x).logits
    torch.testing.assert_close(theirs_base, ours_base, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    assert (ours - ours_base).abs().max() > 1e-2  # the experts' adapters changed the logits
