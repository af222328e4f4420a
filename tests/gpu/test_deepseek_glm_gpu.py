"""DeepSeek-V3 and GLM-4.5 on CUDA (``pytest -m gpu``): a bf16 model (the grouped GEMM,
the sigmoid router with its group limit, latent attention through compiled flex with
values narrower than the keys) against its fp32 self; compiled blocks against eager
ones, forward and backward; flash_attn's padded values against SDPA; and a compiled bf16
pretraining run on packed documents whose loss falls."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.config import compose_config
from recipes_lib.kernels import get_attention_backend
from recipes_lib.kernels.compiled import compile_blocks
from recipes_lib.models import Transformer
from recipes_lib.train import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# heads of at least 16 dims (flex's CUDA kernels take no narrower); 8 experts in 4 groups
_MOE = dict(
    moe_experts=8,
    moe_top_k=2,
    moe_ffn_dim=64,
    moe_dense_layers=[0],
    moe_shared_experts=1,
    moe_router="sigmoid",
    moe_groups=4,
    moe_top_groups=2,
    moe_routed_scale=2.5,
)
CONFIGS = {
    "deepseek_v3": dict(
        family="deepseek_v3",
        dim=128,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        head_dim=48,  # 32 unrotated + 16 rotated
        mla_kv_rank=64,
        mla_q_rank=48,
        mla_rope_dim=16,
        v_head_dim=32,
        rope_interleave=True,
        **_MOE,
    ),
    "glm4_moe": dict(
        family="glm4_moe",
        dim=128,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        qkv_bias=True,
        qk_norm="head",
        partial_rotary_factor=0.5,
        **_MOE,
    ),
}


def _model(family: str, attention: str = "flex") -> Transformer:
    torch.manual_seed(0)
    config = tiny_model_config(**CONFIGS[family], ffn_dim=256, vocab_size=256, max_seq_len=256)
    model = Transformer(config, attention).cuda()
    with torch.no_grad():  # the choice bias off zero, as a trained router's
        for layer in model.layers[1:]:
            layer.feed_forward.expert_bias.normal_(0.0, 0.05)
    return model


@pytest.mark.parametrize("family", CONFIGS)
def test_a_bf16_model_follows_its_fp32_self(family):
    model = _model(family)
    x = torch.randint(0, 256, (2, 200), device="cuda")
    with torch.no_grad():
        full = model(x).float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            half = model(x).float()
    error = (half - full).abs()
    # a token whose experts flip in bf16 moves further: bound the mean and the typical
    # token's worst logit
    assert error.mean() < 5e-3
    assert error.amax(dim=-1).flatten().median() < 0.01


@pytest.mark.parametrize("family", CONFIGS)
def test_compiled_blocks_match_eager_ones_forward_and_backward(family):
    eager = _model(family)
    compiled = _model(family)
    compile_blocks(compiled.layers, varying_shapes=False)
    x = torch.randint(0, 256, (2, 200), device="cuda")
    doc_ids = torch.tensor([[0] * 90 + [1] * 110, [0] * 200], device="cuda")
    grads = []
    for model in (eager, compiled):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, doc_ids, labels=x)
        loss.backward()
        grads.append((loss.detach().float(), model.tok_embeddings.weight.grad.float()))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=2e-2, rtol=2e-2)
    assert (grads[1][1] - grads[0][1]).abs().mean() < 1e-3


def test_flash_attn_pads_the_values_and_matches_sdpa():
    backend = get_attention_backend("flash_attn")
    if backend.unavailable_reason() is not None:
        pytest.skip(backend.unavailable_reason())
    reference = _model("deepseek_v3", "sdpa").to(torch.bfloat16)
    model = _model("deepseek_v3", "flash_attn").to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    x = torch.randint(0, 256, (2, 200), device="cuda")
    with torch.no_grad():
        error = (model(x).float() - reference(x).float()).abs()
    assert error.mean() < 5e-3


_RUN = {
    "deepseek_v3": (
        "model.family=deepseek_v3",
        "model.n_kv_heads=6",
        "model.head_dim=96",
        "model.mla_kv_rank=128",
        "model.mla_q_rank=192",
        "model.mla_rope_dim=32",
        "model.v_head_dim=64",
        "model.rope_interleave=true",
    ),
    "glm4_moe": (
        "model.family=glm4_moe",
        "model.qkv_bias=true",
        "model.qk_norm=head",
        "model.partial_rotary_factor=0.5",
    ),
}
_RUN_MOE = (
    "model.moe_router=sigmoid",
    "model.moe_experts=8",
    "model.moe_top_k=2",
    "model.moe_ffn_dim=256",
    "model.moe_dense_layers=[0]",
    "model.moe_shared_experts=1",
    "model.moe_groups=4",
    "model.moe_top_groups=2",
    "model.moe_routed_scale=2.5",
    "model.moe_bias_update_rate=0.001",
)


@pytest.mark.parametrize("family", _RUN)
def test_a_compiled_bf16_run_on_packed_documents_learns(tmp_path: Path, family):
    from lightning.pytorch.callbacks import LambdaCallback

    losses: list[float] = []
    overrides = [
        "recipe=pretrain/tiny_packed",
        "model=small",
        *_RUN[family],
        *_RUN_MOE,
        "trainer=gpu",
        "precision=bf16-mixed",
        "kernels=flex_compiled",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.sources.stdlib.max_documents=300",
        "data.seq_len=256",
        "data.batch_size=16",
        "trainer.max_steps=30",
        "trainer.accumulate_grad_batches=1",
        "trainer.val_check_interval=30",
        "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false",
        "scheduler.warmup=3",
        "run.checkpoint_every_n_steps=30",
        "callbacks=minimal",
    ]
    record = LambdaCallback(
        on_train_batch_end=lambda t, m, outputs, b, i: losses.append(float(outputs["loss"]))
    )
    result = run(compose_config(overrides), callbacks=[record])
    assert result.global_step == 30 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
