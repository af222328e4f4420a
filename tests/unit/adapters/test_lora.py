"""LoRA on the native model: only adapters train, merging is exact, PEFT loads the export."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.adapters import (
    adapters_disabled,
    apply_adapter,
    base_state_dict,
    check_adapter_config,
    has_adapter,
    merge_adapter,
    save_adapter,
)
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.config.schema import AdapterConfig, OptimConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.optim import build_optimizer

SHAPES = {
    "llama": tiny_model_config(vocab_size=96),
    "qwen2": tiny_model_config(vocab_size=96, qkv_bias=True, family="qwen2", tie_embeddings=True),
}


def _adapted(shape="llama", seed=0, **adapter) -> tuple[Transformer, AdapterConfig]:
    torch.manual_seed(seed)
    config = AdapterConfig(kind="lora", r=4, alpha=8, dropout=0.0, **adapter)
    return apply_adapter(Transformer(SHAPES[shape]), config), config


def _randomize_lora_b(model: torch.nn.Module, seed: int = 1) -> None:
    """lora_B starts at zero (the adapter is a no-op); give it values to test against."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def _tokens(batch=2, length=12, vocab=96, seed=3):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_only_lora_weights_are_trainable_and_train():
    model, _ = _adapted()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 linears x (A, B)
    assert len(trainable) == 2 * 7 * 2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)
    tokens = _tokens()
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for name, param in model.named_parameters():
        if name in trainable:
            assert not torch.equal(param, before[name]), f"{name} did not train"
        else:
            assert torch.equal(param, before[name]), f"frozen {name} changed"


@pytest.mark.parametrize("shape", ["llama", "qwen2"])
def test_merged_weights_give_the_adapted_logits(shape):
    model, _ = _adapted(shape)
    _randomize_lora_b(model)
    tokens = _tokens()
    with torch.no_grad():
        adapted = model(tokens)
        with adapters_disabled(model):
            base_logits = model(tokens)
    merged = merge_adapter(model)
    plain = Transformer(SHAPES[shape])
    plain.load_state_dict(merged)
    assert not any("lora" in k or "base_layer" in k for k in merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), adapted, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(base_logits, adapted, atol=1e-3)
    # the merge is W + (alpha / r) * B @ A, layer by layer
    layer = model.layers[0].attention.wq
    expected = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ (
        layer.lora_A["default"].weight
    )
    torch.testing.assert_close(merged["layers.0.attention.wq.weight"], expected.detach())
    base = Transformer(SHAPES[shape])
    base.load_state_dict(base_state_dict(model))
    with torch.no_grad():
        torch.testing.assert_close(base(tokens), base_logits)


def test_merge_takes_adapters_from_a_given_state():
    model, _ = _adapted()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    key = "layers.1.feed_forward.w2.lora_B.default.weight"
    state[key] = torch.full_like(state[key], 0.01)
    merged = merge_adapter(model, state)
    layer = model.layers[1].feed_forward.w2
    expected = layer.base_layer.weight + 2.0 * state[key] @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged["layers.1.feed_forward.w2.weight"], expected.detach())
    assert torch.equal(
        merged["layers.0.feed_forward.w2.weight"], model.layers[0].feed_forward.w2.base_layer.weight
    )


def test_disabling_adapters_restores_trainability():
    model, _ = _adapted()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with adapters_disabled(model):
        pass
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def test_hugging_face_target_names_and_subsets():
    model, _ = _adapted(target_modules=["q_proj", "v_proj"])
    adapted = {n.rsplit(".", 2)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {
        f"layers.{i}.attention.{m}.lora_{f}" for i in (0, 1) for m in ("wq", "wv") for f in "AB"
    }


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"kind": "dora"}, "adapter.kind='dora'"),
        ({"r": 0}, "adapter.r=0"),
        ({"dropout": 1.0}, "adapter.dropout=1.0"),
        ({"target_modules": ["attn"]}, "adapter.target_modules: 'attn'"),
        ({"target_modules": []}, "adapter.target_modules"),
        ({"base_dtype": "fp16"}, "adapter.base_dtype='fp16'"),
    ],
)
def test_bad_adapter_configs_name_the_key(changes, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        check_adapter_config(AdapterConfig(**{"kind": "lora", **changes}))


def test_none_leaves_the_model_alone():
    model = Transformer(SHAPES["llama"])
    assert apply_adapter(model, AdapterConfig(kind="none")) is model
    assert not has_adapter(model)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_qlora_without_a_gpu_is_a_clear_config_error():
    with pytest.raises(ConfigError, match="adapter.kind=qlora needs .*(bitsandbytes|CUDA GPU)"):
        check_adapter_config(AdapterConfig(kind="qlora"))
    with pytest.raises(ConfigError, match="adapter.kind=qlora"):
        apply_adapter(Transformer(SHAPES["llama"]), AdapterConfig(kind="qlora"))


@pytest.mark.parametrize("shape", ["llama", "qwen2"])
def test_saved_adapter_loads_in_peft_on_the_transformers_model(tmp_path, shape):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model, config = _adapted(shape, target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    _randomize_lora_b(model)
    model.eval()
    base_dir = export_hf_checkpoint(base_state_dict(model), SHAPES[shape], tmp_path / "base")
    adapter_dir = save_adapter(
        model, tmp_path / "adapter", config, base_model_name_or_path=str(base_dir)
    )

    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["lora_alpha"] == 8
    assert sorted(saved["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
        with hf.disable_adapter():
            theirs_base = hf(input_ids=tokens).logits
        with adapters_disabled(model):
            ours_base = model(tokens)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(theirs_base, ours_base, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ours, ours_base, atol=1e-3)


def test_causal_lm_module_adapts_the_model_after_loading_its_weights(tmp_path):
    from recipes_lib.checkpoint.weights import save_weights
    from recipes_lib.config.schema import KernelsConfig, SchedulerConfig
    from recipes_lib.objectives.sft import SFTModule

    torch.manual_seed(7)
    weights = Transformer(SHAPES["llama"]).state_dict()
    save_weights(weights, tmp_path / "model.safetensors")
    module = SFTModule(
        SHAPES["llama"],
        KernelsConfig(),
        OptimConfig(),
        SchedulerConfig(),
        total_steps=10,
        tokens_per_step=64,
        init_from=str(tmp_path / "model.safetensors"),
        adapter=AdapterConfig(kind="lora", r=2, alpha=4),
    )
    module.configure_model()
    assert has_adapter(module.model)
    assert module.hparams["adapter"]["kind"] == "lora"
    for name, value in base_state_dict(module.model).items():
        assert torch.equal(value, weights[name]), name  # the loaded weights, not a fresh init
    optimizer = module.configure_optimizers()["optimizer"]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    lora = {id(p) for n, p in module.model.named_parameters() if "lora_" in n}
    assert optimized == lora
    plain = Transformer(SHAPES["llama"])
    assert module.flops_per_token(16) == plain.flops_per_token(16)  # counted on the base shape
    batch = {"input_ids": _tokens(), "labels": _tokens(seed=4)}
    batch["labels"][:, :6] = -100
    loss, metrics = module.compute_loss(batch)
    assert torch.isfinite(loss) and metrics["assistant_tokens"] == 2 * 6


def test_saved_adapter_weights_follow_the_umask(tmp_path):
    # safetensors creates its files 0600, whatever the umask
    model, config = _adapted("llama")
    previous = os.umask(0o022)
    try:
        folder = save_adapter(model, tmp_path / "adapter", config)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((folder / "adapter_model.safetensors").stat().st_mode) == 0o644
