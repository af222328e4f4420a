"""QLoRA on the transformers fallback (model.family=hf): the targets of a model without a
native family become NF4 bases under PEFT's 4-bit LoRA layers, the adapters train, and
the merge dequantizes them (``pytest -m gpu``; needs bitsandbytes)."""

from __future__ import annotations

import pytest
import torch

from recipes_lib.adapters import merge_adapter
from recipes_lib.adapters.hf_fallback import apply_fallback_adapter
from recipes_lib.adapters.lora import lora_layers
from recipes_lib.checkpoint.hf_files import read_folder_config
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.models.hf_fallback import build_hf_model, fallback_model_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu


def test_qlora_trains_a_fallback_model_and_merges(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    folder = tmp_path / "neox"
    cfg = transformers.AutoConfig.for_model(
        "gpt_neox",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    with torch.device("cuda"):
        model = build_hf_model(fallback_model_config(read_folder_config(folder)), folder=folder)
    apply_fallback_adapter(model, AdapterConfig(kind="qlora", r=8, alpha=16, dropout=0.0))
    layers = lora_layers(model)
    assert layers and all(
        isinstance(layer.get_base_layer(), bnb.nn.Linear4bit) for layer in layers.values()
    )

    cycle = torch.tensor([11, 57, 103, 160, 201, 240], device="cuda")
    ids = cycle.repeat(4, 4)  # (4, 24): each token says the next one
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
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
    merged_state = merge_adapter(model)
    assert not any("lora_" in k or "base_layer" in k for k in merged_state)
    assert all(t.is_floating_point() for t in merged_state.values())
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder).cuda().eval()
    merged.load_state_dict(merged_state, strict=False)
    x = torch.randint(3, 256, (2, 20), device="cuda")
    with torch.no_grad():
        # the adapted model computes its NF4 bases in bfloat16: close, not equal
        torch.testing.assert_close(merged(input_ids=x).logits, model(x), atol=0.1, rtol=0.05)
