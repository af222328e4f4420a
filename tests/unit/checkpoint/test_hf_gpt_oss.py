"""gpt-oss against transformers: attention with biases and a sink per head, local and
global layers, YaRN, routed experts with biases and the clamped SwiGLU; on import,
export (the experts' interleaved layout put back exactly) and KV-cached generation past
the window; packed documents; the published presets' parameter counts; its refusals."""

import json
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from safetensors.torch import load_file
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import load_hf_checkpoint, model_config_from_hf
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.errors import ConfigError, UnsupportedKernelError
from recipes_lib.generate import generate
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES, family_of_hf
from recipes_lib.models.moe import GatedActivation, MoEFeedForward

transformers = pytest.importorskip("transformers")

# 4 experts of width 32, 2 per token; a window of 8 keys, shorter than the inputs and the
# generation; a clamp of 0.5, which the nudged weights' activations pass
SHAPE = dict(
    TINY_SHAPE,
    num_hidden_layers=4,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=0.5,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,  # as the published models
    "original_max_position_embeddings": 32,
    "rope_theta": 1e4,
}


def hf_model(**overrides):
    # a nudge of 0.2: sinks, biases and the router's bias well off zero
    return nudged_hf_model(
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        scale=0.2,
        **{**SHAPE, **overrides},
    )


# case -> (transformers overrides, the local layers)
CASES = {
    "yarn-gqa-default-pattern": ({"rope_parameters": YARN}, [0, 2]),
    "mha-own-pattern-unscaled-alpha": (
        {
            "num_key_value_heads": 4,
            "head_dim": 8,  # not hidden_size / heads
            "layer_types": ["full_attention", "sliding_attention"] * 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e4},
            "swiglu_alpha": 1.3,
        },
        [1, 3],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    overrides, local = CASES[case]
    hf = hf_model(**overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert (config.family, config.window_layers, config.sliding_window) == ("gpt_oss", local, 8)
    assert config.attention_sinks and config.qkv_bias and config.attention_out_bias
    assert (config.activation, config.swiglu_limit) == ("clamped_swiglu", 0.5)
    assert config.moe_bias and config.moe_renormalize
    assert config.swiglu_alpha == overrides.get("swiglu_alpha", 1.702)
    x = tokens(VOCAB, 2, 40)
    ours = logits_of(model, x)
    torch.testing.assert_close(ours, logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # the KV-cached greedy decoding, past the window, is transformers' greedy decoding
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("gpt_oss", ["GptOssForCausalLM"])
    # every tensor as transformers saved it, bit for bit (the experts re-interleaved)
    theirs_tensors = load_file(tmp_path / "theirs" / "model.safetensors")
    ours_tensors = load_file(out / "model.safetensors")
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    for name, tensor in theirs_tensors.items():
        assert torch.equal(ours_tensors[name], tensor), name
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == "GptOssForCausalLM"
    torch.testing.assert_close(logits_of(again.eval(), x), ours, atol=1e-4, rtol=1e-4)
    assert hf_greedy(again, 12) == hf_greedy(hf, 12)

    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_the_sinks_biases_and_clamp_each_change_the_logits(tmp_path):
    """The parity above is not of a model whose sinks, biases or clamp do nothing."""
    hf_model(rope_parameters=YARN).save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path)
    x = tokens(VOCAB, 1, 40)
    before = logits_of(model, x)
    layer = model.layers[1]
    changes = {
        "sinks": lambda: layer.attention.sinks.zero_(),
        "attention bias": lambda: layer.attention.wo.bias.zero_(),
        "router bias": lambda: layer.feed_forward.router.bias.zero_(),
        "expert bias": lambda: layer.feed_forward.experts.w3.bias.zero_(),
    }
    for what, change in changes.items():
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            change()
        assert (logits_of(model, x) - before).abs().max() > 1e-3, what
        model.load_state_dict(saved)
    for block in model.layers:
        block.feed_forward.experts.activation = GatedActivation("clamped_swiglu", 1.702, 1e9)
    assert (logits_of(model, x) - before).abs().max() > 1e-3, "clamp"


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_the_attention_kernels_agree(tmp_path, attention):
    hf_model(rope_parameters=YARN).save_pretrained(tmp_path)
    reference, _ = load_hf_checkpoint(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path, attention)
    x = tokens(VOCAB, 2, 30)
    torch.testing.assert_close(logits_of(model, x), logits_of(reference, x), atol=1e-5, rtol=1e-5)


def test_packed_documents_are_the_documents_alone(tmp_path):
    """A row packing three documents, attended within each (flex's document mask, with
    the sinks), gives each document's logits alone, past the window in each."""
    hf_model(rope_parameters=YARN).save_pretrained(tmp_path)
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


def test_every_tensor_has_a_name_both_ways():
    config = model_config_from_hf(hf_model().config.to_dict())
    with torch.device("meta"):
        model = Transformer(config)
    names = FAMILIES["gpt_oss"].names
    combined = set()
    for name in model.state_dict():
        layout = names.rearranged_of(name)
        if layout is not None:
            hf_name = layout[0]
            assert names.rearranged_parts(hf_name)[1][layout[1]] == name
            combined.add(hf_name)
            continue
        hf_name = names.to_hf(name)
        assert hf_name is not None and names.to_native(hf_name) == name, name
    assert "model.layers.3.mlp.experts.gate_up_proj_bias" in combined
    assert family_of_hf("gpt_oss").name == "gpt_oss"


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    [
        # published: 20.9B and 3.6B active (the embedding table aside)
        ("gpt_oss_20b", 20_914_757_184, 3_608_307_264),
        # published: 116.8B and 5.1B active
        ("gpt_oss_120b", 116_829_156_672, 5_132_849_472),
    ],
)
def test_the_presets_have_the_published_parameter_counts(preset, total, active):
    from recipes_lib.config import compose_config, to_run_config

    config = to_run_config(compose_config([f"model={preset}"])).model
    with torch.device("meta"):
        model = Transformer(config)
    assert model.num_params() == total
    assert model.num_params(exclude_embeddings=True) - model.inactive_params() == active
    assert all(isinstance(layer.feed_forward, MoEFeedForward) for layer in model.layers)


def test_an_mxfp4_folder_reads_as_the_same_model():
    """Its experts are dequantized at load (tests/unit/checkpoint/test_hf_quantized.py)."""
    config = hf_model().config.to_dict()
    quantized = {**config, "quantization_config": {"quant_method": "mxfp4"}}
    assert model_config_from_hf(quantized) == model_config_from_hf(config)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_sinks": False}, "model.family=gpt_oss with model.attention_sinks=False"),
        ({"activation": "silu"}, "model.family=gpt_oss with model.activation='silu'"),
        ({"moe_experts": 0}, "model.family=gpt_oss with model.moe_experts=0"),
        ({"attention_out_bias": False}, "model.attention_out_bias=False"),
        ({"moe_renormalize": False}, "model.family=gpt_oss with model.moe_renormalize=False"),
        ({"moe_router": "sigmoid"}, "model.family=gpt_oss with model.moe_router='sigmoid'"),
    ],
)
def test_options_gpt_oss_cannot_have_are_refused(changes, message):
    options = {**FAMILIES["gpt_oss"].fixed, "family": "gpt_oss", "qkv_bias": True}
    options.update(attention_out_bias=True, moe_experts=4, moe_top_k=2, moe_ffn_dim=32)
    config = tiny_model_config(**{**options, **changes})
    with pytest.raises(ConfigError, match=message) as err:
        Transformer(config)
    assert "\n" not in str(err.value)


def test_sinks_elsewhere_than_gpt_oss_are_refused():
    config = tiny_model_config(attention_sinks=True)
    with pytest.raises(ConfigError, match="model.family=llama with model.attention_sinks=True"):
        Transformer(config)


def test_kernels_without_sinks_are_refused_naming_the_key():
    config = model_config_from_hf(hf_model().config.to_dict())
    with pytest.raises(UnsupportedKernelError, match="kernels.attention=flash_attn") as err:
        Transformer(config, "flash_attn")
    assert "sdpa | flex" in str(err.value) and "\n" not in str(err.value)
    model = Transformer(config)
    with pytest.raises(UnsupportedKernelError, match="context parallelism"):
        model.set_context_shard(ContextShard(seq_len=16, degree=2, rank=0))


def test_lora_on_the_experts_is_refused_naming_the_key():
    """Its experts' Hugging Face layout (transposed, gate and up interleaved, with biases)
    has no PEFT adapter form here: refused before anything trains, the model untouched."""
    from recipes_lib.adapters.lora import apply_adapter
    from recipes_lib.config.schema import AdapterConfig

    model = Transformer(model_config_from_hf(hf_model().config.to_dict()))
    adapter = AdapterConfig(kind="lora", dropout=0.0, target_modules=["wq", "experts"])
    with pytest.raises(
        ConfigError, match="adapter.target_modules: experts on model.family=gpt_oss"
    ):
        apply_adapter(model, adapter)
    assert not any("lora_" in name for name, _ in model.named_parameters())


def test_left_padded_rows_decode_as_each_row_alone(tmp_path):
    """Rows of different lengths in one KV cache, left-padded: each row's logits, on the
    prompt and on the next tokens past the window, are its own alone (the sinks as well
    as the padding mask in the cache's attention)."""
    from recipes_lib.models.kv_cache import KVCache

    hf_model(rope_parameters=YARN).save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path)
    short, long = PROMPT[:3], PROMPT
    pad = len(long) - len(short)
    steps = tokens(VOCAB, 2, 10, seed=7)  # the next tokens of each row
    cache = KVCache.for_model(model, batch_size=2, max_len=len(long) + 10)
    cache.key_mask = torch.ones(2, cache.max_len, dtype=torch.bool)
    cache.key_mask[0, :pad] = False
    rows = torch.tensor([[0] * pad + short, long])
    with torch.no_grad():
        got = [model(rows, cache=cache, last_only=True)]
        for i in range(steps.shape[1]):
            got.append(model(steps[:, i : i + 1], cache=cache))
    got = torch.cat(got, dim=1)  # (2, 11, V)
    for row, prompt in enumerate((short, long)):
        alone = logits_of(model, torch.cat([torch.tensor([prompt]), steps[row : row + 1]], 1))
        want = alone[0, len(prompt) - 1 :]
        torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4)


# openai/gpt-oss-20b's config.json (the fields the decoder reads; transformers 4's
# rope_theta and rope_scaling), its quantization_config left out; the 120b differs in
# its layers and experts
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
GPT_OSS_120B = {
    **GPT_OSS_20B,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
}


@pytest.mark.parametrize(
    ("preset", "published"), [("gpt_oss_20b", GPT_OSS_20B), ("gpt_oss_120b", GPT_OSS_120B)]
)
def test_the_presets_are_their_published_configs(preset, published):
    from recipes_lib.config import compose_config, to_run_config

    ours = to_run_config(compose_config([f"model={preset}"])).model
    assert model_config_from_hf(published, name=preset) == ours


@pytest.mark.parametrize("preset", ["gpt_oss_20b", "gpt_oss_120b"])
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
    assert type(theirs).__name__ == "GptOssForCausalLM"
    assert native.num_params() == sum(p.numel() for p in theirs.parameters())
    assert theirs.config.rope_parameters["rope_type"] == "yarn"
    assert not theirs.config.rope_parameters["truncate"]


GPT_OSS_TINY = [
    "recipe=pretrain/tiny",
    "model.family=gpt_oss",
    "model.attention_sinks=true",
    "model.qkv_bias=true",
    "model.attention_out_bias=true",
    "model.activation=clamped_swiglu",
    "model.moe_bias=true",
    "model.moe_experts=4",
    "model.moe_top_k=2",
]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["kernels.attention=flash_attn"], "kernels.attention=flash_attn takes no attention sinks"),
        (
            [
                "strategy=ddp",
                "trainer.devices=4",
                "data.seq_len=64",
                "kernels.attention=flex",
                "strategy.context_parallel=2",
            ],
            "strategy.context_parallel=2: its sharded attention takes no attention sinks",
        ),
    ],
)
def test_what_cannot_take_sinks_is_refused_before_the_run(overrides, match):
    from recipes_lib.config import compose_config, to_run_config
    from recipes_lib.preflight import check_run

    cfg = to_run_config(compose_config([*GPT_OSS_TINY, *overrides]))
    with pytest.raises(ConfigError, match=match) as refused:
        check_run(cfg, ("pretrain",))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_the_kernels_with_sinks_pass_the_checks(attention):
    from recipes_lib.config import compose_config, to_run_config
    from recipes_lib.preflight import check_run

    cfg = to_run_config(compose_config([*GPT_OSS_TINY, f"kernels.attention={attention}"]))
    check_run(cfg, ("pretrain",))


def test_a_reward_model_reads_and_exports_with_transformers_scores(tmp_path):
    """``GptOssForSequenceClassification`` (``model.head=score``): the same scores at
    each row's last token on import, and again after export."""
    pad = 0
    settings = {**SHAPE, "rope_parameters": YARN, "num_labels": 1, "pad_token_id": pad}
    hf = nudged_hf_model(
        transformers.GptOssConfig, transformers.GptOssForSequenceClassification, 0.2, **settings
    )
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_hf_checkpoint(tmp_path / "hf")
    assert (config.family, config.head) == ("gpt_oss", "score")
    ids = tokens(VOCAB - 1, 3, 20) + 1  # no padding token inside the rows
    with torch.no_grad():
        want = hf(input_ids=ids).logits[:, 0]
        torch.testing.assert_close(model(ids)[:, -1, 0], want, atol=1e-4, rtol=1e-4)
        out = export_hf_checkpoint(model, config, tmp_path / "ours")
        again = transformers.AutoModelForSequenceClassification.from_pretrained(
            out, attn_implementation="eager"
        ).eval()
        assert type(again).__name__ == "GptOssForSequenceClassification"
        # one row at a time: the export names no padding token (a folder without EOS)
        scores = torch.cat([again(input_ids=row[None]).logits[:, 0] for row in ids])
        torch.testing.assert_close(scores, want, atol=1e-4, rtol=1e-4)
