"""A folder without a native family through a pipeline: SFT from the folder, then DPO with
LoRA and activation checkpointing from the stage before; each stage's manifest records
the first batch's loss as the library and transformers computed it, and its hf/ folder
reloads in transformers with the run's own logits (the adapter too, in PEFT's format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_folders import write_chat_records, write_preference_records, write_tokenizer
from tiny import QUIET_OVERRIDES

from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.export import load_checkpoint
from recipes_lib.pipeline import parse_pipeline, run_pipeline

# runs one after another in one torchrun job (see distributed_batch.py)
BATCH = Path(__file__).with_name("distributed_batch.py")

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


@pytest.mark.slow
def test_fsdp_over_two_processes_trains_as_the_native_family_does(tmp_path):
    """FSDP2 shards each decoder layer of transformers' model: two gloo processes train
    a Llama folder through the fallback (model=hf) to the weights the native family
    reaches under FSDP on the same data."""
    from run_helpers import torchrun

    from recipes_lib.checkpoint.weights import load_weights

    config = transformers.AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    folder = tmp_path / "llama"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    write_tokenizer(folder, stdlib_instruction_records(200))
    chat = write_chat_records(tmp_path / "chat.jsonl", 40)
    runs = [
        [
            "recipe=sft/full",
            f"model={model}",
            f"stage.init_from={folder}",
            f"data.path={chat}",
            "data.seq_len=128",
            "data.batch_size=2",
            "trainer=cpu",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "scheduler.warmup=1",
            "optim.lr=1e-3",
            "stage.export_hf=true",
            "strategy=fsdp",
            "trainer.devices=2",
            *QUIET_OVERRIDES,
            f"run.dir={tmp_path / name}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ]
        for name, model in (("native", "from_init"), ("fallback", "hf"))
    ]
    listed = tmp_path / "runs.json"
    listed.write_text(json.dumps(runs))
    torchrun(2, str(BATCH), str(listed), omp_threads=1)  # both runs, one after the other
    native = load_weights(tmp_path / "native" / "hf" / "model.safetensors")
    ours = load_weights(tmp_path / "fallback" / "model.safetensors")
    start = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert ours.keys() == native.keys()
    worst = max((ours[k] - native[k]).abs().max().item() for k in ours)
    moved = max((ours[k] - start[k]).abs().max().item() for k in ours)
    assert worst < 0.02 * moved, (worst, moved)
