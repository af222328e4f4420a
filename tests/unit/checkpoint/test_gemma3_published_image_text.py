"""The published Gemma 3 4B folder's config.json (image-text, its text_config written
sparsely: only what differs from transformers' defaults) reads as the gemma3_4b preset,
as transformers itself reads it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from recipes_lib.checkpoint.hf import model_config_from_hf
from recipes_lib.checkpoint.hf_files import image_text_of, read_hf_config
from recipes_lib.config import compose_config, to_run_config

# google/gemma-3-4b-it's config.json
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_the_published_4b_folder_reads_as_the_gemma3_4b_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_IT))
    assert image_text_of(GEMMA3_4B_IT) is not None
    read = model_config_from_hf(read_hf_config(tmp_path), name="gemma3_4b")
    preset = to_run_config(compose_config(["model=gemma3_4b"])).model
    assert replace(read, init_std=preset.init_std) == preset


def test_transformers_reads_the_same_text_tower():
    transformers = pytest.importorskip("transformers")
    text = transformers.Gemma3Config(**GEMMA3_4B_IT).text_config.to_dict()
    theirs = model_config_from_hf(text, name="gemma3_4b")
    ours = model_config_from_hf(
        image_text_of(GEMMA3_4B_IT).text_config(GEMMA3_4B_IT), name="gemma3_4b"
    )  # type: ignore[union-attr]
    assert ours == theirs
