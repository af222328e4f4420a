"""DeepSeek-V3 and GLM-4.5 take the on-ramp: ``recipe=sft/lora stage.init_from=DIR`` from
a folder transformers saved (latent attention or partial rotation, the first layer
dense, DeepSeek-V3's sigmoid router with shared experts) lowers the held-out loss, and
the merged output, exported, and the adapter in PEFT's format over the starting folder,
are what transformers computes."""

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

SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
FOLDERS = {
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        # the latent attention's projections and the routed experts
        "adapter.target_modules=[wq_a,wq_b,wkv_a,wkv_b,wo,experts]",
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        "adapter.target_modules=[wq,wk,wv,wo]",
    ),
}


def _folder(path, family):
    config_class, settings, _ = FOLDERS[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SHARED, **settings)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight off its init, the router's choice bias too
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=gen)
    model.save_pretrained(path)
    write_tokenizer(path, stdlib_instruction_records(300))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family", FOLDERS)
def test_lora_sft_lowers_the_loss_and_exports(tmp_path, family):
    folder = _folder(tmp_path / family, family)
    overrides = [
        "recipe=sft/lora",
        f"stage.init_from={folder}",
        FOLDERS[family][2],
        "adapter.dropout=0",
        f"data.path={write_chat_records(tmp_path / 'chat.jsonl', 80)}",
        "data.seq_len=256",
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
    losses = [loss for _, loss in metric_series(read_metrics(result.output_dir), "val/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.05, losses

    model = to_run_config(fill_model_from_init(compose_config(overrides))).model
    assert model.family == family
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
        # the adapter in PEFT's format, over the starting folder, is the trained model
        base = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager"
        )
        adapted = PeftModel.from_pretrained(base, result.output_dir / "adapter").eval()
        torch.testing.assert_close(adapted(input_ids=x).logits, ours, atol=1e-4, rtol=1e-4)
