"""GLM-4.5 against transformers: q/k/v biases, the per-head q/k norm, RoPE on part of each
head, the first layers dense, DeepSeek-V3's sigmoid router (choice bias, group limit,
routed scale) and shared experts; on import, export and greedy generation; packed
documents; the published presets' configs and parameter counts; its refusals."""

import json
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from safetensors.torch import load_file

from recipes_lib.checkpoint.hf import load_hf_checkpoint, model_config_from_hf
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.moe import MoEFeedForward

transformers = pytest.importorskip("transformers")

# 3 layers (the first dense), 8 experts of width 16 in 2 groups, 2 per token
SHAPE = dict(
    TINY_SHAPE,
    num_hidden_layers=3,
    head_dim=16,
    intermediate_size=48,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)


def hf_model(**overrides):
    """A nudged transformers model whose choice biases are off zero too (a buffer)."""
    model = nudged_hf_model(
        transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, 0.2, **{**SHAPE, **overrides}
    )
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers[model.config.first_k_dense_replace :]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
    return model


CASES = {
    "air-like": {
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
        },
    },
    "qk-norm-groups-scale-yarn": {
        "attention_bias": True,
        "use_qk_norm": True,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.25,
        },
    },
    "no-bias-whole-rotation-no-renorm": {
        "norm_topk_prob": False,
        "first_k_dense_replace": 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e4,
            "partial_rotary_factor": 1.0,
        },
    },
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    overrides = CASES[case]
    hf = hf_model(**overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert (config.family, config.moe_router) == ("glm4_moe", "sigmoid")
    assert config.qkv_bias == overrides.get("attention_bias", False)
    assert config.qk_norm == ("head" if overrides.get("use_qk_norm") else "none")
    assert config.partial_rotary_factor == overrides["rope_parameters"]["partial_rotary_factor"]
    x = tokens(VOCAB, 2, 40)
    ours = logits_of(model, x)
    torch.testing.assert_close(ours, logits_of(hf, x), atol=1e-4, rtol=1e-4)
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("glm4_moe", ["Glm4MoeForCausalLM"])
    theirs_tensors = load_file(tmp_path / "theirs" / "model.safetensors")
    ours_tensors = load_file(out / "model.safetensors")
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    for name, tensor in theirs_tensors.items():
        assert torch.equal(ours_tensors[name], tensor), name
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == "Glm4MoeForCausalLM"
    torch.testing.assert_close(logits_of(again.eval(), x), ours, atol=1e-4, rtol=1e-4)

    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_a_transformers_4_config_with_partial_rotation_at_the_top_reads_alike():
    config = hf_model(**CASES["air-like"]).config.to_dict()
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    old.update(rope_theta=1e4, partial_rotary_factor=0.5)
    assert model_config_from_hf(old) == model_config_from_hf(config)
    del old["partial_rotary_factor"]  # transformers' default for the model type
    assert model_config_from_hf(old).partial_rotary_factor == 0.5


def test_packed_documents_are_the_documents_alone(tmp_path):
    hf_model(**CASES["qk-norm-groups-scale-yarn"]).save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path, "flex")
    lengths = [12, 19, 9]
    docs = [tokens(VOCAB, 1, n, seed=i) for i, n in enumerate(lengths)]
    row = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    with torch.no_grad():
        packed = model(row, doc_ids)
    start = 0
    for doc, n in zip(docs, lengths, strict=True):
        alone = logits_of(model, doc)
        torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-4, rtol=1e-4)
        start += n


def test_a_quantization_the_loader_cannot_read_is_refused_in_one_line():
    settings = {"quant_method": "compressed-tensors"}
    config = {**hf_model().config.to_dict(), "quantization_config": settings}
    match = "quantization_config.quant_method='compressed-tensors' is not supported"
    with pytest.raises(CheckpointError, match=match) as err:
        model_config_from_hf(config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"qk_norm": "full"}, "model.family=glm4_moe with model.qk_norm='full'"),
        ({"moe_shared_experts": 0}, "model.family=glm4_moe with model.moe_shared_experts=0"),
        ({"attention_out_bias": True}, "model.family=glm4_moe with model.attention_out_bias"),
        ({"moe_experts": 0}, "model.family=glm4_moe with model.moe_experts=0"),
    ],
)
def test_options_glm4_moe_cannot_have_are_refused(changes, message):
    config = replace(model_config_from_hf(hf_model().config.to_dict()), **changes)
    with pytest.raises(ConfigError, match=message) as err:
        Transformer(config)
    assert "\n" not in str(err.value)


# zai-org/GLM-4.5's config.json (the fields the decoder reads); Air differs as below
GLM4_5 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "first_k_dense_replace": 3,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1536,
    "n_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_qk_norm": True,
    "vocab_size": 151552,
}
GLM4_5_AIR = {
    **GLM4_5,
    "first_k_dense_replace": 1,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 128,
    "num_hidden_layers": 46,
    "routed_scaling_factor": 1.0,
    "use_qk_norm": False,
}


@pytest.mark.parametrize(("preset", "published"), [("glm4_5", GLM4_5), ("glm4_5_air", GLM4_5_AIR)])
def test_the_presets_are_their_published_configs(preset, published):
    from recipes_lib.config import compose_config, to_run_config

    ours = to_run_config(compose_config([f"model={preset}"])).model
    assert model_config_from_hf(published, name=preset) == ours


# (preset, total, active without the embedding table, published total, published active);
# the published totals (355B, 106B) count the multi-token-prediction layer, not read here
PRESETS = [
    ("glm4_5", 352_797_814_784, 32_856_305_664, 355e9, 32e9),
    ("glm4_5_air", 106_852_245_504, 12_803_366_912, 106e9, 12e9),
]


@pytest.mark.parametrize(("preset", "total", "active", "published", "published_active"), PRESETS)
def test_the_presets_have_the_published_parameter_counts(
    preset, total, active, published, published_active
):
    from recipes_lib.config import compose_config, to_run_config

    config = to_run_config(compose_config([f"model={preset}"])).model
    with torch.device("meta"):
        model = Transformer(config)
    assert model.num_params() == total
    assert model.num_params(exclude_embeddings=True) - model.inactive_params() == active
    assert abs(total - published) / published < 0.02
    assert abs(active - published_active) / published_active < 0.1
    moe = [isinstance(layer.feed_forward, MoEFeedForward) for layer in model.layers]
    assert moe == [i not in config.moe_dense_layers for i in range(config.n_layers)]


@pytest.mark.parametrize("preset", ["glm4_5", "glm4_5_air"])
def test_transformers_builds_the_preset_with_its_parameter_count(preset):
    from recipes_lib.checkpoint.hf_export import hf_config_from_model
    from recipes_lib.config import compose_config, to_run_config

    ours = to_run_config(compose_config([f"model={preset}"])).model
    fields = hf_config_from_model(ours)
    for key in ("architectures", "torch_dtype", "dtype"):
        fields.pop(key)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
        native = Transformer(ours)
    assert type(theirs).__name__ == "Glm4MoeForCausalLM"
    assert native.num_params() == sum(p.numel() for p in theirs.parameters())
