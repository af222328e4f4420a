"""Qwen3.5 takes the on-ramp: ``recipe=sft/lora stage.init_from=DIR`` from a folder
transformers saved (a linear-attention and a gated attention layer, LoRA on both) lowers
the held-out loss over packed rows; the merged output, exported, and the adapter in PEFT's
format over the starting folder, are what transformers computes."""

from __future__ import annotations

import pytest
import torch
from hf_folders import VOCAB, write_chat_records, write_tokenizer
from run_helpers import metric_series, read_metrics
from tiny import QUIET_OVERRIDES

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.source import fill_model_from_init
from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.models import Transformer
from recipes_lib.train import run

transformers = pytest.importorskip("transformers")
PeftModel = pytest.importorskip("peft").PeftModel


def _folder(path):
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        intermediate_size=96,
        max_position_embeddings=4096,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight off its init
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(path)
    write_tokenizer(path, stdlib_instruction_records(300))
    return path


@pytest.mark.slow
def test_lora_sft_from_a_qwen3_5_folder_lowers_the_loss_and_exports(tmp_path):
    folder = _folder(tmp_path / "qwen3_5")
    overrides = [
        "recipe=sft/lora",
        f"stage.init_from={folder}",
        f"data.path={write_chat_records(tmp_path / 'chat.jsonl', 80)}",
        "data.seq_len=256",
        "kernels.attention=flex",  # packed rows: each document attends to itself
        # the linear-attention layers' projections too, by their Hugging Face names
        "adapter.target_modules=[wq,wk,wv,wo,w1,w2,w3,in_proj_qkv,in_proj_z,out_proj]",
        "optim.lr=2e-2",
        "trainer=cpu",
        "trainer.max_steps=16",
        "scheduler.warmup=1",
        "trainer.val_check_interval=4",
        *QUIET_OVERRIDES,
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    result = run(compose_config(overrides))
    assert result.global_step == 16 and result.weights_path.is_file()
    rows = read_metrics(result.output_dir)
    losses = [loss for _, loss in metric_series(rows, "val/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.05, losses

    model = to_run_config(fill_model_from_init(compose_config(overrides))).model
    assert model.family == "qwen3_5" and model.linear_layers == [0]
    trained = Transformer(model).eval()
    state = load_weights(result.weights_path)
    trained.load_state_dict(state)
    exported = export_hf_checkpoint(state, model, tmp_path / "export")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager"
    ).eval()
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trained(x)
        torch.testing.assert_close(theirs(input_ids=x).logits, ours, atol=1e-4, rtol=1e-4)
        base = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager"
        )
        adapted = PeftModel.from_pretrained(base, result.output_dir / "adapter").eval()
        torch.testing.assert_close(adapted(input_ids=x).logits, ours, atol=1e-4, rtol=1e-4)
