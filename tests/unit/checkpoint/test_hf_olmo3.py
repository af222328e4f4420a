"""OLMo 3 against transformers: OLMo 2's post-norm blocks with local and global layers,
RoPE per kind of layer (YaRN on the global ones, as the published models have it), on
import, export and generation past the window; the config.json of transformers 4's form
the published folders ship; and its refusals."""

import json
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import load_hf_checkpoint, model_config_from_hf
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.config.schema import RopeScalingConfig
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES, family_of_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(TINY_SHAPE, num_hidden_layers=4, rms_norm_eps=1e-6)
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def hf_model(**overrides):
    return nudged_hf_model(
        transformers.Olmo3Config, transformers.Olmo3ForCausalLM, **{**SHAPE, **overrides}
    )


# case -> (transformers overrides, the local layers, the local layers' own RoPE base)
CASES = {
    # a window shorter than the input and the generation; YaRN on the global layer, the
    # local ones unscaled with a base of their own
    "yarn-global-own-local-base": (
        {
            "layer_types": LOCAL_GLOBAL,
            "sliding_window": 8,
            "rope_parameters": {
                "full_attention": {**YARN, "rope_theta": 1e4, "beta_fast": 16},
                "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
            },
        },
        [0, 2, 3],
        2e4,
    ),
    # transformers' default pattern (every fourth layer global), MHA, unscaled
    "default-pattern-mha": ({"sliding_window": 5, "num_key_value_heads": 4}, [0, 1, 2], 5e5),
    # every layer scaled alike: the local layers share the global tables
    "local-scaled-as-global": (
        {
            "layer_types": LOCAL_GLOBAL,
            "sliding_window": 6,
            "rope_parameters": {
                "full_attention": {**YARN, "rope_theta": 1e4, "attention_factor": 1.3},
                "sliding_attention": {**YARN, "rope_theta": 1e4, "attention_factor": 1.3},
            },
        },
        [0, 2, 3],
        None,
    ),
    "all-global": ({"layer_types": ["full_attention"] * 4}, [], None),
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    overrides, local, local_theta = CASES[case]
    hf = hf_model(**overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert (config.family, config.window_layers) == ("olmo3", local)
    assert (config.qk_norm, config.norm_placement) == ("full", "post")
    assert config.local_rope_theta == local_theta and not config.tie_embeddings
    assert [layer.attention.window for layer in model.layers] == [
        config.sliding_window if i in local else None for i in range(config.n_layers)
    ]
    x = tokens(VOCAB, 2, 100)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # the KV-cached greedy decoding, past the window, is transformers' greedy decoding
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("olmo3", ["Olmo3ForCausalLM"])
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == "Olmo3ForCausalLM"
    assert again.model.embed_tokens.padding_idx is None  # every row trains, as ours
    torch.testing.assert_close(
        logits_of(again.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4
    )
    assert hf_greedy(again, 12) == hf_greedy(hf, 12)

    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_the_published_config_form_reads_as_transformers_reads_it(tmp_path):
    """``rope_theta`` and a YaRN ``rope_scaling`` beside ``layer_types``, as the published
    OLMo 3 folders (written by transformers 4) spell them: YaRN on the global layers."""
    hf = hf_model(layer_types=LOCAL_GLOBAL, sliding_window=8)
    hf.save_pretrained(tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    del config_json["rope_parameters"]
    published = {"attention_factor": 1.2, "beta_fast": 32, "beta_slow": 1, **YARN}
    config_json.update(rope_theta=500000, rope_scaling=published)
    (tmp_path / "config.json").write_text(json.dumps(config_json))

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert theirs.config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    model, config = load_hf_checkpoint(tmp_path)
    assert config.rope_scaling.type == "yarn" and config.rope_scaling.attention_factor == 1.2
    assert (config.rope_theta, config.local_rope_theta) == (5e5, 5e5)
    x = tokens(VOCAB, 2, 60)
    torch.testing.assert_close(logits_of(model, x), logits_of(theirs, x), atol=1e-4, rtol=1e-4)


def test_every_tensor_has_a_name_both_ways():
    config = model_config_from_hf(hf_model(layer_types=LOCAL_GLOBAL).config.to_dict())
    with torch.device("meta"):
        model = Transformer(config)
    names = FAMILIES["olmo3"].names
    for name in model.state_dict():
        hf_name = names.to_hf(name)
        assert hf_name is not None and names.to_native(hf_name) == name, name
    assert family_of_hf("olmo3").name == "olmo3"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_bias": True}, "olmo3: attention_bias=true"),
        ({"layer_types": ["sliding_attention", "bogus"]}, "olmo3: layer_types must name"),
        (
            {
                "rope_parameters": {
                    "full_attention": {**YARN, "rope_theta": 1e4, "truncate": False},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "olmo3: rope_parameters.full_attention.truncate=false is not supported",
        ),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "olmo3: the sliding layers' rope type 'linear' differs",
        ),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "rope_parameters": None},
            "rope scaling type 'dynamic' is not supported",
        ),
    ],
)
def test_what_the_decoder_cannot_compute_is_refused(changes, message):
    config = {**hf_model(layer_types=LOCAL_GLOBAL).config.to_dict(), **changes}
    with pytest.raises(CheckpointError, match=message) as err:
        model_config_from_hf(config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"norm_placement": "pre"}, "model.family=olmo3 with model.norm_placement='pre'"),
        ({"qk_norm": "head"}, "model.family=olmo3 with model.qk_norm='head'"),
        ({"window_layers": [0], "sliding_window": None}, "needs model.sliding_window"),
        # its export would be read back untruncated
        (
            {
                "rope_scaling": RopeScalingConfig(
                    type="yarn", factor=4.0, original_max_seq_len=16, truncate=False
                )
            },
            "model.rope_scaling.truncate=False",
        ),
    ],
)
def test_options_olmo3_cannot_have_are_refused(changes, message):
    options = {**FAMILIES["olmo3"].fixed, "family": "olmo3", "sliding_window": 4}
    config = tiny_model_config(**{**options, **changes})
    with pytest.raises(ConfigError, match=message) as err:
        Transformer(config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("preset", "count"),
    [
        ("olmo3_7b", 7_298_011_136),  # Olmo-3-1025-7B's safetensors total
        ("olmo3_32b", 32_233_522_176),
    ],
)
def test_the_presets_have_the_published_parameter_counts(preset, count):
    from recipes_lib.config import compose_config, to_run_config

    config = to_run_config(compose_config([f"model={preset}"])).model
    with torch.device("meta"):
        model = Transformer(config)
    assert model.num_params() == count
