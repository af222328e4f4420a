"""LoRA on GPT-2-style models of the transformers fallback, whose projections are
transformers' Conv1D (a linear with its weight stored transposed), through PEFT's
fan_in_fan_out."""

from __future__ import annotations

import logging

import pytest
import torch

from recipes_lib.adapters import merge_adapter
from recipes_lib.adapters.hf_fallback import apply_fallback_adapter, save_fallback_adapter
from recipes_lib.adapters.lora import lora_layers
from recipes_lib.checkpoint.hf_files import read_folder_config
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.models.hf_fallback import build_hf_model, fallback_model_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TINY_GPT2 = dict(
    vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
)


@pytest.fixture
def folder(tmp_path):
    cfg = transformers.AutoConfig.for_model("gpt2", **TINY_GPT2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


def adapted(folder, caplog):
    model = build_hf_model(fallback_model_config(read_folder_config(folder)), folder=folder)
    config = AdapterConfig(kind="lora", r=4, alpha=8, dropout=0.0)
    with caplog.at_level(logging.WARNING):
        apply_fallback_adapter(model, config)
    return model, config


def test_lora_trains_gpt2s_conv1d_projections_and_merges_exactly(folder, tmp_path, caplog):
    model, config = adapted(folder, caplog)
    layers = lora_layers(model)
    # the native target names name nothing of GPT-2's: every projection, said in one line
    assert {name.rsplit(".", 1)[-1] for name in layers} == {"c_attn", "c_proj", "c_fc"}
    assert len(layers) == 8 and all(layer.fan_in_fan_out for layer in layers.values())
    assert any("adapting every linear" in r.getMessage() for r in caplog.records)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    cycle = torch.tensor([11, 57, 103, 160, 201, 240])  # each token says the next one
    ids = cycle.repeat(4, 4)  # (4, 24)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    optimizer = torch.optim.AdamW(trainable, lr=3e-2)
    model.train()
    losses = []
    for _ in range(20):
        loss = model(ids, labels=labels, loss_chunk_size=16)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0] - 0.5, losses

    model.eval()
    x = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x)
        # the merged weights, under transformers' names, in a fresh GPT-2
        merged = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        missing, unexpected = merged.load_state_dict(merge_adapter(model), strict=False)
        assert not unexpected and all("lm_head" in k for k in missing)  # tied
        torch.testing.assert_close(merged(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)
        # the adapter folder, read by PEFT over the starting folder
        out = save_fallback_adapter(model, tmp_path / "adapter", config)
        base = transformers.AutoModelForCausalLM.from_pretrained(folder)
        reread = peft.PeftModel.from_pretrained(base, str(out)).eval()
        assert reread.peft_config["default"].fan_in_fan_out
        torch.testing.assert_close(reread(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)
