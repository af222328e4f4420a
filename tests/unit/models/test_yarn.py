"""YaRN rope scaling against transformers: its frequencies and attention factor for each
of its keys, tiny Llama, Qwen3 and Qwen2 models with it on import, export and greedy
generation, the config round trip, and the settings it refuses."""

import json
import math
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import load_hf_checkpoint, model_config_from_hf
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint, hf_config_from_model
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.schema import RopeScalingConfig
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.rope import ROPE_SCALING_TYPES, attention_scale, rope_inv_freq

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

# rope_parameters entries (besides rope_type and rope_theta), each with a head of 32 dims
YARN_SETTINGS = {
    "defaults": {"factor": 4.0, "original_max_position_embeddings": 32},
    "betas-untruncated": {
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "mscale-ratio": {
        "factor": 16.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    "mscale-alone-is-ignored": {
        "factor": 2.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.5,
    },
    "attention-factor-given": {
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "attention_factor": 1.25,
    },
    "factor-from-positions": {"factor": None, "original_max_position_embeddings": 16},
}


def _hf_yarn(settings: dict, theta: float = 10000.0):
    """transformers' YaRN frequencies and attention factor of a 32-dim head."""
    params = {"rope_type": "yarn", "rope_theta": theta, **settings}
    config = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=128, rope_parameters=params
    )
    return rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


@pytest.mark.parametrize("case", YARN_SETTINGS)
def test_frequencies_and_attention_factor_are_transformers(case):
    settings = YARN_SETTINGS[case]
    theirs, their_factor = _hf_yarn(settings, theta=1e4)
    params = {"rope_type": "yarn", **settings}
    theta, scaling = model_config_rope({"rope_parameters": params, "rope_theta": 1e4})
    assert scaling.type == "yarn"
    torch.testing.assert_close(rope_inv_freq(32, theta, scaling), theirs, atol=0, rtol=1e-6)
    assert attention_scale(scaling) == pytest.approx(their_factor, rel=1e-12)
    # a scale other than one multiplies every cos and sin, as transformers applies it
    assert (attention_scale(scaling) != 1) == (their_factor != 1)


def model_config_rope(hf: dict) -> tuple[float, RopeScalingConfig]:
    """RoPE theta and scaling that import reads from ``hf`` (a tiny Llama config.json)."""
    shape = {k: v for k, v in TINY_SHAPE.items() if v is not None}
    config = model_config_from_hf({"model_type": "llama", **shape, **hf})
    return config.rope_theta, config.rope_scaling


def test_yarn_is_a_declared_scaling_type_and_derives_its_factor():
    assert "yarn" in ROPE_SCALING_TYPES
    scaling = RopeScalingConfig(type="yarn", factor=4.0, original_max_seq_len=32)
    assert attention_scale(scaling) == pytest.approx(0.1 * math.log(4) + 1)
    assert attention_scale(replace(scaling, factor=1.0)) == 1.0
    assert attention_scale(replace(scaling, type="linear")) == 1.0
    # longrope's null attention_factor is transformers' derived one too
    longrope = RopeScalingConfig(type="longrope", factor=32.0, original_max_seq_len=4096)
    assert attention_scale(longrope) == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


# case -> (model_type, transformers' config and model classes, their settings)
CASES = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {}, YARN_SETTINGS["defaults"]),
    "llama-mscale": (
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": True},
        YARN_SETTINGS["mscale-ratio"],
    ),
    "qwen3": (
        "qwen3",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 32},
        YARN_SETTINGS["betas-untruncated"],
    ),
    "qwen2": (
        "qwen2",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {},
        YARN_SETTINGS["attention-factor-given"],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    model_type, config_name, model_name, shape, settings = CASES[case]
    rope = {"rope_type": "yarn", "rope_theta": 1e4, **settings}
    hf = nudged_hf_model(
        getattr(transformers, config_name),
        getattr(transformers, model_name),
        **{**TINY_SHAPE, "rms_norm_eps": 1e-6, **shape, "rope_parameters": rope},
    )
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert config.rope_scaling.type == "yarn"
    assert config.rope_scaling.original_max_seq_len == settings["original_max_position_embeddings"]
    x = tokens(VOCAB, 2, 100)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"]["rope_type"] == "yarn"
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert again.config.rope_parameters["rope_type"] == "yarn"
    torch.testing.assert_close(
        logits_of(again.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4
    )
    assert hf_greedy(again, 12) == hf_greedy(hf, 12)

    _, config_again = load_hf_checkpoint(out)  # the config round trip
    assert replace(config_again, name=config.name) == config


def test_a_preset_with_yarn_composes_and_exports(tmp_path):
    """YaRN set on the command line: composed, built, exported and computed by
    transformers as the library computes it, with its attention factor derived."""
    overrides = [
        "model=tiny",
        f"model.vocab_size={VOCAB}",
        "model.max_seq_len=128",
        "model.rope_scaling.type=yarn",
        "model.rope_scaling.factor=4",
        "model.rope_scaling.original_max_seq_len=32",
        "model.rope_scaling.beta_fast=16",
    ]
    config = to_run_config(compose_config(overrides)).model
    assert config.rope_scaling.attention_factor is None
    torch.manual_seed(0)
    model = Transformer(config).eval()
    out = export_hf_checkpoint(model, config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert "attention_factor" not in json.loads((out / "config.json").read_text())["rope_scaling"]
    x = tokens(VOCAB, 2, 60)
    torch.testing.assert_close(logits_of(hf.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"beta_fast": 1.0, "beta_slow": 2.0}, "needs beta_fast >= beta_slow > 0"),
        ({"beta_slow": 0.0}, "needs beta_fast >= beta_slow > 0"),
        ({"mscale": -1.0}, r"model.rope_scaling.mscale=-1.0 must be positive or null"),
        ({"attention_factor": 0.0}, "model.rope_scaling.attention_factor .or null. and"),
        ({"original_max_seq_len": 0}, "original_max_seq_len must be"),
        ({"factor": 0.0}, "model.rope_scaling.factor must be positive"),
    ],
)
def test_bad_yarn_settings_are_refused_in_one_line(changes, message):
    settings = {"factor": 4.0, "original_max_seq_len": 32, **changes}
    scaling = RopeScalingConfig(type="yarn", **settings)
    config = tiny_model_config(rope_scaling=scaling)
    with pytest.raises(ConfigError, match=message) as err:
        Transformer(config)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=message):
        hf_config_from_model(config)


def test_an_unknown_type_names_the_supported_ones():
    config = tiny_model_config(rope_scaling=RopeScalingConfig(type="ntk"))
    with pytest.raises(ConfigError, match="none | linear | llama3 | longrope | yarn"):
        Transformer(config)
    with pytest.raises(CheckpointError, match="'dynamic' is not supported; supported: .*yarn"):
        model_config_rope({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
