"""The pre-launch check's figures from a config alone: the memory estimate's pieces, the
token budget and the expected step time (no data, no weights, no GPU)."""

from __future__ import annotations

import functools

import pytest
import torch

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.launch_check import estimate_memory, step_time, token_budget
from recipes_lib.launch_check.activations import DecoderShape
from recipes_lib.launch_check.budget import ASSUMED_MFU, step_flops
from recipes_lib.launch_check.memory import nf4_bytes_per_weight
from recipes_lib.launch_check.optimizer_state import trainable_parameters
from recipes_lib.launch_check.parameters import ParameterCounts
from recipes_lib.models import Transformer

# a small decoder whose activations and logits matter, on the CPU (no CUDA overhead)
SMALL = (
    "model=tiny",
    "trainer.accelerator=cpu",
    "data.seq_len=512",
    "data.batch_size=4",
    "model.max_seq_len=512",
)


@functools.cache
def cfg_of(*overrides: str):
    return to_run_config(compose_config([*SMALL, *overrides]))


def meta_params(cfg) -> int:
    with torch.device("meta"):
        return Transformer(cfg.model).num_params()


def meta_tensors(cfg) -> int:
    with torch.device("meta"):
        return len(list(Transformer(cfg.model).parameters()))


@pytest.mark.parametrize(
    "model",
    [
        "tiny",
        "llama_1b",
        "llama_8b",
        "qwen2_0_5b",
        "smollm_135m",
        "qwen3_0_6b",
        "olmo2_1b",
        "smollm3_3b",
        "phi4_mini",
        "gemma3_1b",
        "qwen3_4b",
        "olmo2_7b",
        "olmo3_7b",
        "moe_tiny",
        "moe_1b",
        "olmoe_1b_7b",
        "qwen3_30b_a3b",
        "mixtral_8x7b",
        "qwen3_5_0_8b",
        "qwen3_5_35b_a3b",
    ],
)
def test_shapes_count_the_parameters_the_model_has(model):
    cfg = to_run_config(compose_config([f"model={model}"]))
    assert DecoderShape.of(cfg).num_params() == meta_params(cfg)


@pytest.mark.parametrize(
    ("precision", "weight", "grad", "moments"),
    [("32-true", 4, 4, 8), ("bf16-mixed", 4, 4, 8), ("bf16-true", 2, 2, 4)],
)
def test_full_training_stores_weights_gradients_and_two_moments(precision, weight, grad, moments):
    cfg = cfg_of(f"precision={precision}")
    n = meta_params(cfg)
    est = estimate_memory(cfg, world_size=1)
    assert est.parameters == n * weight  # fp32 master weights under bf16-mixed
    assert est.gradient_bytes == n * grad
    # AdamW: two moments per parameter, a 4-byte step count per tensor
    assert est.optimizer == n * moments + 4 * meta_tensors(cfg)
    assert est.overhead == 0  # no CUDA context on a CPU
    assert est.allocated == max(est.build, sum_of_pieces(est))
    assert est.total == est.allocated + est.overhead


def sum_of_pieces(est) -> int:
    pieces = ("parameters", "gradients", "optimizer", "activations", "logits", "transient")
    return sum(getattr(est, name) for name in (*pieces, "buffers"))


def test_sharded_strategies_divide_what_they_shard_by_the_world_size():
    single = estimate_memory(cfg_of("precision=bf16-mixed"), world_size=1)
    fsdp = estimate_memory(cfg_of("precision=bf16-mixed", "strategy=fsdp"), world_size=4)
    assert fsdp.parameters == single.parameters // 4
    assert fsdp.gradient_bytes == single.gradient_bytes // 4
    assert fsdp.optimizer == single.optimizer // 4
    zero2 = estimate_memory(cfg_of("precision=bf16-mixed", "strategy=deepspeed_zero2"), 4)
    assert zero2.parameters == single.parameters  # ZeRO-2 keeps whole weights
    assert zero2.gradient_bytes == single.gradient_bytes // 4
    assert zero2.optimizer == single.optimizer // 4
    ddp = estimate_memory(cfg_of("precision=bf16-mixed", "strategy=ddp"), world_size=4)
    assert (ddp.parameters, ddp.optimizer) == (single.parameters, single.optimizer)


def test_cpu_offload_moves_the_sharded_state_off_the_gpu():
    cfg = cfg_of("precision=bf16-mixed", "strategy=fsdp", "strategy.cpu_offload=true")
    est = estimate_memory(cfg, world_size=2)
    assert est.parameters == est.gradient_bytes == est.optimizer == 0
    assert est.build == est.buffers  # built on the CPU
    assert any("cpu_offload" in note for note in est.notes)


def test_activation_checkpointing_keeps_only_block_inputs():
    plain = estimate_memory(cfg_of("precision=bf16-mixed"), world_size=1)
    checkpointed = estimate_memory(
        cfg_of("precision=bf16-mixed", "kernels.activation_checkpointing=true"), world_size=1
    )
    shape, tokens = DecoderShape.of(cfg_of()), 4 * 512
    assert checkpointed.activations < plain.activations
    assert checkpointed.allocated < plain.allocated
    # at the loss, the blocks keep their fp32 inputs and nothing else
    if checkpointed.phase in ("forward", "backward start"):
        inputs = shape.n_layers * tokens * 4 * shape.dim
        assert inputs < checkpointed.activations < inputs + tokens * 16 * shape.dim


def test_lora_trains_only_the_adapters_and_qlora_stores_the_base_in_4_bit():
    full = estimate_memory(cfg_of("precision=bf16-mixed"), world_size=1)
    lora_cfg_args = ("precision=bf16-mixed", "adapter=lora", "adapter.r=4")
    lora_cfg = cfg_of(*lora_cfg_args)
    lora = estimate_memory(cfg_of(*lora_cfg_args, "adapter.base_dtype=float32"), world_size=1)
    narrowed = estimate_memory(lora_cfg, world_size=1)  # base_dtype=auto: bf16 projections
    qlora = estimate_memory(cfg_of("precision=bf16-mixed", "adapter=qlora", "adapter.r=4"), 1)
    shape = DecoderShape.of(lora_cfg)
    adapters = ParameterCounts.of(shape, lora_cfg).adapters
    linears = shape.linears()
    assert adapters == shape.n_layers * 4 * sum(i + o for i, o in linears.values())
    assert lora.gradient_bytes == adapters * 4
    assert lora.optimizer == adapters * 8 + 4 * 2 * shape.n_layers * len(linears)  # A and B
    assert lora.parameters == (meta_params(lora_cfg) + adapters) * 4
    base = shape.n_layers * sum(i * o for i, o in linears.values())
    assert ParameterCounts.of(shape, lora_cfg).narrowed == base  # a dense model's linears
    assert narrowed.parameters == lora.parameters - 2 * base
    assert qlora.parameters == pytest.approx(
        lora.parameters - base * 4 + base * nf4_bytes_per_weight(True), abs=1
    )
    assert qlora.parameters < lora.parameters < full.parameters + adapters * 4 + 1


def test_the_chunked_loss_never_holds_the_whole_logits():
    shape = DecoderShape.of(cfg_of())
    whole = estimate_memory(cfg_of(), world_size=1)
    chunked = estimate_memory(cfg_of("kernels.loss_chunk_size=256"), world_size=1)
    assert whole.logits >= 4 * 512 * shape.vocab_size * 4  # B*T*V*4 at least
    assert chunked.logits < whole.logits
    assert chunked.logits <= 256 * shape.vocab_size * 12


def test_a_longer_micro_batch_needs_more_memory():
    short = estimate_memory(cfg_of(), world_size=1)
    long = estimate_memory(cfg_of("data.batch_size=8"), world_size=1)
    assert long.activations + long.logits > short.activations + short.logits
    assert long.parameters == short.parameters


def test_token_budget_counts_steps_times_global_batch_times_sequence():
    cfg = cfg_of("trainer.max_steps=100", "trainer.accumulate_grad_batches=2")
    budget = token_budget(cfg, world_size=2)
    assert budget.tokens_per_step == 512 * 4 * 2 * 2
    assert budget.tokens == 100 * budget.tokens_per_step
    assert budget.parameters == meta_params(cfg)
    assert budget.tokens_per_parameter == pytest.approx(budget.tokens / budget.parameters)
    assert "under Chinchilla's ~20" in budget.summary()
    long = token_budget(cfg_of("trainer.max_steps=100000"), world_size=8)
    assert long.tokens_per_parameter > 20 and "over Chinchilla's ~20" in long.summary()
    by_tokens = token_budget(cfg_of("stage.max_tokens=1000000"), world_size=1)
    assert by_tokens.steps == -(-1_000_000 // (512 * 4))  # stage.max_tokens wins
    tuned = token_budget(cfg_of("stage=sft"), world_size=1)
    assert "fine-tuning" in tuned.summary()


def test_step_time_is_the_flops_at_the_assumed_mfu_of_the_cards_peak():
    cfg = cfg_of("precision=bf16-mixed", "trainer.accumulate_grad_batches=2")
    with torch.device("meta"):
        per_token = Transformer(cfg.model).flops_per_token(512)
    assert step_flops(cfg, world_size=2) == pytest.approx(per_token * 4 * 512 * 2 * 2)
    on_h100 = step_time(cfg, world_size=2, device_name="NVIDIA H100 80GB HBM3")
    expected = on_h100.flops / (2 * 989.5e12 * ASSUMED_MFU)
    assert on_h100.seconds == pytest.approx(expected)
    assert "989.5 TFLOP/s" in on_h100.summary()
    unknown = step_time(cfg_of(), world_size=1)  # trainer.accelerator=cpu
    assert unknown.seconds is None and "unknown card" in unknown.summary()
    recomputed = step_flops(cfg_of("kernels.activation_checkpointing=true"), world_size=1)
    assert recomputed == pytest.approx(step_flops(cfg_of(), world_size=1) * 8 / 6)


def test_adapters_on_the_experts_are_counted_as_the_model_makes_them():
    """LoRA on the attention and a mixture's experts (a dense layer kept): the count is
    the adapted model's own number of adapter parameters."""
    from recipes_lib.adapters import apply_adapter

    cfg = cfg_of(
        "model=moe_tiny",
        "model.moe_dense_layers=[0]",
        "adapter=lora",
        "adapter.r=4",
        "adapter.dropout=0",
        "adapter.target_modules=[wq,wv,experts]",
    )
    counted = ParameterCounts.of(DecoderShape.of(cfg), cfg)
    model = apply_adapter(Transformer(cfg.model), cfg.adapter)
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    made = sum(p.numel() for p in adapters)
    assert counted.adapters == made
    # the optimizer state is counted over tensors of the shapes the model makes
    counted_shapes = sorted(p.shape for p in trainable_parameters(cfg))
    assert counted_shapes == sorted(tuple(p.shape) for p in adapters)
    assert estimate_memory(cfg).optimizer == made * 8 + 4 * len(adapters)


def test_adapters_on_a_hybrid_stack_are_counted_as_the_model_makes_them():
    """LoRA on Qwen3.5's attention, linear-attention and MLP projections: the attention's
    only in its attention layers, the linear attention's only in its linear ones."""
    from recipes_lib.adapters import apply_adapter

    cfg = cfg_of(
        "model=qwen3_5_0_8b",
        "model.vocab_size=512",
        "model.dim=64",
        "model.n_layers=4",
        "model.linear_layers=[0,1,2]",
        "model.head_dim=16",
        "model.n_heads=4",
        "model.ffn_dim=96",
        "model.linear_heads=4",
        "model.linear_key_heads=2",
        "model.linear_key_dim=8",
        "model.linear_value_dim=8",
        "adapter=lora",
        "adapter.r=4",
        "adapter.target_modules=[wq,wo,w2,in_proj_qkv,in_z,out_proj]",
    )
    counted = ParameterCounts.of(DecoderShape.of(cfg), cfg)
    model = apply_adapter(Transformer(cfg.model), cfg.adapter)
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert counted.adapters == sum(p.numel() for p in adapters)
    counted_shapes = sorted(p.shape for p in trainable_parameters(cfg))
    assert counted_shapes == sorted(tuple(p.shape) for p in adapters)


@pytest.mark.parametrize("q_rank", ["12", "null"])
def test_adapters_on_latent_attention_are_counted_as_the_model_makes_them(q_rank):
    """LoRA on DeepSeek-V3's latent attention: its own projections (the query latent or
    one projection, the key/value latent and expansion) and its output, whose input is
    the value heads' width, not the query heads'."""
    from recipes_lib.adapters import apply_adapter

    targets = "[wq_a,wq_b,wkv_a,wkv_b,wo]" if q_rank != "null" else "[wq,wkv_a,wkv_b,wo]"
    cfg = cfg_of(
        *DEEPSEEK_V3_TINY,
        f"model.mla_q_rank={q_rank}",
        "adapter=lora",
        "adapter.r=4",
        f"adapter.target_modules={targets}",
    )
    counted = ParameterCounts.of(DecoderShape.of(cfg), cfg)
    model = apply_adapter(Transformer(cfg.model), cfg.adapter)
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert counted.adapters == sum(p.numel() for p in adapters)
    counted_shapes = sorted(p.shape for p in trainable_parameters(cfg))
    assert counted_shapes == sorted(tuple(p.shape) for p in adapters)


def test_frozen_models_count_their_bf16_projections_and_a_teacher_its_own_shape(tmp_path):
    """A separate DPO reference and a distillation's teacher are counted in the run's
    storage dtype, their blocks' projections in bf16 under bf16-mixed; a teacher whole
    on each rank even when the student is sharded."""
    from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
    from recipes_lib.launch_check.parameters import projection_params

    base = ("precision=bf16-mixed", "stage=dpo", "data=stdlib_dpo")
    live = estimate_memory(cfg_of(*base), world_size=1)
    gone = estimate_memory(cfg_of(*base, "stage.dpo.precompute_reference=true"), 1)
    total, projections = meta_params(cfg_of(*base)), projection_params(cfg_of(*base).model)
    assert 0 < projections < total
    assert live.parameters - gone.parameters == (total - projections) * 4 + projections * 2
    fp32 = estimate_memory(cfg_of(*base[1:], "precision=32-true"), 1)
    fp32_gone = estimate_memory(
        cfg_of(*base[1:], "precision=32-true", "stage.dpo.precompute_reference=true"), 1
    )
    assert fp32.parameters - fp32_gone.parameters == total * 4  # nothing narrowed

    teacher_cfg = cfg_of("model.dim=256", "model.n_heads=8", "model.n_layers=3")
    export_hf_checkpoint(Transformer(teacher_cfg.model), teacher_cfg.model, tmp_path / "t")
    student = ("precision=bf16-mixed", "stage=distill", "data=stdlib_sft")
    alone = estimate_memory(cfg_of(*student), 1)
    taught = estimate_memory(cfg_of(*student, f"stage.distill.teacher_from={tmp_path / 't'}"), 1)
    t_total, t_projections = meta_params(teacher_cfg), projection_params(teacher_cfg.model)
    assert taught.parameters - alone.parameters == (t_total - t_projections) * 4 + t_projections * 2
    sharded = estimate_memory(
        cfg_of(*student, f"stage.distill.teacher_from={tmp_path / 't'}", "strategy=fsdp"), 2
    )
    sharded_alone = estimate_memory(cfg_of(*student, "strategy=fsdp"), 2)
    assert sharded.parameters - sharded_alone.parameters == taught.parameters - alone.parameters


# a few-layer Qwen3.5 (three linear-attention layers, one attention layer) and
# DeepSeek-V3 (latent attention, the first layer dense)
QWEN3_5_TINY = (
    "model=qwen3_5_0_8b",
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_layers=4",
    "model.linear_layers=[0,1,2]",
    "model.head_dim=16",
    "model.n_heads=4",
    "model.ffn_dim=96",
    "model.linear_heads=4",
    "model.linear_key_heads=2",
    "model.linear_key_dim=8",
    "model.linear_value_dim=8",
)
DEEPSEEK_V3_TINY = (
    "model=deepseek_v3_671b",
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_layers=3",
    "model.moe_dense_layers=[0]",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.head_dim=24",
    "model.mla_rope_dim=8",
    "model.mla_kv_rank=16",
    "model.v_head_dim=12",
    "model.ffn_dim=96",
    "model.moe_experts=8",
    "model.moe_groups=4",
    "model.moe_top_groups=2",
    "model.moe_top_k=2",
    "model.moe_ffn_dim=16",
)


@pytest.mark.parametrize(
    "moe",
    [
        (),
        ("model=moe_tiny",),
        ("model=moe_tiny", "model.moe_dense_layers=[0]"),
        ("model=moe_tiny", "model.moe_shared_experts=1"),
        ("model.family=qwen2", "model.qkv_bias=true"),
        QWEN3_5_TINY,
        (
            *DEEPSEEK_V3_TINY,
            "model.mla_q_rank=12",
            "model.qkv_bias=true",
            "model.attention_out_bias=true",
        ),
        (*DEEPSEEK_V3_TINY, "model.mla_q_rank=null"),
    ],
    ids=["dense", "moe", "moe_dense_layer", "moe_shared", "qkv_bias", "linear", "mla", "mla_wq"],
)
def test_the_counted_projections_are_the_ones_a_frozen_model_narrows(moe):
    from recipes_lib.adapters.frozen_base import narrow_frozen_linears
    from recipes_lib.launch_check.parameters import projection_params

    cfg = cfg_of(*moe)
    model = Transformer(cfg.model).requires_grad_(False)
    before = {n: p.dtype for n, p in model.named_parameters()}
    narrow_frozen_linears(model, torch.bfloat16)
    narrowed = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dtype == torch.bfloat16 and before[n] != torch.bfloat16
    )
    assert narrowed == projection_params(cfg.model) > 0


def test_kto_keeps_the_activations_of_its_completions_alone():
    """Its twins run without a gradient: B completions keep what B / 2 DPO pairs keep."""
    kto = estimate_memory(cfg_of("stage=kto", "data=stdlib_kto", "data.batch_size=4"), 1)
    dpo = estimate_memory(cfg_of("stage=dpo", "data=stdlib_dpo", "data.batch_size=2"), 1)
    twice = estimate_memory(cfg_of("stage=dpo", "data=stdlib_dpo", "data.batch_size=4"), 1)
    assert kto.activations == dpo.activations < twice.activations
