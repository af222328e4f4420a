"""LoRA's frozen projections stored in bf16 (``adapter.base_dtype``): the same matmuls
under autocast as fp32 weights, half their memory, and exports in the model's dtype."""

from __future__ import annotations

import weakref

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.adapters import apply_adapter, base_state_dict, merge_adapter
from recipes_lib.adapters.frozen_base import NarrowedLinear
from recipes_lib.config.schema import (
    AdapterConfig,
    KernelsConfig,
    PrecisionConfig,
    RunConfig,
    StrategyConfig,
)
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.preflight import check_adapter
from recipes_lib.training.build import ModelBuild, build_model

CONFIG = tiny_model_config(vocab_size=96)
ATTENTION = ["wq", "wk", "wv", "wo"]


def _built(precision: str, seed: int = 0, **adapter) -> torch.nn.Module:
    torch.manual_seed(seed)
    plan = ModelBuild(
        model=CONFIG,
        kernels=KernelsConfig(),
        precision=PrecisionConfig(name=precision),
        strategy=StrategyConfig(),
        adapter=AdapterConfig(kind="lora", r=4, alpha=8, dropout=0.0, **adapter),
    )
    model = build_model(plan, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: give the adapters an effect
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))


def _step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(_tokens())
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("targets", [None, ATTENTION])
def test_bf16_projections_give_the_same_step_under_autocast(targets):
    extra = {} if targets is None else {"target_modules": targets}
    narrowed = _built("bf16-mixed", **extra)  # base_dtype=auto
    kept = _built("bf16-mixed", base_dtype="float32", **extra)
    bf16 = {n for n, p in narrowed.named_parameters() if p.dtype == torch.bfloat16}
    # every projection of every block, adapted or not (MLP under attention-only LoRA)
    assert len(bf16) == CONFIG.n_layers * 7
    assert not any(".lora_" in n for n in bf16)
    assert all(not p.requires_grad for n, p in narrowed.named_parameters() if n in bf16)
    trained = [p for p in narrowed.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    assert narrowed.tok_embeddings.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in kept.parameters())
    logits, grads = _step(narrowed)
    kept_logits, kept_grads = _step(kept)
    assert torch.equal(logits, kept_logits)  # autocast casts the fp32 weights the same way
    assert grads.keys() == kept_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, kept_grads[name]), name


def test_fp32_precision_keeps_the_weights_and_bf16_runs_outside_autocast():
    assert not any(
        isinstance(m, NarrowedLinear) for m in _built("32-true").modules()
    )  # auto narrows under bf16-mixed only
    built = _built("bf16-mixed", base_dtype="float32")  # float32: as built
    assert not any(isinstance(m, NarrowedLinear) for m in built.modules())
    from recipes_lib.adapters.frozen_base import narrow_frozen_linears

    bf16 = Transformer(CONFIG).to(torch.bfloat16).requires_grad_(False)
    assert narrow_frozen_linears(bf16, torch.float32) == 0  # never wider
    assert narrow_frozen_linears(bf16, torch.bfloat16) == 0  # nothing to narrow
    model = _built("32-true", base_dtype="bfloat16")
    assert any(isinstance(m, NarrowedLinear) for m in model.modules())
    logits = model(_tokens())  # fp32 activations through bf16 weights, no autocast
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(_tokens())
    torch.testing.assert_close(logits, reference.float(), atol=0.1, rtol=0.05)


def test_exports_restore_the_model_dtype():
    narrowed = _built("bf16-mixed", target_modules=ATTENTION)
    kept = _built("bf16-mixed", base_dtype="float32", target_modules=ATTENTION)
    merged, reference = merge_adapter(narrowed), merge_adapter(kept)
    assert merged.keys() == reference.keys()
    for name, value in merged.items():
        assert value.dtype == torch.float32, name
        # the narrowed base is the fp32 one rounded to bf16, the adapters' update added
        expected = reference[name]
        if name.endswith(("w1.weight", "w2.weight", "w3.weight")):  # not adapted
            expected = expected.to(torch.bfloat16).float()
        torch.testing.assert_close(value, expected, atol=2e-2, rtol=1e-2)
    base = base_state_dict(narrowed)
    assert all(v.dtype == torch.float32 for v in base.values())
    wq = "layers.0.attention.wq.weight"
    assert torch.equal(base[wq], base_state_dict(kept)[wq].to(torch.bfloat16).float())


def test_bad_base_dtypes_are_refused_before_training():
    with pytest.raises(ConfigError, match="adapter.base_dtype='fp16' is not one of"):
        apply_adapter(torch.nn.Linear(2, 2), AdapterConfig(kind="lora", base_dtype="fp16"))
    cfg = RunConfig()
    cfg.adapter = AdapterConfig(kind="lora", base_dtype="bfloat16")
    cfg.precision = PrecisionConfig(name="fp8")
    with pytest.raises(ConfigError, match="adapter.base_dtype=bfloat16 with precision=fp8"):
        check_adapter(cfg)
    cfg.adapter.base_dtype = "auto"
    check_adapter(cfg)  # auto leaves float8's weights alone


def test_each_replaced_weight_is_freed_before_the_next_is_narrowed(monkeypatch):
    """Narrowing holds one fp32 weight beside its bf16 copy at a time, never the model's."""
    from recipes_lib.adapters import frozen_base

    model = _built("32-true", target_modules=ATTENTION)
    weights = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    alive_at_each_call = []
    narrow_one = frozen_base.NarrowedLinear.of

    def counted(linear, dtype):
        alive_at_each_call.append(sum(ref() is not None for ref in weights))
        return narrow_one(linear, dtype)

    monkeypatch.setattr(frozen_base.NarrowedLinear, "of", counted)
    narrowed = frozen_base.narrow_frozen_linears(model, torch.bfloat16)
    assert narrowed == CONFIG.n_layers * 7
    assert alive_at_each_call == [len(weights) - i for i in range(narrowed)]


def test_a_frozen_model_stores_its_projections_in_bf16_under_bf16_mixed():
    """A DPO reference or a teacher (built with trains=False) computes as before under
    autocast, with its blocks' projections stored in bf16."""

    def frozen(precision: str) -> torch.nn.Module:
        torch.manual_seed(0)
        plan = ModelBuild(
            model=CONFIG,
            kernels=KernelsConfig(),
            precision=PrecisionConfig(name=precision),
            strategy=StrategyConfig(),
            trains=False,
        )
        return build_model(plan, device=torch.device("cpu"))

    narrowed, kept = frozen("bf16-mixed"), frozen("32-true")
    assert not any(p.requires_grad for p in narrowed.parameters())
    bf16 = [n for n, p in narrowed.named_parameters() if p.dtype == torch.bfloat16]
    assert len(bf16) == CONFIG.n_layers * 7 and not any(
        isinstance(m, NarrowedLinear) for m in kept.modules()
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(narrowed(_tokens()), kept(_tokens()))
