"""DeepSeek-V3 against transformers: multi-head latent attention (a query latent or one
projection, RoPE on adjacent pairs or halves, YaRN's mscale in the softmax scale, values
narrower than the keys), the compressed KV cache, the first layers dense, the sigmoid
router's choice bias, group limit and routed scale, shared experts; on import, export
and greedy generation; packed documents; the kernels; the published presets' parameter
counts; its refusals."""

import json
import logging
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from safetensors.torch import load_file, save_file
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import load_hf_checkpoint, model_config_from_hf
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.errors import CheckpointError, ConfigError, UnsupportedKernelError
from recipes_lib.generate import generate
from recipes_lib.kernels.attention import AttentionCapabilities, SDPAAttention
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.launch_check.activations import DecoderShape
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES
from recipes_lib.models.kv_cache import KVCache
from recipes_lib.models.moe import MoEFeedForward

transformers = pytest.importorskip("transformers")

# 3 layers (the first dense), 8 experts of width 16 in 4 groups, 2 per token within the
# 2 best groups; latents of 24 (keys and values) and 20 (queries), query/key heads of
# 16 + 8 rotated dims, value heads of 12
SHAPE = dict(
    TINY_SHAPE,
    num_hidden_layers=3,
    num_key_value_heads=4,
    intermediate_size=48,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=24,
    q_lora_rank=20,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    routed_scaling_factor=2.5,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "rope_theta": 1e4,
}


def hf_model(**overrides):
    """A nudged transformers model whose choice biases are off zero too (a buffer)."""
    model = nudged_hf_model(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        scale=0.2,
        **{**SHAPE, **overrides},
    )
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                bias = gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
    return model


CASES = {
    "q-latent-yarn-mscale-pairs-groups": {"rope_parameters": YARN, "rope_interleave": True},
    "q-projection-halves-biases-no-groups": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "attention_bias": True,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 2,
        "n_shared_experts": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e4},
    },
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    overrides = CASES[case]
    hf = hf_model(**overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert (config.family, config.mla_kv_rank, config.mla_rope_dim) == ("deepseek_v3", 24, 8)
    assert (config.head_dim, config.v_head_dim) == (24, 12)
    assert config.mla_q_rank == overrides.get("q_lora_rank", 20)
    assert config.moe_router == "sigmoid"
    assert config.moe_dense_layers == list(range(overrides.get("first_k_dense_replace", 1)))
    x = tokens(VOCAB, 2, 40)
    ours = logits_of(model, x)
    torch.testing.assert_close(ours, logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # the greedy decoding through the compressed cache is transformers' greedy decoding
    assert generate(model, PROMPT, 12) == hf_greedy(hf, 12)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3"
    assert written["architectures"] == ["DeepseekV3ForCausalLM"]
    theirs_tensors = load_file(tmp_path / "theirs" / "model.safetensors")
    ours_tensors = load_file(out / "model.safetensors")
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    for name, tensor in theirs_tensors.items():
        assert torch.equal(ours_tensors[name], tensor), name
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == "DeepseekV3ForCausalLM"
    torch.testing.assert_close(logits_of(again.eval(), x), ours, atol=1e-4, rtol=1e-4)
    assert hf_greedy(again, 12) == hf_greedy(hf, 12)

    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_each_unusual_option_changes_the_logits(tmp_path):
    """The parity above is not of a model whose choice bias, group limit, routed scale,
    pairwise RoPE or mscale do nothing."""
    hf_model(rope_parameters=YARN, rope_interleave=True).save_pretrained(tmp_path)
    _, config = load_hf_checkpoint(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path)
    x = tokens(VOCAB, 1, 40)
    before = logits_of(model, x)
    state = model.state_dict()
    changes = {
        "choice bias": {"expert_bias": True},
        "groups": {"moe_groups": 1, "moe_top_groups": 1},
        "routed scale": {"moe_routed_scale": 1.0},
        "pairs": {"rope_interleave": False},
        "mscale": {"rope_scaling": replace(config.rope_scaling, mscale_all_dim=None)},
    }
    for what, change in changes.items():
        if change.pop("expert_bias", False):
            changed = Transformer(config).eval()
            changed.load_state_dict({**state, "layers.1.feed_forward.expert_bias": torch.zeros(8)})
        else:
            changed = Transformer(replace(config, **change)).eval()
            changed.load_state_dict(state)
        assert (logits_of(changed, x) - before).abs().max() > 1e-3, what


def test_the_cache_holds_latents_and_rotated_keys_not_keys_and_values(tmp_path):
    hf_model().save_pretrained(tmp_path)
    model, config = load_hf_checkpoint(tmp_path)
    cache = KVCache.for_model(model, batch_size=2, max_len=20)
    assert [tuple(t.shape) for t in (cache.keys[0], cache.values[0])] == [
        (2, 1, 20, config.mla_kv_rank),
        (2, 1, 20, config.mla_rope_dim),
    ]


class _EqualWidthSDPA(SDPAAttention):
    """SDPA declared as a kernel that needs values as wide as the keys (flash_attn's
    constraint): the latent attention pads them."""

    name = "sdpa_equal_widths"
    capabilities = replace(SDPAAttention.capabilities, value_width=False)


@pytest.mark.parametrize("attention", ["flex", "padded"])
def test_the_attention_kernels_agree(tmp_path, attention):
    hf_model(rope_parameters=YARN).save_pretrained(tmp_path)
    reference, config = load_hf_checkpoint(tmp_path)
    backend = _EqualWidthSDPA() if attention == "padded" else attention
    assert isinstance(SDPAAttention.capabilities, AttentionCapabilities)
    model = Transformer(config, backend).eval()
    model.load_state_dict(reference.state_dict())
    x = tokens(VOCAB, 2, 30)
    torch.testing.assert_close(logits_of(model, x), logits_of(reference, x), atol=1e-5, rtol=1e-5)


def test_packed_documents_are_the_documents_alone(tmp_path):
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


def test_left_padded_rows_decode_as_each_row_alone(tmp_path):
    hf_model(rope_parameters=YARN).save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path)
    short, long = PROMPT[:3], PROMPT
    pad = len(long) - len(short)
    steps = tokens(VOCAB, 2, 6, seed=7)
    cache = KVCache.for_model(model, batch_size=2, max_len=len(long) + 6)
    cache.key_mask = torch.ones(2, cache.max_len, dtype=torch.bool)
    cache.key_mask[0, :pad] = False
    rows = torch.tensor([[0] * pad + short, long])
    with torch.no_grad():
        got = [model(rows, cache=cache, last_only=True)]
        for i in range(steps.shape[1]):
            got.append(model(steps[:, i : i + 1], cache=cache))
    got = torch.cat(got, dim=1)
    for row, prompt in enumerate((short, long)):
        alone = logits_of(model, torch.cat([torch.tensor([prompt]), steps[row : row + 1]], 1))
        torch.testing.assert_close(got[row], alone[0, len(prompt) - 1 :], atol=1e-4, rtol=1e-4)


def test_multi_token_prediction_layers_are_skipped_with_one_line(tmp_path, caplog):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    # what the published folders store past the last layer
    extra = {
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.self_attn.kv_b_proj.weight": tensors[
            "model.layers.2.self_attn.kv_b_proj.weight"
        ].clone(),
    }
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        model, _ = load_hf_checkpoint(tmp_path)
    lines = [r.getMessage() for r in caplog.records if "num_nextn_predict_layers" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.3" in lines[0]
    x = tokens(VOCAB, 1, 20)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # a stray tensor inside the model's own layers is still refused
    save_file(
        {**tensors, "model.layers.1.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(CheckpointError, match="model.layers.1.extra.weight"):
        load_hf_checkpoint(tmp_path)


def test_an_fp8_folder_reads_as_the_same_model():
    """The published quantization_config: its weights are dequantized at load
    (tests/unit/checkpoint/test_hf_quantized.py)."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    config = hf_model().config.to_dict()
    quantized = {**config, "quantization_config": fp8}
    assert model_config_from_hf(quantized) == model_config_from_hf(config)


def test_a_kimi_k2_folder_reads_as_deepseek_v3():
    config = {**hf_model().config.to_dict(), "model_type": "kimi_k2"}
    assert model_config_from_hf(config).family == "deepseek_v3"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mla_kv_rank": None}, "model.family=deepseek_v3 with model.mla_kv_rank=None"),
        (
            {"moe_router": "softmax", "moe_groups": 1, "moe_top_groups": 1},
            "model.family=deepseek_v3 with model.moe_router='softmax'",
        ),
        ({"moe_dense_layers": [1]}, "model.moe_dense_layers=\\[1\\]"),
        ({"n_kv_heads": 2}, "model.n_kv_heads=2 with model.mla_kv_rank"),
        ({"mla_rope_dim": 24}, "model.mla_rope_dim=24"),
        ({"moe_groups": 3}, "model.moe_groups=3 must split model.moe_experts=8"),
        ({"moe_top_groups": 5}, "model.moe_top_groups=5"),
        ({"attention_out_bias": True}, "model.attention_out_bias=True"),
    ],
)
def test_options_deepseek_v3_cannot_have_are_refused(changes, message):
    config = replace(model_config_from_hf(hf_model().config.to_dict()), **changes)
    with pytest.raises(ConfigError, match=message) as err:
        Transformer(config)
    assert "\n" not in str(err.value)


def test_latent_attention_elsewhere_and_groups_on_softmax_are_refused():
    with pytest.raises(ConfigError, match="model.family=llama with model.mla_kv_rank=16"):
        Transformer(tiny_model_config(mla_kv_rank=16))
    moe = dict(family="qwen3_moe", qk_norm="head", moe_experts=8, moe_top_k=2)
    with pytest.raises(ConfigError, match="model.moe_router=softmax has no group limit"):
        Transformer(tiny_model_config(**moe, moe_groups=2))


def test_value_heads_left_as_wide_as_the_query_heads_are_the_same_model():
    # v_head_dim null means head_dim: a stage recorded one way starts another written
    # the other way (an exported folder always spells it out)
    from recipes_lib.config.model import field_differences

    spelled = replace(model_config_from_hf(hf_model().config.to_dict()), v_head_dim=24)
    left_out = replace(spelled, v_head_dim=None)
    shapes = {n: t.shape for n, t in Transformer(spelled).state_dict().items()}
    assert shapes == {n: t.shape for n, t in Transformer(left_out).state_dict().items()}
    assert field_differences(left_out, spelled, "shape") == []
    narrower = replace(spelled, v_head_dim=12)
    assert field_differences(left_out, narrower, "shape") == [("v_head_dim", 24, 12)]


def test_lora_on_the_dense_mlp_is_refused_naming_the_latent_attentions_targets():
    from recipes_lib.adapters import apply_adapter
    from recipes_lib.config.schema import AdapterConfig

    model = Transformer(model_config_from_hf(hf_model().config.to_dict()))
    with pytest.raises(ConfigError, match="dense MLP of a mixture") as err:
        apply_adapter(model, AdapterConfig(kind="lora", target_modules=["wq_a", "w1"]))
    named = "target the attention: [wo, wq_a, wq_b, wkv_a, wkv_b] (and experts"
    assert named in str(err.value) and "\n" not in str(err.value)
    # what it names is what the model takes
    apply_adapter(
        model, AdapterConfig(kind="lora", target_modules=["wq_a", "wq_b", "wkv_a", "wkv_b", "wo"])
    )
    trained = {
        n.split(".attention.")[-1].split(".")[0]
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    assert trained == {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo"}


def test_context_parallelism_is_refused_in_one_line():
    model = Transformer(model_config_from_hf(hf_model().config.to_dict()))
    with pytest.raises(UnsupportedKernelError, match="multi-head latent attention") as err:
        model.set_context_shard(ContextShard(seq_len=16, degree=2, rank=0))
    assert "\n" not in str(err.value)


def test_every_tensor_has_a_name_both_ways():
    for overrides in CASES.values():
        config = model_config_from_hf(hf_model(**overrides).config.to_dict())
        with torch.device("meta"):
            model = Transformer(config)
        names = FAMILIES["deepseek_v3"].names
        for name in model.state_dict():
            if names.is_stacked(name):
                continue
            hf_name = names.to_hf(name)
            assert hf_name is not None and names.to_native(hf_name) == name, name


# (preset, total, active without the embedding table, published total, published active)
PRESETS = [
    # DeepSeek-V3: 671B total (685B with its multi-token-prediction layer), 37B active
    ("deepseek_v3_671b", 671_026_404_352, 36_625_603_584, 671e9, 37e9),
    # Kimi K2: "1T" total (1.04T as some cards round it), 32B active
    ("kimi_k2", 1_026_408_209_408, 31_687_072_768, 1.0e12, 32e9),
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
    assert abs(total - published) / published < 0.03
    # the launch check's count (its routers averaged over the layers: within 1e-6)
    assert abs(DecoderShape.of_model(config).num_params() - total) < 1e-6 * total
    with_embeddings = active + config.vocab_size * config.dim
    assert active < published_active + 1e9 and with_embeddings > published_active - 1e9
    moe = [isinstance(layer.feed_forward, MoEFeedForward) for layer in model.layers]
    assert moe == [i not in config.moe_dense_layers for i in range(config.n_layers)]


@pytest.mark.parametrize("preset", ["deepseek_v3_671b", "kimi_k2"])
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
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    assert native.num_params() == sum(p.numel() for p in theirs.parameters())
    assert model_config_from_hf(theirs.config.to_dict(), name=preset) == ours


def test_another_router_of_the_remote_code_is_refused_in_one_line():
    config = {**hf_model().config.to_dict(), "scoring_func": "softmax", "topk_method": "greedy"}
    with pytest.raises(CheckpointError, match="scoring_func='softmax'") as err:
        model_config_from_hf(config)
    assert "\n" not in str(err.value)


# deepseek-ai/DeepSeek-V3's config.json (the fields the decoder reads, as on the Hub:
# transformers 4's rope_scaling, and its fp8 quantization_config, read dequantized)
DEEPSEEK_V3_671B = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
# moonshotai/Kimi-K2-Instruct's, alike
KIMI_K2 = {
    **DEEPSEEK_V3_671B,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "model_type": "kimi_k2",
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "vocab_size": 163840,
}


@pytest.mark.parametrize(
    ("preset", "published"), [("deepseek_v3_671b", DEEPSEEK_V3_671B), ("kimi_k2", KIMI_K2)]
)
def test_the_presets_are_their_published_configs(preset, published):
    from recipes_lib.config import compose_config, to_run_config

    ours = to_run_config(compose_config([f"model={preset}"])).model
    assert model_config_from_hf(published, name=preset) == ours


def test_a_bf16_model_keeps_the_choice_bias_in_float32(tmp_path):
    """As transformers keeps e_score_correction_bias: bf16 would round a bias of a few
    units to steps of 1/64 and reorder close experts."""
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    layer = model.layers[1].feed_forward
    assert layer.router.weight.dtype == torch.bfloat16
    assert torch.equal(layer.expert_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    assert model.half().layers[1].feed_forward.expert_bias.dtype == torch.float32


def test_a_reward_model_reads_and_exports_with_transformers_scores(tmp_path):
    """``DeepseekV3ForSequenceClassification`` (``model.head=score``): the same scores at
    each row's last token on import, and again after export."""
    settings = {**SHAPE, "rope_parameters": YARN, "num_labels": 1, "pad_token_id": 0}
    hf = nudged_hf_model(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForSequenceClassification,
        0.2,
        **settings,
    )
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_hf_checkpoint(tmp_path / "hf")
    assert (config.family, config.head) == ("deepseek_v3", "score")
    ids = tokens(VOCAB - 1, 3, 20) + 1  # no padding token inside the rows
    with torch.no_grad():
        want = hf(input_ids=ids).logits[:, 0]
        torch.testing.assert_close(model(ids)[:, -1, 0], want, atol=1e-4, rtol=1e-4)
        out = export_hf_checkpoint(model, config, tmp_path / "ours")
        again = transformers.AutoModelForSequenceClassification.from_pretrained(
            out, attn_implementation="eager"
        ).eval()
        assert type(again).__name__ == "DeepseekV3ForSequenceClassification"
        scores = torch.cat([again(input_ids=row[None]).logits[:, 0] for row in ids])
        torch.testing.assert_close(scores, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_a_config_leaving_out_the_mixtures_keys_reads_transformers_defaults(model_type):
    import transformers

    keys = ["n_group", "topk_group", "routed_scaling_factor", "n_shared_experts"]
    keys += ["first_k_dense_replace", "norm_topk_prob"]
    full = transformers.AutoConfig.for_model(model_type, num_hidden_layers=6).to_dict()
    written = {k: v for k, v in full.items() if k not in keys}  # a hand-written file
    theirs = transformers.AutoConfig.for_model(**written)  # what transformers builds
    ours = model_config_from_hf(written)
    assert ours.moe_groups == theirs.n_group and ours.moe_top_groups == theirs.topk_group
    assert ours.moe_routed_scale == theirs.routed_scaling_factor
    assert ours.moe_shared_experts == theirs.n_shared_experts
    assert ours.moe_dense_layers == list(range(theirs.first_k_dense_replace))
    assert ours.moe_renormalize == theirs.norm_topk_prob
