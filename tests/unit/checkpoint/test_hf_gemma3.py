"""Gemma 3 (text) against transformers: local and global layers with their own RoPE
bases, the (1 + w) norms on both sides of each sublayer, scaled embeddings, GeGLU and
query_pre_attn_scalar, on import, export and generation; and its refusals."""

import json
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import (
    load_hf_checkpoint,
    model_config_from_hf,
)
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint, hf_config_from_model
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES

transformers = pytest.importorskip("transformers")

# head_dim 4 x 32 != width 64: its own setting, as in every published size
SHAPE = dict(TINY_SHAPE, num_hidden_layers=4, head_dim=32)
GEMMA_OPTIONS = dict(FAMILIES["gemma3"].fixed)  # what model.family=gemma3 fixes
LOCAL_GLOBAL = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def hf_model(**overrides):
    return nudged_hf_model(
        transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, **{**SHAPE, **overrides}
    )


# case -> (transformers overrides, the local layers)
CASES = {
    # a window shorter than the input and the prompt plus its generation; the softmax
    # scale of query_pre_attn_scalar != head_dim; the global layers' RoPE scaled
    "window-8-scaled-global-rope": (
        {
            "layer_types": LOCAL_GLOBAL,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        [0, 1, 3],
    ),
    # transformers' default pattern (every sixth layer global), untied, MHA
    "default-pattern-untied": (
        {
            "num_hidden_layers": 6,
            "sliding_window": 5,
            "tie_word_embeddings": False,
            "num_key_value_heads": 4,
        },
        [0, 1, 2, 3, 4],
    ),
    # every layer global: no window at all
    "all-global": ({"layer_types": ["full_attention"] * 4}, []),
    # YaRN on the global layers
    "yarn-global": (
        {
            "layer_types": LOCAL_GLOBAL,
            "sliding_window": 8,
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        [0, 1, 3],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    overrides, local = CASES[case]
    hf = hf_model(**overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert (config.family, config.window_layers) == ("gemma3", local)
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", True)
    assert config.head_dim == 32 and config.norm_placement == "both"
    assert [layer.attention.window for layer in model.layers] == [
        config.sliding_window if i in local else None for i in range(config.n_layers)
    ]
    x = tokens(VOCAB, 2, 40)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # the KV-cached greedy decoding, past the window, is transformers' greedy decoding
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (
        "gemma3_text",
        ["Gemma3ForCausalLM"],
    )
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == "Gemma3ForCausalLM"
    torch.testing.assert_close(
        logits_of(again.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4
    )
    for name, theirs in hf.state_dict().items():  # the gains go back as transformers keeps them
        torch.testing.assert_close(again.state_dict()[name], theirs, atol=1e-6, rtol=0, msg=name)

    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config


def test_flex_applies_the_window_within_each_document():
    hf = hf_model(layer_types=LOCAL_GLOBAL, sliding_window=6)
    config = model_config_from_hf(hf.config.to_dict())
    torch.manual_seed(0)
    sdpa = Transformer(config, "sdpa").eval()
    flex = Transformer(config, "flex").eval()
    flex.load_state_dict(sdpa.state_dict())
    x = tokens(VOCAB, 1, 30)
    doc_ids = torch.tensor([[0] * 11 + [1] * 19])  # two documents packed in one row
    with torch.no_grad():
        packed = flex(x, doc_ids)
        first, second = sdpa(x[:, :11]), sdpa(x[:, 11:])
    torch.testing.assert_close(packed[:, :11], first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, 11:], second, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # and flex without documents is sdpa's windowed attention
        torch.testing.assert_close(flex(x), sdpa(x), atol=1e-5, rtol=1e-5)


def test_local_layers_see_only_their_window():
    config = model_config_from_hf(
        hf_model(layer_types=["sliding_attention"] * 4, sliding_window=4).config.to_dict()
    )
    torch.manual_seed(0)
    model = Transformer(config).eval()
    x = tokens(VOCAB, 1, 20)
    changed = x.clone()
    changed[0, 0] = (x[0, 0] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x), model(changed)
    # 4 local layers of window 4: position 0 reaches at most position 12
    assert not torch.allclose(a[0, 12], b[0, 12])
    torch.testing.assert_close(a[0, 13:], b[0, 13:], atol=0, rtol=0)


def test_every_tensor_has_a_name_both_ways():
    config = model_config_from_hf(hf_model(layer_types=LOCAL_GLOBAL).config.to_dict())
    with torch.device("meta"):
        model = Transformer(replace(config, tie_embeddings=False))
    names = FAMILIES["gemma3"].names
    for name in model.state_dict():
        hf_name = names.to_hf(name)
        assert hf_name is not None and names.to_native(hf_name) == name, name


def test_an_older_config_json_reads_the_same_model():
    """``rope_local_base_freq``, ``rope_scaling`` and ``sliding_window_pattern`` as the
    published Gemma 3 configs spell them."""
    older = {
        **{k: v for k, v in SHAPE.items() if v is not None},
        "model_type": "gemma3_text",
        "num_hidden_layers": 7,
        "sliding_window": 16,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000,
        "rope_local_base_freq": 10_000,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    config = model_config_from_hf(older)
    assert config.window_layers == [0, 1, 2, 3, 4, 6]
    assert (config.local_rope_theta, config.rope_theta) == (10_000.0, 1_000_000.0)
    assert (config.rope_scaling.type, config.rope_scaling.factor) == ("linear", 8.0)
    assert config.tie_embeddings and config.sliding_window == 16


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_bias": True}, "gemma3: attention_bias=true"),
        ({"final_logit_softcapping": 30.0}, "gemma3: final_logit_softcapping=30.0"),
        ({"attn_logit_softcapping": 50.0}, "gemma3: attn_logit_softcapping=50.0"),
        ({"hidden_activation": "gelu"}, "gemma3: hidden_activation='gelu'"),
        ({"layer_types": ["sliding_attention", "bogus"]}, "gemma3: layer_types must name"),
    ],
)
def test_what_the_decoder_cannot_compute_is_refused(overrides, message):
    config = {**hf_model(layer_types=LOCAL_GLOBAL).config.to_dict(), **overrides}
    with pytest.raises(CheckpointError, match=message) as err:
        model_config_from_hf(config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        (
            "gemma3",
            {"norm_placement": "pre"},
            "model.family=gemma3 with model.norm_placement='pre'",
        ),
        ("gemma3", {"activation": "silu"}, "model.family=gemma3 with model.activation='silu'"),
        (
            "llama",
            {"window_layers": [0], "sliding_window": 4},
            "model.family=llama with model.sliding_window=4: llama has None; "
            "model.family=olmo3 \\| gemma3 \\| gpt_oss can have it",
        ),
        (
            "qwen3",
            {"scale_embeddings": True},
            "model.family=qwen3 with model.scale_embeddings=True",
        ),
    ],
)
def test_options_a_family_cannot_have_are_refused(family, changes, message):
    gemma = GEMMA_OPTIONS
    base = gemma if family == "gemma3" else {"qk_norm": "head"} if family == "qwen3" else {}
    config = tiny_model_config(**{"family": family, **base, **changes})
    with pytest.raises(ConfigError, match=message) as err:
        hf_config_from_model(config)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=message):
        Transformer(config)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"window_layers": [0, 5]}, r"model.window_layers=\[0, 5\] must list"),
        ({"window_layers": [1, 0]}, "must list the local layers in increasing order"),
        ({"window_layers": [0], "sliding_window": None}, "needs model.sliding_window"),
        ({"window_layers": [0], "sliding_window": 0}, "model.sliding_window=0 must be"),
    ],
)
def test_window_options_are_checked(changes, message):
    gemma = GEMMA_OPTIONS
    config = tiny_model_config(family="gemma3", **{**gemma, "sliding_window": 4, **changes})
    with pytest.raises(ConfigError, match=message):
        Transformer(config)


def test_bfloat16_norms_compute_as_transformers_does(tmp_path):
    """The (1 + w) gains are kept as the checkpoint's w and summed in float32 at run time,
    so a model loaded in bfloat16 is transformers' in bfloat16 (holding 1 + w in
    bfloat16 would round each gain to a step of 2**-7 near one)."""
    hf = hf_model(layer_types=LOCAL_GLOBAL, sliding_window=8)
    hf.save_pretrained(tmp_path)
    model, config = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert config.norm_gain_offset == 1.0
    names = FAMILIES["gemma3"].names
    theirs = hf.to(torch.bfloat16).state_dict()
    for name, tensor in model.state_dict().items():  # the checkpoint's tensors, as stored
        if names.to_hf(name) in theirs:
            assert torch.equal(tensor, theirs[names.to_hf(name)]), name
    x = tokens(VOCAB, 2, 40)
    ours, reference = logits_of(model, x).float(), logits_of(hf, x).float()
    assert (ours - reference).abs().max() < 0.05  # bf16 rounding of different kernels
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95


def test_yarn_without_its_original_length_reads_it_from_max_position_embeddings(tmp_path):
    """A published-style config.json whose global YaRN parameters leave out
    original_max_position_embeddings: transformers takes max_position_embeddings, and so
    does the import."""
    overrides, _ = CASES["yarn-global"]
    hf_model(**overrides).save_pretrained(tmp_path / "theirs")
    path = tmp_path / "theirs" / "config.json"
    written = json.loads(path.read_text())
    written["rope_parameters"]["full_attention"].pop("original_max_position_embeddings", None)
    path.write_text(json.dumps(written))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "theirs", attn_implementation="eager"
    ).eval()
    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert config.rope_scaling.type == "yarn"
    assert config.rope_scaling.original_max_seq_len == written["max_position_embeddings"]
    x = tokens(VOCAB, 2, 40)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
