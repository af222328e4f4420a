"""QLoRA on the transformers fallback (model.family=hf) where it cannot run: each refusal
is one line, and the model is left as it was. It trains on a GPU:
tests/gpu/test_hf_fallback_qlora_gpu.py."""

from __future__ import annotations

import pytest
import torch

from recipes_lib.adapters.hf_fallback import (
    apply_fallback_adapter,
    fallback_targets,
    quantize_targets,
)
from recipes_lib.adapters.lora import lora_layers
from recipes_lib.checkpoint.hf_files import read_folder_config
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models.hf_fallback import build_hf_model, fallback_model_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

TINY = dict(
    vocab_size=256,
    hidden_size=32,
    n_embd=32,
    intermediate_size=64,
    num_hidden_layers=2,
    n_layer=2,
    num_attention_heads=4,
    n_head=4,
    max_position_embeddings=64,
    n_positions=64,
    bos_token_id=1,
    eos_token_id=2,
)


def built(path, model_type):
    cfg = transformers.AutoConfig.for_model(model_type, **TINY)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return build_hf_model(fallback_model_config(read_folder_config(path)), folder=path)


def unchanged(model, before: dict[str, type]) -> bool:
    kinds = {name: type(module) for name, module in model.named_modules()}
    return (
        kinds == before
        and not lora_layers(model)
        and all(p.requires_grad for p in model.parameters())
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_qlora_without_cuda_is_one_line_and_changes_nothing(tmp_path):
    model = built(tmp_path, "gpt_neox")
    before = {name: type(module) for name, module in model.named_modules()}
    with pytest.raises(ConfigError, match="bitsandbytes package|quantizes on a CUDA device"):
        apply_fallback_adapter(model, AdapterConfig(kind="qlora"))
    assert unchanged(model, before)


@pytest.mark.parametrize(
    ("model_type", "line"),
    [
        ("gpt2", r"c_attn is a Conv1D, not an nn.Linear .*adapter.kind=lora"),
        ("gpt_neox", "quantizes on a CUDA device, but the model was built on cpu"),
    ],
)
def test_targets_qlora_cannot_quantize_are_refused_before_any_is(tmp_path, model_type, line):
    model = built(tmp_path, model_type)
    before = {name: type(module) for name, module in model.named_modules()}
    config = AdapterConfig(kind="qlora")
    with pytest.raises(ConfigError, match=line):
        quantize_targets(model, fallback_targets(model, config), config)
    assert unchanged(model, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_a_qlora_run_of_the_fallback_stops_before_training_without_cuda(tmp_path):
    from hf_folders import write_chat_records, write_tokenizer
    from tiny import QUIET_OVERRIDES

    from recipes_lib.config import compose_config
    from recipes_lib.data.chat.instructions import stdlib_instruction_records
    from recipes_lib.train import run

    folder = tmp_path / "neox"
    cfg = transformers.AutoConfig.for_model("gpt_neox", **{**TINY, "vocab_size": 512})
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    write_tokenizer(folder, stdlib_instruction_records(50))
    overrides = [
        "recipe=sft/lora",
        "adapter=qlora",
        "model=hf",
        f"stage.init_from={folder}",
        f"data.path={write_chat_records(tmp_path / 'chat.jsonl', 20)}",
        "trainer=cpu",
        *QUIET_OVERRIDES,
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    with pytest.raises(ConfigError, match="adapter.kind=qlora needs"):
        run(compose_config(overrides))
    assert not (tmp_path / "run" / "model.safetensors").exists()
