"""Qwen3 and OLMo 2 against transformers: import, export, generation and their refusals."""

import json
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import (
    load_hf_checkpoint,
    load_hf_weights_into,
    model_config_from_hf,
)
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint, hf_config_from_model
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES, family_of_hf

transformers = pytest.importorskip("transformers")

# model_type -> transformers' config and model classes
CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
}
# the native options each model_type reads as
OPTIONS = {
    "qwen3": {"family": "qwen3", "qk_norm": "head", "norm_placement": "pre"},
    "olmo2": {"family": "olmo2", "qk_norm": "full", "norm_placement": "post"},
}


# a tiny transformers config: 2 layers, width 64, 4 query and 2 KV heads
SHAPE = dict(TINY_SHAPE, rms_norm_eps=1e-6)


def hf_config(model_type: str, **overrides):
    """A tiny transformers config of ``model_type``: ``SHAPE`` with ``overrides``."""
    config_name, _ = CLASSES[model_type]
    return getattr(transformers, config_name)(**{**SHAPE, **overrides})


def hf_model(model_type: str, **overrides):
    """A transformers model of ``model_type``, every weight nudged from its init (unit
    norm gains would hide a misplaced norm), in eval mode and eager attention."""
    config_name, model_name = CLASSES[model_type]
    return nudged_hf_model(
        getattr(transformers, config_name),
        getattr(transformers, model_name),
        **{**SHAPE, **overrides},
    )


CASES = {
    "qwen3-tied-headdim": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3-untied-theta": (
        "qwen3",
        {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "olmo2": ("olmo2", {}),
    "olmo2-mha-theta": (
        "olmo2",
        {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    model_type, overrides = CASES[case]
    hf = hf_model(model_type, **overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    for key, value in OPTIONS[model_type].items():
        assert getattr(config, key) == value
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert (config.head_dim or 64 // 4) == overrides.get("head_dim", 16)  # 32 * 4 != 64
    assert not config.qkv_bias and config.max_seq_len == 128
    x = tokens(VOCAB, 2, 100)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # the KV-cached greedy decoding of the library is transformers' greedy decoding
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == model_type
    assert written["architectures"] == [CLASSES[model_type][1]]
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == CLASSES[model_type][1]
    again.eval()
    torch.testing.assert_close(logits_of(again, x), logits_of(model, x), atol=1e-4, rtol=1e-4)
    if model_type == "olmo2":
        assert again.model.embed_tokens.padding_idx is None  # every row trains, as ours

    # and back: the same config and tensors
    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("model_type", CLASSES)
def test_native_model_exports_to_transformers(tmp_path, model_type):
    options = OPTIONS[model_type]
    shape = {"vocab_size": VOCAB, "dim": 64, "ffn_dim": 96, "max_seq_len": 64, "head_dim": 32}
    config = tiny_model_config(**shape, **options)  # 4 x 32 heads != dim 64
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():  # unit gains on the new norms would hide a misplaced one
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = export_hf_checkpoint(model, config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    x = tokens(VOCAB, 2, 60)
    torch.testing.assert_close(logits_of(hf.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4)
    assert generate(model, PROMPT, 10) == hf_greedy(hf, 10)


@pytest.mark.parametrize("model_type", CLASSES)
def test_every_tensor_has_a_name_both_ways(model_type):
    options = OPTIONS[model_type]
    with torch.device("meta"):
        model = Transformer(tiny_model_config(**options))
    names = FAMILIES[options["family"]].names
    for name in model.state_dict():
        hf_name = names.to_hf(name)
        assert hf_name is not None and names.to_native(hf_name) == name, name
    assert (
        names.to_hf("layers.1.attention.q_norm.weight") == "model.layers.1.self_attn.q_norm.weight"
    )
    if model_type == "olmo2":
        assert names.to_hf("layers.0.ffn_norm.weight") == (
            "model.layers.0.post_feedforward_layernorm.weight"
        )
        assert names.to_native("model.layers.0.input_layernorm.weight") is None
    assert family_of_hf(model_type).name == options["family"]


def test_hf_weights_load_into_a_configured_model_and_differences_are_named(tmp_path):
    hf = hf_model("olmo2")
    hf.save_pretrained(tmp_path)
    _, config = load_hf_checkpoint(tmp_path)
    torch.manual_seed(3)
    model = Transformer(replace(config, name="mine", max_seq_len=64)).eval()
    load_hf_weights_into(model, tmp_path, "stage.init_from='x'")
    x = tokens(VOCAB, 2, 60)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)

    llama = Transformer(replace(config, family="llama", qk_norm="none", norm_placement="pre"))
    with pytest.raises(CheckpointError) as err:
        load_hf_weights_into(llama, tmp_path, "stage.init_from='x'")
    message = str(err.value)
    assert "model.qk_norm='none' vs qk_norm='full'" in message
    assert "model.norm_placement='pre' vs norm_placement='post'" in message


@pytest.mark.parametrize("model_type", CLASSES)
def test_attention_bias_is_refused(model_type):
    config = hf_config(model_type, attention_bias=True).to_dict()
    with pytest.raises(CheckpointError, match=f"{model_type}: attention_bias=true"):
        model_config_from_hf(config)


def test_qwen3_sliding_window_limits_the_context():
    config = hf_config("qwen3", sliding_window=16).to_dict()
    assert config["sliding_window"] is None  # transformers drops it without use_sliding_window
    assert model_config_from_hf(config).max_seq_len == 128
    config = hf_config("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert model_config_from_hf(config.to_dict()).max_seq_len == 16
    with pytest.raises(CheckpointError, match="exceeds sliding_window=16"):
        model_config_from_hf(config.to_dict(), max_seq_len=32)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("qwen3", {"qkv_bias": True}, "model.family=qwen3 with model.qkv_bias=True"),
        ("qwen3", {"qk_norm": "full"}, "model.family=qwen3 with model.qk_norm='full'"),
        ("qwen3", {"norm_placement": "post"}, "model.family=qwen3 with model.norm_placement"),
        ("olmo2", {"qk_norm": "head"}, "model.family=olmo2 with model.qk_norm='head'"),
        ("olmo2", {"norm_placement": "pre"}, "model.family=olmo2 with model.norm_placement"),
        ("llama", {"qk_norm": "head"}, "model.family=llama with model.qk_norm='head'"),
        ("qwen2", {"norm_placement": "post"}, "model.family=qwen2 with model.norm_placement"),
    ],
)
def test_options_a_family_cannot_have_are_refused(family, changes, message):
    options = {**OPTIONS.get(family, {}), "family": family, "qkv_bias": family == "qwen2"}
    config = tiny_model_config(**{**options, **changes})
    with pytest.raises(ConfigError, match=message) as err:
        hf_config_from_model(config)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=message):
        Transformer(config)
