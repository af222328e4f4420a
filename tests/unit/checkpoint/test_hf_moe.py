"""Qwen3-MoE, OLMoE and Mixtral against transformers: import, export, generation, the
stacked experts' tensors both ways, and the refusals."""

import json
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import load_hf_checkpoint
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES

transformers = pytest.importorskip("transformers")

CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
SHAPE = dict(TINY_SHAPE, rms_norm_eps=1e-6, num_experts_per_tok=2)
CASES = {
    # 3 layers: the middle one dense (mlp_only_layers), experts narrower than the MLP,
    # head_dim x heads != hidden, top-k renormalised
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            num_experts=6,
            moe_intermediate_size=32,
            head_dim=32,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
    # every second layer sparse (decoder_sparse_step), top-3 without renormalising
    "qwen3_moe-step": (
        "qwen3_moe",
        dict(
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
    ),
    "olmoe": ("olmoe", dict(num_experts=8, intermediate_size=32)),
    "mixtral": ("mixtral", dict(num_local_experts=4, intermediate_size=48)),
}


def hf_model(model_type, **overrides):
    config_name, model_name = CLASSES[model_type]
    return nudged_hf_model(
        getattr(transformers, config_name),
        getattr(transformers, model_name),
        **{**SHAPE, **overrides},
    )


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    model_type, overrides = CASES[case]
    hf = hf_model(model_type, **overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert config.family == model_type
    experts = overrides.get("num_experts", overrides.get("num_local_experts"))
    assert config.moe_experts == experts
    assert config.moe_top_k == overrides.get("num_experts_per_tok", 2)
    if case == "qwen3_moe":
        assert config.moe_dense_layers == [1] and config.moe_renormalize
    if case == "qwen3_moe-step":
        assert config.moe_dense_layers == [0, 2] and not config.moe_renormalize
    x = tokens(VOCAB, 2, 100)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == model_type
    # the checkpoint format: one tensor per expert, as the published checkpoints
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        theirs = safe_open(str(tmp_path / "theirs" / "model.safetensors"), "pt")
        assert sorted(f.keys()) == sorted(theirs.keys())
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == CLASSES[model_type][1]
    torch.testing.assert_close(
        logits_of(again.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4
    )

    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("family", CLASSES)
def test_every_tensor_has_a_name_both_ways(family):
    with torch.device("meta"):
        model = Transformer(tiny_model_config(**_native(family)))
    names = FAMILIES[family].names
    for name, tensor in model.state_dict().items():
        slices = [f"{name}[{e}]" for e in range(len(tensor))] if names.is_stacked(name) else [name]
        for native in slices:
            hf_name = names.to_hf(native)
            assert hf_name is not None and names.to_native(hf_name) == native, native


def _native(family, **extra):
    options = {"qwen3_moe": {"qk_norm": "head"}, "olmoe": {"qk_norm": "full"}, "mixtral": {}}
    base = dict(family=family, vocab_size=VOCAB, moe_experts=4, moe_top_k=2, moe_ffn_dim=32)
    return {**base, **options[family], **extra}


def test_a_missing_expert_is_named(tmp_path):
    hf = hf_model("mixtral", num_local_experts=4, intermediate_size=48)
    hf.save_pretrained(tmp_path / "full")
    tensors = load_file(str(tmp_path / "full" / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "full" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2"):
        load_hf_checkpoint(tmp_path / "full")


def test_export_refuses_what_transformers_cannot_compute(tmp_path):
    config = tiny_model_config(**_native("qwen3_moe", moe_router="sigmoid"))
    with pytest.raises(CheckpointError, match="moe_router='sigmoid'"):
        export_hf_checkpoint(Transformer(config), config, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"moe_top_k": 5}, "model.moe_top_k=5 must be between 1 and model.moe_experts=4"),
        ({"moe_router": "argmax"}, "model.moe_router='argmax' is not one of softmax"),
        ({"moe_dense_layers": [3]}, r"model.moe_dense_layers=\[3\]"),
        ({"moe_bias_update_rate": 0.01}, "moe_bias_update_rate=0.01 balances the sigmoid"),
    ],
)
def test_bad_expert_options_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        Transformer(tiny_model_config(**_native("qwen3_moe", **overrides)))


def test_a_dense_family_refuses_experts():
    with pytest.raises(ConfigError, match="model.family=llama with model.moe_experts=4.*qwen3_moe"):
        Transformer(tiny_model_config(family="llama", moe_experts=4))


def test_lora_on_a_dense_mlp_of_a_mixture_is_refused_before_training():
    from recipes_lib.adapters import apply_adapter
    from recipes_lib.config.schema import AdapterConfig

    config = tiny_model_config(**_native("qwen3_moe", moe_dense_layers=[0]))
    model = Transformer(config)
    with pytest.raises(ConfigError, match="layers.0.feed_forward.w1 is a dense MLP of a mixture"):
        apply_adapter(model, AdapterConfig(kind="lora"))
    # the attention takes its adapters; the routed experts stay frozen
    apply_adapter(model, AdapterConfig(kind="lora", target_modules=["wq", "wk", "wv", "wo"]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".attention." in n and "lora_" in n for n in trained)
