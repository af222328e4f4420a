"""A folder without a native family through a pipeline: SFT from the folder, then DPO with
LoRA and activation checkpointing from the stage before; each stage's manifest records
the first batch's loss as the library and transformers computed it, and its hf/ folder
reloads in transformers with the run's own logits (the adapter too, in PEFT's format)."""

from __future__ import annotations

import pytest
import torch
from hf_folders import write_chat_records, write_preference_records, write_tokenizer
from tiny import QUIET_OVERRIDES

from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.export import load_checkpoint
from recipes_lib.pipeline import parse_pipeline, run_pipeline

transformers = pytest.importorskip("transformers")
PeftModel = pytest.importorskip("peft").PeftModel


def neox_folder(path):
    config = transformers.AutoConfig.for_model(
        "gpt_neox",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    write_tokenizer(path, stdlib_instruction_records(200))
    return path


def test_sft_then_dpo_lora_pipeline_through_the_fallback(tmp_path):
    folder = neox_folder(tmp_path / "neox")
    chat = write_chat_records(tmp_path / "chat.jsonl", 40)
    pairs = write_preference_records(tmp_path / "pairs.jsonl", 40)
    short = {"trainer": {"max_steps": 3, "val_check_interval": 3}, "scheduler": {"warmup": 1}}
    spec = parse_pipeline(
        {
            "name": "fallback",
            "dir": str(tmp_path / "pipe"),
            "overrides": ["trainer=cpu", "data.seq_len=128", *QUIET_OVERRIDES],
            "stages": {
                "sft": {
                    "recipe": "sft/full",
                    "from": str(folder),
                    "data": {"path": str(chat)},
                    **short,
                },
                "dpo": {
                    "recipe": "dpo/lora",
                    "from": "sft",
                    "data": {"path": str(pairs)},
                    "kernels": {"activation_checkpointing": True},
                    **short,
                },
            },
        }
    )
    result = run_pipeline(spec)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    for name in ("sft", "dpo"):
        manifest = result[name].manifest
        assert manifest.model["family"] == "hf"
        check = manifest.load_check
        assert check is not None and check["difference"] < 1e-4, check
        ours, _ = load_checkpoint(manifest.directory)
        hf = manifest.directory / "hf"
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        with torch.no_grad():
            torch.testing.assert_close(
                ours.eval()(x), theirs(input_ids=x).logits, atol=1e-4, rtol=1e-4
            )
    # the DPO stage's adapter, in PEFT's format, over the SFT stage's folder
    base = transformers.AutoModelForCausalLM.from_pretrained(
        result["sft"].manifest.directory / "hf"
    )
    adapted = PeftModel.from_pretrained(base, result["dpo"].manifest.directory / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            adapted(input_ids=x).logits, theirs(input_ids=x).logits, atol=1e-4, rtol=1e-4
        )
