"""SmolLM3 against transformers: layers without RoPE (``no_rope_layers`` <->
``model.nope_layers``) on import, export and generation, and its refusals."""

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
from recipes_lib.checkpoint.source import fill_model_from_init
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES, family_of_hf

transformers = pytest.importorskip("transformers")


# a tiny SmolLM3 config: 4 layers, width 64, 4 query and 2 KV heads
SHAPE = dict(TINY_SHAPE, num_hidden_layers=4, rms_norm_eps=1e-6)


def hf_config(**overrides):
    """A tiny SmolLM3 config: ``SHAPE`` with ``overrides``."""
    return transformers.SmolLM3Config(**{**SHAPE, **overrides})


def hf_model(**overrides):
    """A transformers SmolLM3, every weight nudged from its init, eval mode, eager."""
    return nudged_hf_model(
        transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, **{**SHAPE, **overrides}
    )


# case -> (transformers overrides, their per-layer flags: 1 RoPE, 0 NoPE)
CASES = {
    # transformers' default: every 4th layer without RoPE
    "interval-default-tied": ({"tie_word_embeddings": True}, [1, 1, 1, 0]),
    "interval-2-untied-theta": (
        {
            "no_rope_layer_interval": 2,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        },
        [1, 0, 1, 0],
    ),
    "explicit-list-mha": (
        {"no_rope_layers": [0, 1, 1, 0], "num_key_value_heads": 4, "tie_word_embeddings": True},
        [0, 1, 1, 0],
    ),
    "every-layer-rope": ({"no_rope_layers": [1, 1, 1, 1]}, [1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    overrides, flags = CASES[case]
    hf = hf_model(**overrides)
    assert [int(f) for f in hf.config.no_rope_layers] == flags  # their meaning, as we read it
    assert [bool(layer.self_attn.use_rope) for layer in hf.model.layers] == [bool(f) for f in flags]
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    nope = [layer for layer, flag in enumerate(flags) if not flag]
    assert (config.family, config.nope_layers) == ("smollm3", nope)
    assert [layer.attention.use_rope for layer in model.layers] == [bool(f) for f in flags]
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", True)
    assert not config.qkv_bias and config.max_seq_len == 128
    x = tokens(VOCAB, 2, 100)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # the KV-cached greedy decoding of the library is transformers' greedy decoding
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "smollm3"
    assert written["architectures"] == ["SmolLM3ForCausalLM"]
    assert written["no_rope_layers"] == flags
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == "SmolLM3ForCausalLM"
    again.eval()
    assert again.model.embed_tokens.padding_idx is None  # every row trains, as ours
    torch.testing.assert_close(logits_of(again, x), logits_of(model, x), atol=1e-4, rtol=1e-4)

    # and back: the same config and tensors
    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def native_config(**overrides):
    shape = {"vocab_size": VOCAB, "dim": 64, "ffn_dim": 96, "max_seq_len": 64, "n_kv_heads": 2}
    return tiny_model_config(
        **{**shape, "family": "smollm3", "n_layers": 3, "nope_layers": [0, 2], **overrides}
    )


def test_native_model_exports_to_transformers(tmp_path):
    config = native_config()
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = export_hf_checkpoint(model, config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert [bool(layer.self_attn.use_rope) for layer in hf.model.layers] == [False, True, False]
    x = tokens(VOCAB, 2, 60)
    torch.testing.assert_close(logits_of(hf.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4)
    assert generate(model, PROMPT, 10) == hf_greedy(hf, 10)
    # the default (no NoPE layers) is written as every flag 1
    assert hf_config_from_model(replace(config, nope_layers=[]))["no_rope_layers"] == [1] * 3


def test_every_tensor_has_a_name_both_ways():
    with torch.device("meta"):
        model = Transformer(native_config())
    names = FAMILIES["smollm3"].names
    for name in model.state_dict():
        hf_name = names.to_hf(name)
        assert hf_name is not None and names.to_native(hf_name) == name, name
    assert family_of_hf("smollm3").name == "smollm3"


def test_hf_weights_load_into_a_configured_model_and_differences_are_named(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    _, config = load_hf_checkpoint(tmp_path)
    torch.manual_seed(3)
    model = Transformer(replace(config, name="mine", max_seq_len=64)).eval()
    load_hf_weights_into(model, tmp_path, "stage.init_from='x'")
    x = tokens(VOCAB, 2, 60)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)

    every_layer = Transformer(replace(config, nope_layers=[]))
    with pytest.raises(CheckpointError, match=r"model.nope_layers=\[\] vs nope_layers=\[3\]"):
        load_hf_weights_into(every_layer, tmp_path, "stage.init_from='x'")
    all_rope = tmp_path / "all"
    hf_model(no_rope_layers=[1, 1, 1, 1]).save_pretrained(all_rope)
    load_hf_weights_into(every_layer, all_rope, "stage.init_from='x'")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_bias": True}, "smollm3: attention_bias=true"),
        ({"mlp_bias": True}, "smollm3: mlp_bias=true"),
        ({"no_rope_layers": [1, 0]}, r"smollm3: no_rope_layers=\[1, 0\] must hold"),
        ({"no_rope_layers": [1, 2, 1, 1]}, "smollm3: no_rope_layers="),
    ],
)
def test_what_the_decoder_cannot_compute_is_refused(overrides, message):
    config = {**hf_config().to_dict(), **overrides}
    with pytest.raises(CheckpointError, match=message) as err:
        model_config_from_hf(config)
    assert "\n" not in str(err.value)


def test_a_config_json_without_the_list_reads_the_interval():
    config = hf_config().to_dict()
    del config["no_rope_layers"]
    assert model_config_from_hf(config).nope_layers == [3]
    config["no_rope_layer_interval"] = 2
    assert model_config_from_hf(config).nope_layers == [1, 3]
    longer = {**hf_config().to_dict(), "no_rope_layers": [1, 0, 1, 1, 0, 0]}  # the first 4
    assert model_config_from_hf(longer).nope_layers == [1]


def test_sliding_window_limits_the_context():
    config = hf_config(sliding_window=16)  # without use_sliding_window: no layer slides
    assert model_config_from_hf(config.to_dict()).max_seq_len == 128
    config = hf_config(use_sliding_window=True, sliding_window=16)  # the NoPE layer slides
    assert config.layer_types == ["full_attention"] * 3 + ["sliding_attention"]
    assert model_config_from_hf(config.to_dict()).max_seq_len == 16
    without_types = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
    assert model_config_from_hf(without_types).max_seq_len == 16
    with pytest.raises(CheckpointError, match="exceeds sliding_window=16"):
        model_config_from_hf(config.to_dict(), max_seq_len=32)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("smollm3", {"qkv_bias": True}, "model.family=smollm3 with model.qkv_bias=True"),
        ("smollm3", {"qk_norm": "head"}, "model.family=smollm3 with model.qk_norm='head'"),
        ("smollm3", {"norm_placement": "post"}, "model.family=smollm3 with model.norm_placement"),
        ("llama", {"nope_layers": [1]}, r"model.family=llama with model.nope_layers=\[1\]"),
        ("qwen3", {"nope_layers": [0]}, "model.family=qwen3 with model.nope_layers"),
    ],
)
def test_options_a_family_cannot_have_are_refused(family, changes, message):
    qwen3 = {"qk_norm": "head"} if family == "qwen3" else {}
    config = tiny_model_config(**{"family": family, **qwen3, **changes})
    with pytest.raises(ConfigError, match=message) as err:
        hf_config_from_model(config)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=message):
        Transformer(config)


def test_the_3b_preset_has_transformers_parameter_count():
    cfg = to_run_config(compose_config(["model=smollm3_3b"]))
    assert cfg.model.nope_layers == [i for i in range(36) if (i + 1) % 4 == 0]
    with torch.device("meta"):
        ours = Transformer(cfg.model)
        theirs = transformers.SmolLM3ForCausalLM(
            transformers.SmolLM3Config(
                max_position_embeddings=65536,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6},
            )
        )
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters())
    assert hf_config_from_model(cfg.model)["no_rope_layers"] == theirs.config.no_rope_layers


def test_model_from_init_takes_the_flags_from_the_folder(tmp_path):
    hf_model(no_rope_layers=[1, 0, 0, 1]).save_pretrained(tmp_path)
    filled = to_run_config(
        fill_model_from_init(compose_config(["recipe=sft/full", f"stage.init_from={tmp_path}"]))
    )
    assert (filled.model.family, filled.model.nope_layers) == ("smollm3", [1, 2])
    Transformer(filled.model)
