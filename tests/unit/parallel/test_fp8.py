"""Float8 conversion: which layers it takes, and an emulated float8 training run on CPU.

torchao's float8 matmuls need float8 tensor cores; ``emulate=True`` computes them in
fp32 from the float8-rounded values instead, so the conversion, the casts and their
numerics are exercised here on CPU. Speed is for ``tests/gpu/test_fp8_gpu.py``.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recipes_lib.adapters import apply_adapter
from recipes_lib.config.schema import AdapterConfig, ModelConfig, PrecisionConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.models.head import OutputHead
from recipes_lib.parallel.fp8 import (
    Float8ScaleSync,
    convert_to_fp8,
    float8_layers,
    float8_linear_config,
    fp8_callbacks,
    fp8_plan,
    fp8_skip_reason,
    matches_skip,
)

# tiny-like, with each way a layer stays in bf16 at fp8_min_features=128:
# wq (128 -> 128) and wo (128 -> 128) are converted; wk, wv (128 -> 64) are small;
# w1, w3 (128 -> 264) and w2 (264 -> 128) are not multiples of 16; output is skipped
MIXED = ModelConfig(
    vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=264, max_seq_len=64
)
# every block matmul converted, the head kept
TRAINABLE = ModelConfig(
    vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256, max_seq_len=64
)
FP8 = PrecisionConfig(name="fp8", fp8_min_features=128)


@pytest.fixture
def torchao_float8():
    return pytest.importorskip("torchao.float8", reason="torchao is not installed")


@pytest.mark.parametrize(
    "name,patterns,expected",
    [
        ("output", ["output"], True),
        ("model.output", ["output"], True),  # a trailing part of the name
        ("layers.0.attention.wo", ["wo"], True),
        ("layers.0.attention.wo", ["attention.w?"], True),
        ("layers.0.attention.wq.base_layer", ["wq"], True),  # through peft's wrapper
        ("layers.0.feed_forward.w1", ["layers.0.*"], True),
        ("layers.10.feed_forward.w1", ["layers.1.*"], False),
        ("layers.0.attention.wo", ["output"], False),
        ("outputs", ["output"], False),
        ("layers.0.attention.wo", [], False),
    ],
)
def test_skip_patterns_match_names_and_their_trailing_parts(name, patterns, expected):
    assert matches_skip(name, patterns) is expected


@pytest.mark.parametrize(
    "name,shape,reason",
    [
        ("layers.0.attention.wq", (2048, 2048), None),
        ("output", (2048, 32000), "matches precision.fp8_skip=['output']"),
        ("layers.0.attention.wk", (2048, 512), "out_features=512 is below"),
        ("layers.0.feed_forward.w2", (512, 2048), "in_features=512 is below"),
        ("layers.0.feed_forward.w1", (2048, 5464), "out_features=5464 is not a multiple of 16"),
        ("layers.0.attention.wq.lora_A.default", (2048, 2048), "a LoRA factor"),
    ],
)
def test_skip_reason_of_each_kind(name, shape, reason):
    got = fp8_skip_reason(name, *shape, PrecisionConfig(name="fp8"))
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason)


def test_plan_of_a_model_keeps_the_head_small_and_misaligned_layers_in_bf16():
    with torch.device("meta"):
        model = Transformer(MIXED)
    plan = fp8_plan(model, FP8)
    converted = sorted(name for name, reason in plan.items() if reason is None)
    assert converted == [f"layers.{i}.attention.{w}" for i in (0, 1) for w in ("wo", "wq")]
    assert "fp8_skip" in plan["output"]
    assert "below precision.fp8_min_features=128" in plan["layers.0.attention.wk"]
    assert "not a multiple of 16" in plan["layers.1.feed_forward.w1"]
    assert "not a multiple of 16" in plan["layers.1.feed_forward.w2"]


def test_convert_swaps_exactly_the_planned_layers(torchao_float8):
    model = Transformer(MIXED)
    planned = [name for name, reason in fp8_plan(model, FP8).items() if reason is None]
    converted = convert_to_fp8(model, FP8, emulate=True)
    assert converted == planned == float8_layers(model)
    assert isinstance(model.layers[0].attention.wq, torchao_float8.float8_linear.Float8Linear)
    assert type(model.output) is OutputHead
    for kept in (model.layers[0].attention.wk, model.layers[0].feed_forward.w2):
        assert type(kept) is nn.Linear
    # a second conversion finds nothing left to convert and changes nothing
    assert convert_to_fp8(model, FP8, emulate=True) == converted


def test_convert_keeps_weights_and_ties(torchao_float8):
    tied = ModelConfig(**{**vars(TRAINABLE), "tie_embeddings": True})
    model = Transformer(tied)
    weight = model.layers[0].feed_forward.w1.weight
    convert_to_fp8(model, PrecisionConfig(name="fp8", fp8_min_features=128, fp8_skip=[]))
    assert model.layers[0].feed_forward.w1.weight is weight  # the same Parameter, not a copy
    assert "output" in float8_layers(model)
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("name", ["32-true", "bf16-mixed", "bf16-true"])
def test_convert_is_a_no_op_for_other_precisions(name):
    model = Transformer(TRAINABLE)
    assert convert_to_fp8(model, PrecisionConfig(name=name, fp8_min_features=128)) == []
    assert float8_layers(model) == []


def test_convert_without_torchao_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"pip install 'recipes-lib\[fp8\]'"):
        convert_to_fp8(Transformer(TRAINABLE), FP8)


def test_bad_recipe_is_refused_naming_the_key():
    precision = PrecisionConfig(name="fp8", fp8_recipe="delayed")
    with pytest.raises(ConfigError, match="precision.fp8_recipe='delayed'"):
        convert_to_fp8(Transformer(TRAINABLE), precision)


def test_recipes_and_fsdp_float8_all_gather(torchao_float8):
    granularity = torchao_float8.ScalingGranularity
    tensorwise = float8_linear_config(FP8, fsdp=True)
    assert tensorwise.enable_fsdp_float8_all_gather
    assert tensorwise.cast_config_weight.scaling_granularity is granularity.TENSORWISE
    assert not float8_linear_config(FP8, fsdp=False).enable_fsdp_float8_all_gather
    rowwise = float8_linear_config(
        PrecisionConfig(name="fp8", fp8_recipe="rowwise"), fsdp=True, emulate=True
    )
    assert not rowwise.enable_fsdp_float8_all_gather  # tensorwise scaling only
    assert rowwise.cast_config_input.scaling_granularity is granularity.AXISWISE
    assert rowwise.emulate


def test_conversion_on_meta_before_sharding_wraps_weights_for_float8_all_gather(torchao_float8):
    with torch.device("meta"):
        model = Transformer(TRAINABLE)
    convert_to_fp8(model, FP8, fsdp=True)
    weight = model.layers[0].attention.wq.weight
    assert weight.is_meta
    assert type(weight.data).__name__ == "WeightWithDynamicFloat8CastTensor"
    assert type(model.output.weight.data) is torch.Tensor


def test_scale_sync_runs_once_per_optimizer_step(monkeypatch, torchao_float8):
    calls = []
    monkeypatch.setattr(
        torchao_float8, "precompute_float8_dynamic_scale_for_fsdp", lambda m: calls.append(m)
    )
    sync = Float8ScaleSync()
    trainer, module = SimpleNamespace(global_step=0), object()
    sync.on_train_start(trainer, module)
    # two micro-batches of gradient accumulation per optimizer step: the first of each
    # ends with the step unchanged, the second with the step taken
    for batch_idx, step in enumerate([0, 1, 1, 2, 2, 3]):
        trainer.global_step = step
        sync.on_train_batch_end(trainer, module, None, None, batch_idx)
    assert len(calls) == 3 and all(m is module for m in calls)


def test_scale_sync_callback_only_with_float8_all_gather():
    assert [type(c) for c in fp8_callbacks(FP8, fsdp=True)] == [Float8ScaleSync]
    assert fp8_callbacks(FP8, fsdp=False) == []
    assert fp8_callbacks(PrecisionConfig(name="fp8", fp8_recipe="rowwise"), fsdp=True) == []
    assert fp8_callbacks(PrecisionConfig(name="bf16-mixed"), fsdp=True) == []


def _sequences(generator: torch.Generator, vocab: int) -> torch.Tensor:
    """Arithmetic progressions mod ``vocab`` from random starts: learnable in a few steps."""
    starts = torch.randint(0, vocab, (4, 1), generator=generator)
    return (starts + 7 * torch.arange(25)) % vocab  # (B, T + 1)


def _train(model: nn.Module, steps: int) -> list[float]:
    """A bf16-autocast training loop on CPU; the same batches for every model."""
    generator = torch.Generator().manual_seed(0)
    # at 3e-3 this model trains on the edge of instability, which amplifies any difference
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        ids = _sequences(generator, TRAINABLE.vocab_size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_training_follows_bf16(recipe, torchao_float8):
    torch.manual_seed(0)
    reference = Transformer(TRAINABLE)
    model = copy.deepcopy(reference)
    precision = PrecisionConfig(name="fp8", fp8_recipe=recipe, fp8_min_features=128)
    assert len(convert_to_fp8(model, precision, emulate=True)) == 2 * 7  # all but the head
    steps = 12
    expected, got = _train(reference, steps), _train(model, steps)
    assert expected[-1] < expected[0] - 0.5  # the batches are being learnt
    # float8 (e4m3, 3 mantissa bits) rounds each operand by up to ~6%, but the errors
    # average out over the 128-long dot products: the curves differ by about 0.01
    # (recorded: at most 0.012 over 16 steps); 0.05 leaves room for other CPUs' kernels
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 0.05, (got, expected)


@pytest.mark.slow
def test_lora_trains_over_float8_base_layers(torchao_float8):
    torch.manual_seed(0)
    model = Transformer(TRAINABLE)
    apply_adapter(model, AdapterConfig(kind="lora", r=16, dropout=0.0))
    converted = convert_to_fp8(model, FP8, emulate=True)
    assert "layers.0.attention.wq.base_layer" in converted
    assert not any(".lora_" in name for name in converted)  # the factors stay as they are
    base = model.layers[0].attention.wq.base_layer.weight.detach().clone()
    losses = _train(model, 4)
    assert losses[-1] < losses[0]
    assert torch.equal(model.layers[0].attention.wq.base_layer.weight, base)  # frozen
    assert model.layers[0].attention.wq.lora_B["default"].weight.abs().sum() > 0
