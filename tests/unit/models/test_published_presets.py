"""Each family's presets against the ``config.json`` its published model ships with
(written here as on the Hugging Face Hub, the fields a decoder reads): the preset must be
what the library reads from that file, field for field."""

from dataclasses import replace

import pytest

from recipes_lib.checkpoint.hf import model_config_from_hf
from recipes_lib.config import compose_config, to_run_config

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
OLMO2 = {
    "architectures": ["Olmo2ForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 4096,
    "model_type": "olmo2",
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 500000,
    "tie_word_embeddings": False,
    "vocab_size": 100352,
}
# what both published OLMo 3 configs share (YaRN x8 from 8,192 on the global layers)
OLMO3 = {
    **OLMO2,
    "architectures": ["Olmo3ForCausalLM"],
    "model_type": "olmo3",
    "max_position_embeddings": 65536,
    "rope_scaling": {
        "attention_factor": 1.2079441541679836,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "yarn",
    },
    "sliding_window": 4096,
    "vocab_size": 100278,
}
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
    "model_type": "gemma3_text",
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_theta": 1000000,
    "sliding_window_pattern": 6,
}
PUBLISHED = {
    "qwen3_0_6b": {
        **QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "max_window_layers": 28,
        "tie_word_embeddings": True,
    },
    "qwen3_1_7b": {
        **QWEN3,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "max_window_layers": 28,
        "tie_word_embeddings": True,
    },
    "qwen3_4b": {
        **QWEN3,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "max_window_layers": 36,
        "tie_word_embeddings": True,
    },
    "qwen3_8b": {
        **QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "max_window_layers": 36,
        "tie_word_embeddings": False,
    },
    "olmo2_1b": {  # OLMo-2-0425-1B
        **OLMO2,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 16,
        "num_hidden_layers": 16,
        "num_key_value_heads": 16,
    },
    "olmo2_7b": {  # OLMo-2-1124-7B
        **OLMO2,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
    },
    "olmo3_7b": {  # Olmo-3-1025-7B, as transformers 4 wrote it
        **OLMO3,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 8,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
    },
    "olmo3_32b": {  # Olmo-3-1125-32B
        **OLMO3,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 16,
        "num_attention_heads": 40,
        "num_hidden_layers": 64,
        "num_key_value_heads": 8,
    },
    "gemma3_1b": {
        **GEMMA3,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "rope_scaling": None,
        "sliding_window": 512,
        "vocab_size": 262144,
    },
    "gemma3_4b": {  # the text_config of gemma-3-4b, with Gemma3TextConfig's defaults
        **GEMMA3,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "max_position_embeddings": 131072,
        "num_attention_heads": 8,
        "num_hidden_layers": 34,
        "num_key_value_heads": 4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "vocab_size": 262208,
    },
    "smollm3_3b": {
        "architectures": ["SmolLM3ForCausalLM"],
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 65536,
        "mlp_bias": False,
        "model_type": "smollm3",
        "no_rope_layer_interval": 4,
        "no_rope_layers": [1, 1, 1, 0] * 9,
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 5000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 128256,
    },
}

PUBLISHED.update(
    {
        "olmoe_1b_7b": {  # OLMoE-1B-7B-0924
            "architectures": ["OlmoeForCausalLM"],
            "attention_bias": False,
            "clip_qkv": None,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 1024,
            "max_position_embeddings": 4096,
            "model_type": "olmoe",
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 16,
            "num_key_value_heads": 16,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.01,
            "tie_word_embeddings": False,
            "vocab_size": 50304,
        },
        "qwen3_30b_a3b": {
            **QWEN3,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "decoder_sparse_step": 1,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "max_window_layers": 48,
            "mlp_only_layers": [],
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        },
        "mixtral_8x7b": {  # Mixtral-8x7B-v0.1
            "architectures": ["MixtralForCausalLM"],
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mixtral",
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1e6,
            "router_aux_loss_coef": 0.02,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "vocab_size": 32000,
        },
    }
)

# the text_config of the published Qwen3.5 image-text folders (Qwen3_5ForConditionalGeneration,
# Qwen3_5MoeForConditionalGeneration), as the library reads it
QWEN3_5 = {
    "attention_bias": False,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "vocab_size": 248320,
}
PUBLISHED.update(
    {
        "qwen3_5_0_8b": {
            **QWEN3_5,
            "model_type": "qwen3_5_text",
            "hidden_size": 1024,
            "intermediate_size": 3584,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
            "linear_num_value_heads": 16,
            "num_attention_heads": 8,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        },
        "qwen3_5_35b_a3b": {
            **QWEN3_5,
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 2048,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
            "linear_num_value_heads": 32,
            "moe_intermediate_size": 512,
            "num_attention_heads": 16,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 40,
            "num_key_value_heads": 2,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False,
        },
    }
)


@pytest.mark.parametrize("preset", PUBLISHED)
def test_the_preset_is_its_published_config(preset):
    ours = to_run_config(compose_config([f"model={preset}"])).model
    read = model_config_from_hf(PUBLISHED[preset], name=preset)
    assert replace(read, init_std=ours.init_std) == ours


@pytest.mark.parametrize("preset", PUBLISHED)
def test_transformers_builds_the_preset_with_its_parameter_count(preset):
    """The preset's exported config.json gives transformers' own model of the family
    with as many parameters (what the throughput benchmark's baseline builds)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from recipes_lib.checkpoint.hf_export import hf_config_from_model
    from recipes_lib.models import Transformer

    ours = to_run_config(compose_config([f"model={preset}"])).model
    fields = hf_config_from_model(ours)
    architecture = fields.pop("architectures")[0]
    for key in ("torch_dtype", "dtype"):
        fields.pop(key)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
        native = Transformer(ours)
    assert type(theirs).__name__ == architecture
    assert native.num_params() == sum(p.numel() for p in theirs.parameters())
