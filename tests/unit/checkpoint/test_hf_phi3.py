"""Phi-3 against transformers: fused qkv_proj / gate_up_proj split on import and stacked
on export, partial rotation (``model.partial_rotary_factor``) and LongRoPE, on import,
export and generation, and its refusals."""

import json
import math
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import (
    load_hf_checkpoint,
    load_hf_weights_into,
    model_config_from_hf,
)
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint, hf_config_from_model
from recipes_lib.checkpoint.source import fill_model_from_init, recorded_model
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.schema import RopeScalingConfig, resolved_model_fields
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES, family_of_hf
from recipes_lib.models.rope import apply_rope

transformers = pytest.importorskip("transformers")


def factors(n, seed):
    """``n`` per-frequency LongRoPE factors in [1, 4)."""
    return (1 + 3 * torch.rand(n, generator=torch.Generator().manual_seed(seed))).tolist()


def hf_settings(partial=0.5, rope=None, **overrides):
    """The settings of a tiny Phi-3 config: 2 layers, width 64, 4 query and 2 KV heads
    (head dim 16)."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            **(rope or {}),
        },
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    return {**settings, **overrides}


def hf_config(**overrides):
    """A tiny Phi-3 config (``partial`` and ``rope`` as in ``hf_settings``)."""
    return transformers.Phi3Config(**hf_settings(**overrides))


def hf_model(**overrides):
    """A transformers Phi-3, every weight nudged from its init, eval mode, eager."""
    return nudged_hf_model(
        transformers.Phi3Config, transformers.Phi3ForCausalLM, **hf_settings(**overrides)
    )


def longrope(original=32, **extra):
    """LongRoPE over the 8 rotated dims' 4 frequencies, switching past ``original``."""
    return {
        "rope": {
            "rope_type": "longrope",
            "short_factor": factors(4, 1),
            "long_factor": factors(4, 2),
            **extra,
        },
        "original_max_position_embeddings": original,
    }


# case -> transformers overrides
CASES = {
    "half-rotary-untied": {"tie_word_embeddings": False},
    "three-quarters-tied-mha": {
        "partial": 0.75,
        "tie_word_embeddings": True,
        "num_key_value_heads": 4,
    },
    "whole-head": {"partial": 1.0, "rope": {"rope_theta": 5e5}},
    # factor from max_position_embeddings / original: 128 / 32 = 4
    "longrope-derived-factor": longrope(),
    "longrope-given-factors": longrope(original=48, factor=2.0, attention_factor=1.3),
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    overrides = CASES[case]
    hf = hf_model(**overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert config.family == "phi3" and config.max_seq_len == 128
    assert config.partial_rotary_factor == overrides.get("partial", 0.5)
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert model.rope_cos.shape[-1] == int(16 * config.partial_rotary_factor)
    long = case.startswith("longrope")
    assert config.rope_scaling.type == ("longrope" if long else "none")
    # 100 tokens: past original_max_position_embeddings (the long factors) with longrope
    for length in (100, 20):
        x = tokens(VOCAB, 2, length)
        torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # the KV-cached greedy decoding of the library is transformers' greedy decoding (with
    # longrope: 7 + 50 tokens cross original_max_position_embeddings mid-generation)
    greedy = hf_greedy(hf, 50)
    assert generate(model, PROMPT, 50) == greedy
    if long:  # the cache run again at the switch: as decoding without one
        assert generate(model, PROMPT, 50, use_cache=False) == greedy

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("phi3", ["Phi3ForCausalLM"])
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == "Phi3ForCausalLM"
    again.eval()
    assert again.model.embed_tokens.padding_idx is None  # every row trains, as ours
    for name, tensor in hf.state_dict().items():  # the fused tensors stacked back
        torch.testing.assert_close(again.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
    for length in (100, 20):
        x = tokens(VOCAB, 2, length, seed=1)
        torch.testing.assert_close(logits_of(again, x), logits_of(model, x), atol=1e-4, rtol=1e-4)
    assert hf_greedy(again, 50) == hf_greedy(hf, 50)

    # and back: the same config and tensors
    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_longrope_attention_factor_and_switch_are_transformers():
    hf = hf_model(**longrope())
    config = model_config_from_hf(hf.config.to_dict())
    scaling = config.rope_scaling
    assert (scaling.factor, scaling.original_max_seq_len) == (4.0, 32)
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
    model = Transformer(config)
    # the short tables up to position 32, the long ones for a forward that goes past it
    assert not torch.equal(model.rope_cos, model.rope_cos_long)
    # without the long tables (the short ones throughout), parity past 32 is lost
    load_like = Transformer(config).eval()
    load_like.load_state_dict(model.state_dict())
    load_like.rope_cos_long, load_like.rope_sin_long = load_like.rope_cos, load_like.rope_sin
    x = tokens(VOCAB, 1, 40)
    assert not torch.allclose(logits_of(load_like, x), logits_of(model, x), atol=1e-3)
    assert torch.equal(logits_of(load_like, x[:, :32]), logits_of(model, x[:, :32]))


def native_config(**overrides):
    shape = {"vocab_size": VOCAB, "dim": 64, "ffn_dim": 96, "max_seq_len": 64, "n_kv_heads": 2}
    return tiny_model_config(
        **{**shape, "family": "phi3", "partial_rotary_factor": 0.25, **overrides}
    )


def test_native_model_exports_to_transformers(tmp_path):
    config = native_config(tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = export_hf_checkpoint(model, config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.25
    x = tokens(VOCAB, 2, 60)
    torch.testing.assert_close(logits_of(hf.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4)
    assert generate(model, PROMPT, 10) == hf_greedy(hf, 10)


def test_every_tensor_has_a_name_both_ways():
    with torch.device("meta"):
        model = Transformer(native_config())
    names = FAMILIES["phi3"].names
    fused = {}
    for name in model.state_dict():
        into = names.fused_of(name)
        if into is None:
            hf_name = names.to_hf(name)
            assert hf_name is not None and names.to_native(hf_name) == name, name
        else:
            fused.setdefault(into[0], []).append(name)
    stacked = ("mlp.gate_up_proj", "self_attn.qkv_proj")
    assert sorted(fused) == [f"model.layers.{i}.{hf}.weight" for i in (0, 1) for hf in stacked]
    for hf_name, parts in fused.items():
        assert names.fused_parts(hf_name) == parts
    assert family_of_hf("phi3").name == "phi3"


def test_hf_weights_load_into_a_configured_model_and_differences_are_named(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    _, config = load_hf_checkpoint(tmp_path)
    torch.manual_seed(3)
    model = Transformer(replace(config, name="mine", max_seq_len=64)).eval()
    load_hf_weights_into(model, tmp_path, "stage.init_from='x'")
    x = tokens(VOCAB, 2, 60)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)

    whole = Transformer(replace(config, partial_rotary_factor=1.0))
    with pytest.raises(CheckpointError, match="model.partial_rotary_factor=1.0 vs partial_rot"):
        load_hf_weights_into(whole, tmp_path, "stage.init_from='x'")
    wider = Transformer(replace(config, ffn_dim=64))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        load_hf_weights_into(wider, tmp_path, "stage.init_from='x'")


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    hf_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_key_value_heads"] = 1  # k and v of 16 rows each: 96 rows, not 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"qkv_proj.weight: checkpoint \(128, 64\) vs model"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_bias": True}, "phi3: attention_bias=true"),
        ({"mlp_bias": True}, "phi3: mlp_bias=true"),
        ({"hidden_act": "gelu"}, "phi3: hidden_act='gelu'"),
        ({"head_dim": 32}, "phi3: head_dim=32 is not hidden_size"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "phi3: rope_scaling type 'linear' is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "longrope", "long_factor": [1.0] * 4}},
            "no 'short_factor'",
        ),
    ],
)
def test_what_the_decoder_cannot_compute_is_refused(overrides, message):
    config = {**hf_config().to_dict(), **overrides}
    with pytest.raises(CheckpointError, match=message) as err:
        model_config_from_hf(config)
    assert "\n" not in str(err.value)


def test_sliding_window_limits_the_context():
    assert model_config_from_hf(hf_config().to_dict()).max_seq_len == 128
    config = hf_config(sliding_window=16).to_dict()
    assert model_config_from_hf(config).max_seq_len == 16
    with pytest.raises(CheckpointError, match="exceeds sliding_window=16"):
        model_config_from_hf(config, max_seq_len=32)


def _scaling(**changes):
    base = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    return RopeScalingConfig(**{**base, **changes})


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("phi3", {"qkv_bias": True}, "model.family=phi3 with model.qkv_bias=True"),
        ("phi3", {"qk_norm": "head"}, "model.family=phi3 with model.qk_norm='head'"),
        ("phi3", {"nope_layers": [1]}, r"model.family=phi3 with model.nope_layers=\[1\]"),
        ("phi3", {"head_dim": 16}, "model.family=phi3 with model.head_dim=16"),
        (
            "phi3",
            {"rope_scaling": RopeScalingConfig(type="linear", factor=2.0)},
            "model.family=phi3 with model.rope_scaling.type='linear'",
        ),
        ("phi3", {"partial_rotary_factor": 0.0}, r"partial_rotary_factor=0.0 must be in \(0, 1\]"),
        ("phi3", {"partial_rotary_factor": 1.5}, "model.partial_rotary_factor=1.5 must be in"),
        ("phi3", {"partial_rotary_factor": 0.2}, r"rotates int\(8 \* 0.2\) = 1 dims"),
        (
            "phi3",
            {"rope_scaling": _scaling(short_factor=[1.0] * 3)},
            "model.rope_scaling.short_factor must hold 4",
        ),
        (
            "phi3",
            {"rope_scaling": _scaling(long_factor=[1.0, 0.0, 1.0, 1.0])},
            "model.rope_scaling.long_factor must hold 4 positive",
        ),
        (
            "phi3",
            {"rope_scaling": _scaling(attention_factor=0.0)},
            "model.rope_scaling.attention_factor",
        ),
        (
            "llama",
            {"partial_rotary_factor": 0.5},
            "model.family=llama with model.partial_rotary_factor=0.5",
        ),
        (
            "qwen2",
            {"qkv_bias": True, "rope_scaling": _scaling()},
            "model.family=qwen2 with model.rope_scaling.type='longrope'",
        ),
    ],
)
def test_options_a_family_cannot_have_are_refused(family, changes, message):
    config = tiny_model_config(**{"family": family, **changes})  # head dim 8
    with pytest.raises(ConfigError, match=message) as err:
        Transformer(config)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=message):
        hf_config_from_model(config) if "model.family=" in message else Transformer(config)


def test_the_defaults_rotate_whole_heads_as_before():
    model = Transformer(tiny_model_config())  # head dim 8
    assert sorted(n for n, _ in model.named_buffers()) == ["rope_cos", "rope_sin"]
    cos, sin = model.rope_cos[:20], model.rope_sin[:20]
    assert cos.shape == (20, 8)
    q = torch.randn(2, 4, 20, 8)
    x1, x2 = q.chunk(2, dim=-1)
    assert torch.equal(apply_rope(q, cos, sin), q * cos + torch.cat([-x2, x1], dim=-1) * sin)
    # a narrower table rotates the first dims and passes the rest through
    half = apply_rope(q, model.rope_cos[:20, :4], model.rope_sin[:20, :4])
    assert torch.equal(half[..., 4:], q[..., 4:])


def test_fields_a_record_leaves_out_compare_as_their_defaults():
    partial = {
        "family": "llama",
        "vocab_size": 64,
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "ffn_dim": 64,
        "max_seq_len": 32,
        "rope_scaling": {"type": "none", "factor": 1.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_seq_len": 8192},
    }  # fmt: skip
    assert recorded_model(partial) == partial  # read as recorded, nothing guessed
    now = tiny_model_config(n_kv_heads=None)
    roles = ("shape", "compute", "context")
    assert resolved_model_fields(partial, *roles) == resolved_model_fields(now, *roles)
    assert resolved_model_fields(partial, *roles) != resolved_model_fields(
        tiny_model_config(n_kv_heads=None, partial_rotary_factor=0.5), *roles
    )


def test_the_phi4_mini_preset_has_transformers_parameter_count():
    cfg = to_run_config(compose_config(["model=phi4_mini"]))
    assert cfg.model.partial_rotary_factor == 0.75
    with torch.device("meta"):
        ours = Transformer(cfg.model)
        theirs = transformers.Phi3ForCausalLM(
            transformers.Phi3Config(
                vocab_size=200064,
                hidden_size=3072,
                intermediate_size=8192,
                num_hidden_layers=32,
                num_attention_heads=24,
                num_key_value_heads=8,
                tie_word_embeddings=True,
                max_position_embeddings=131072,
                original_max_position_embeddings=4096,
                pad_token_id=None,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.75,
                    "short_factor": list(cfg.model.rope_scaling.short_factor),
                    "long_factor": list(cfg.model.rope_scaling.long_factor),
                },
            )
        )
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters())
    assert ours.rope_cos.shape == ours.rope_cos_long.shape == (131072, 96)
    # the preset is what its config.json reads as (the attention factor transformers uses)
    read = model_config_from_hf(theirs.config.to_dict())
    assert replace(read, name="phi4_mini") == replace(cfg.model, init_std=read.init_std)
    assert cfg.model.rope_scaling.attention_factor == theirs.model.rotary_emb.attention_scaling


def test_model_from_init_takes_rope_options_from_the_folder(tmp_path):
    hf_model(**longrope()).save_pretrained(tmp_path)
    filled = to_run_config(
        fill_model_from_init(compose_config(["recipe=sft/full", f"stage.init_from={tmp_path}"]))
    )
    assert (filled.model.family, filled.model.partial_rotary_factor) == ("phi3", 0.5)
    assert filled.model.rope_scaling.type == "longrope"
    assert filled.model.rope_scaling.long_factor == pytest.approx(factors(4, 2))
    Transformer(filled.model)
