"""Every model family takes the on-ramp: ``recipe=sft/lora stage.init_from=DIR
data.path=chat.jsonl`` from a folder transformers saved trains with the adapter on the
family's projections; its merged output, exported, and its adapter in PEFT's format on
the folder it started from, are what transformers computes."""

from __future__ import annotations

import json

import pytest
import torch
from hf_folders import FAMILY_SETTINGS, make_hf_folder, write_chat_records, write_preference_records
from tiny import QUIET_OVERRIDES

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.source import fill_model_from_init, load_model_weights
from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.models import Transformer
from recipes_lib.train import run

transformers = pytest.importorskip("transformers")
PeftModel = pytest.importorskip("peft").PeftModel
SHORT = ["trainer=cpu", "trainer.max_steps=2", "scheduler.warmup=1", "trainer.val_check_interval=2"]
FAMILY_OF = {"qwen3": "qwen3", "olmo2": "olmo2", "olmo3": "olmo3", "smollm3": "smollm3"}
FAMILY_OF.update(phi3="phi3")
FAMILY_OF.update(gemma3_text="gemma3", qwen3_moe="qwen3_moe", mixtral="mixtral")


@pytest.mark.parametrize("model_type", FAMILY_SETTINGS)
def test_lora_sft_from_each_family_folder(tmp_path, model_type):
    folder = make_hf_folder(tmp_path / model_type, model_type, **FAMILY_SETTINGS[model_type])
    chat = write_chat_records(tmp_path / "chat.jsonl", 60)
    overrides = [
        "recipe=sft/lora",
        f"stage.init_from={folder}",
        f"data.path={chat}",
        "data.seq_len=256",
        *SHORT,
        *QUIET_OVERRIDES,
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    result = run(compose_config(overrides))
    assert result.global_step == 2 and result.weights_path.is_file()
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()
    # the stage's own hf/, in the folder's architecture and checked against transformers
    hf_config = json.loads((result.hf_path / "config.json").read_text())
    assert hf_config["model_type"] == model_type

    model = to_run_config(fill_model_from_init(compose_config(overrides))).model
    assert model.family == FAMILY_OF[model_type]
    trained = Transformer(model).eval()
    state = load_weights(result.weights_path)
    trained.load_state_dict(state)
    exported = export_hf_checkpoint(state, model, tmp_path / "export")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    x = torch.randint(0, model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trained(x)
        torch.testing.assert_close(theirs(input_ids=x).logits, ours, atol=1e-4, rtol=1e-4)
        # the adapter alone, in PEFT's format, on the folder it was trained from
        base = transformers.AutoModelForCausalLM.from_pretrained(folder)
        adapted = PeftModel.from_pretrained(base, result.output_dir / "adapter").eval()
        torch.testing.assert_close(adapted(input_ids=x).logits, ours, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["gemma3_text", "mixtral"])
def test_dpo_from_a_folder(tmp_path, model_type):
    folder = make_hf_folder(tmp_path / "hf", model_type, **FAMILY_SETTINGS[model_type])
    pairs = write_preference_records(tmp_path / "pairs.jsonl", 60)
    result = run(
        compose_config(
            [
                "recipe=dpo/lora",
                f"stage.init_from={folder}",
                f"data.path={pairs}",
                "data.seq_len=256",
                *SHORT,
                *QUIET_OVERRIDES,
                f"run.dir={tmp_path / 'run'}",
                f"data.cache_dir={tmp_path / 'cache'}",
            ]
        )
    )
    assert result.global_step == 2 and result.weights_path.is_file()


def test_lora_on_the_experts_trains_them_and_merges_into_the_output(tmp_path):
    """``adapter.target_modules`` with ``experts``: each routed expert's weights take an
    update; the merged output, exported, is what transformers computes, and its experts
    moved from the folder's; the run's PEFT folder over the starting folder computes it
    too."""
    folder = make_hf_folder(tmp_path / "moe", "qwen3_moe", **FAMILY_SETTINGS["qwen3_moe"])
    overrides = [
        "recipe=sft/lora",
        f"stage.init_from={folder}",
        f"data.path={write_chat_records(tmp_path / 'chat.jsonl', 60)}",
        "data.seq_len=256",
        "adapter.target_modules=[wq,wk,wv,wo,experts]",
        "adapter.dropout=0",
        *SHORT,
        *QUIET_OVERRIDES,
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    result = run(compose_config(overrides))
    assert result.global_step == 2 and (result.output_dir / "adapter").is_dir()
    model = to_run_config(fill_model_from_init(compose_config(overrides))).model
    state = load_weights(result.weights_path)
    start = Transformer(model)
    load_model_weights(start, folder)
    name = "layers.0.feed_forward.experts.w2.weight"
    assert not torch.equal(state[name], start.state_dict()[name])  # the experts trained
    trained = Transformer(model).eval()
    trained.load_state_dict(state)
    exported = export_hf_checkpoint(state, model, tmp_path / "export")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    x = torch.randint(0, model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    peft = pytest.importorskip("peft")
    adapted = transformers.AutoModelForCausalLM.from_pretrained(folder)
    adapted = peft.PeftModel.from_pretrained(adapted, result.output_dir / "adapter").eval()
    with torch.no_grad():
        ours = trained(x)
        torch.testing.assert_close(theirs(input_ids=x).logits, ours, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(adapted(input_ids=x).logits, ours, atol=1e-4, rtol=1e-4)
