"""The precision group: its Lightning strings, and every combination refused before training."""

from __future__ import annotations

import sys

import pytest
import torch

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.schema import (
    AdapterConfig,
    KernelsConfig,
    ModelConfig,
    PrecisionConfig,
    RunConfig,
    StrategyConfig,
    TrainerConfig,
)
from recipes_lib.errors import ConfigError
from recipes_lib.parallel.precision import (
    PRECISIONS,
    detect_cpu_bf16,
    detect_cuda_capability,
    lightning_precision,
)
from recipes_lib.preflight import check_precision, check_run

H100 = (9, 0)
# every Linear but the head has both dimensions >= 1024 and a multiple of 16
FP8_MODEL = ModelConfig(
    name="fp8-shape", vocab_size=4096, dim=1024, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=2816
)


def _cfg(
    precision: str = "fp8",
    accelerator: str = "gpu",
    model: ModelConfig = FP8_MODEL,
    **precision_fields,
) -> RunConfig:
    return RunConfig(
        model=model,
        trainer=TrainerConfig(accelerator=accelerator),
        precision=PrecisionConfig(name=precision, **precision_fields),
    )


def _check(cfg: RunConfig, capability=H100, cpu_bf16: bool = True) -> None:
    check_precision(cfg, cuda_capability=capability, cpu_bf16=cpu_bf16)


@pytest.fixture
def torchao_float8():
    return pytest.importorskip("torchao.float8", reason="torchao is not installed")


@pytest.mark.parametrize(
    "name,expected",
    [
        ("32-true", "32-true"),
        ("bf16-mixed", "bf16-mixed"),
        ("bf16-true", "bf16-true"),
        ("fp8", "bf16-mixed"),  # float8 matmuls inside bf16 autocast
    ],
)
def test_lightning_precision(name, expected):
    assert lightning_precision(PrecisionConfig(name=name)) == expected


def test_every_precision_has_a_config_group_option():
    for name in PRECISIONS:
        cfg = to_run_config(compose_config([f"precision={name}"]))
        assert cfg.precision.name == name


def test_unknown_precision_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="precision.name='16-mixed'"):
        lightning_precision(PrecisionConfig(name="16-mixed"))
    with pytest.raises(ConfigError, match="precision.name='fp4'"):
        _check(_cfg("fp4"))


@pytest.mark.parametrize("name", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("accelerator,capability", [("cpu", None), ("gpu", (8, 0)), ("auto", H100)])
def test_plain_precisions_pass_where_bf16_is_native(name, accelerator, capability):
    _check(_cfg(name, accelerator), capability=capability, cpu_bf16=True)


@pytest.mark.parametrize("name", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
def test_bf16_on_a_cpu_without_native_bf16_is_refused(name, accelerator):
    with pytest.raises(ConfigError, match=f"precision={name} with trainer.accelerator="):
        _check(_cfg(name, accelerator), capability=None, cpu_bf16=False)
    _check(_cfg("32-true", accelerator), capability=None, cpu_bf16=False)
    # on a GPU the CPU's bf16 support does not matter
    _check(_cfg(name, "gpu"), capability=(8, 0), cpu_bf16=False)


def test_fp8_on_an_fp8_gpu_passes(torchao_float8):
    _check(_cfg())
    _check(_cfg(accelerator="auto"), capability=(8, 9))  # Ada: L4, RTX 4090
    _check(_cfg(fp8_recipe="rowwise"))
    cfg = _cfg()
    cfg.strategy = StrategyConfig(name="fsdp")
    cfg.adapter = AdapterConfig(kind="lora")  # LoRA over float8 base layers works
    _check(cfg)


@pytest.mark.parametrize(
    "accelerator,capability,match",
    [
        ("cpu", None, "trainer.accelerator=cpu runs on cpu"),
        ("cpu", H100, "trainer.accelerator=cpu runs on cpu"),
        ("auto", None, "trainer.accelerator=auto runs on cpu"),
        ("mps", None, "trainer.accelerator=mps runs on mps"),
        ("gpu", None, "trainer.accelerator=gpu: no CUDA GPU is visible"),
        ("gpu", (8, 0), "compute capability 8.0"),  # A100: no float8 tensor cores
        ("auto", (8, 6), "compute capability 8.6"),
    ],
)
def test_fp8_without_an_fp8_gpu_is_refused(accelerator, capability, match):
    with pytest.raises(ConfigError, match=match) as info:
        _check(_cfg(accelerator=accelerator), capability=capability)
    assert "precision=fp8" in str(info.value)


def test_fp8_without_torchao_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import now fails
    with pytest.raises(ConfigError, match=r"pip install 'recipes-lib\[fp8\]'"):
        _check(_cfg())


def test_fp8_with_qlora_is_refused_naming_both_keys():
    cfg = _cfg()
    cfg.adapter = AdapterConfig(kind="qlora")
    with pytest.raises(ConfigError, match="precision=fp8 with adapter.kind=qlora"):
        _check(cfg)


@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "deepspeed_zero3"])
def test_fp8_with_deepspeed_is_refused(strategy):
    cfg = _cfg()
    cfg.strategy = StrategyConfig(name=strategy)
    with pytest.raises(ConfigError, match=f"precision=fp8 with strategy.name={strategy}"):
        _check(cfg)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"fp8_recipe": "blockwise"}, "precision.fp8_recipe='blockwise'"),
        ({"fp8_recipe": "rowwise_with_gw_hp"}, "precision.fp8_recipe="),
        ({"fp8_min_features": 8}, "precision.fp8_min_features=8 must be at least 16"),
        ({"fp8_min_features": 0}, "precision.fp8_min_features=0"),
        ({"fp8_skip": ["output", ""]}, "precision.fp8_skip holds ''"),
    ],
)
def test_bad_fp8_fields_are_refused_naming_the_key(fields, match):
    with pytest.raises(ConfigError, match=match):
        _check(_cfg(**fields))


def test_fp8_that_would_convert_nothing_is_refused(torchao_float8):
    tiny = to_run_config(compose_config(["model=tiny"])).model  # dim 128: below 1024
    with pytest.raises(ConfigError, match="would convert no Linear layer of model.name=tiny"):
        _check(_cfg(model=tiny))
    _check(_cfg(model=tiny, fp8_min_features=128))  # wq, wo, w1, w2, w3 qualify


def test_a_float8_output_head_the_loss_bypasses_is_refused(torchao_float8):
    cfg = _cfg(fp8_skip=[])
    _check(cfg)  # the head (1024 -> 4096) may be converted on its own
    cfg.kernels = KernelsConfig(loss_chunk_size=1024)
    with pytest.raises(ConfigError, match="kernels.loss_chunk_size=1024"):
        _check(cfg)
    cfg.precision.fp8_skip = ["output"]
    _check(cfg)
    cfg = _cfg(fp8_skip=[])
    cfg.stage.objective = "distill"  # its divergence is computed inside the head
    with pytest.raises(ConfigError, match="objective=distill computes its loss inside the head"):
        _check(cfg)


def test_a_tied_float8_head_under_fsdp_float8_all_gather_is_refused(torchao_float8):
    tied = ModelConfig(**{**vars(FP8_MODEL), "tie_embeddings": True})
    cfg = _cfg(model=tied, fp8_skip=[])
    cfg.strategy = StrategyConfig(name="fsdp")
    with pytest.raises(ConfigError, match="model.tie_embeddings=true"):
        _check(cfg)
    cfg.precision.fp8_recipe = "rowwise"  # no float8 all-gather: the tie is kept
    _check(cfg)


def test_detection_reads_this_machine():
    assert isinstance(detect_cpu_bf16(), bool)
    capability = detect_cuda_capability()
    if torch.cuda.is_available():
        assert capability is not None and len(capability) == 2
    else:
        assert capability is None


def test_composed_fp8_config_resolves_and_validation_checks_it():
    cfg = to_run_config(
        compose_config(
            ["recipe=pretrain/tiny", "precision=fp8", "precision.fp8_recipe=rowwise", "trainer=cpu"]
        )
    )
    assert cfg.precision.name == "fp8"
    assert cfg.precision.fp8_recipe == "rowwise"
    assert cfg.precision.fp8_skip == ["output"]
    assert cfg.precision.fp8_min_features == 1024
    assert lightning_precision(cfg.precision) == "bf16-mixed"
    with pytest.raises(ConfigError, match="precision=fp8 needs a CUDA GPU"):
        check_run(cfg, objectives=("pretrain",))


def test_validation_accepts_the_default_precision():
    check_run(
        to_run_config(compose_config(["recipe=pretrain/tiny", "trainer=cpu"])),
        objectives=("pretrain",),
    )


@pytest.fixture
def h100_with_flash(monkeypatch):
    """A CUDA GPU of compute capability 9.0 whose torch has its flash attention kernel."""
    import recipes_lib.kernels.flash as flash
    import recipes_lib.parallel.precision as precision

    monkeypatch.setattr(precision, "detect_cuda_capability", lambda: H100)
    monkeypatch.setattr(flash, "_torch_varlen_reason", lambda: None)


def _resolved(*overrides: str, gpu_visible: bool = True) -> RunConfig:
    from recipes_lib.parallel.precision import resolve_device_choices

    base = ["recipe=sft/lora", "model=llama_1b", "precision=bf16-mixed"]
    return resolve_device_choices(
        to_run_config(compose_config([*base, *overrides])), gpu_visible=gpu_visible
    )


def _global_backend(cfg: RunConfig) -> str:
    from recipes_lib.models.windows import attention_choice

    choice = attention_choice(cfg.kernels, cfg.model, document_mask=cfg.data.document_mask)
    return choice.names()["global"]


def test_short_packed_rows_on_a_gpu_take_varlen_for_global_layers_under_auto(h100_with_flash):
    """Rows of 2,048 packed with a document mask: varlen, which compiles no kernel, where
    flex took seconds to compile for the same time a step."""
    cfg = _resolved()
    assert cfg.kernels.attention == "auto" and cfg.kernels.attention_global == "varlen"
    assert _global_backend(cfg) == "varlen"
    assert _resolved("recipe=dpo/full").kernels.attention_global == "varlen"


@pytest.mark.parametrize(
    "overrides,gpu_visible",
    [
        (["data.seq_len=4096"], True),  # longer rows: flex's kernel is faster
        (["kernels.attention=flex"], True),  # the user's own choice
        (["kernels.attention_global=sdpa", "data.document_mask=false"], True),
        (["data.document_mask=false"], True),  # causal rows: SDPA's flash kernel
        (["precision=32-true"], True),  # FlashAttention-2 computes in half precision only
        (["model=gpt_oss_20b"], True),  # attention sinks
        ([], False),  # no GPU
        (["trainer=cpu"], True),  # a CPU run on a machine with a GPU
        (["model=deepseek_v3_671b"], True),  # latent attention
        (["model.head_dim=512"], True),  # wider than FlashAttention-2's heads
        (["model.head_dim=60"], True),  # not a multiple of 8
        (["stage.objective=distill"], True),  # a teacher runs the student's choices
        (["strategy.context_parallel=2"], True),  # rows split over ranks
    ],
)
def test_auto_keeps_its_per_layer_order_elsewhere(h100_with_flash, overrides, gpu_visible):
    cfg = _resolved(*overrides, gpu_visible=gpu_visible)
    assert cfg.kernels.attention_global == next(
        (o.split("=")[1] for o in overrides if o.startswith("kernels.attention_global=")), None
    )


def test_a_gpu_older_than_flash_attention_keeps_flex(h100_with_flash, monkeypatch):
    import recipes_lib.parallel.precision as precision

    monkeypatch.setattr(precision, "detect_cuda_capability", lambda: (7, 5))
    cfg = _resolved()
    assert cfg.kernels.attention_global is None and _global_backend(cfg) == "flex"


def test_global_layers_left_to_auto_by_their_own_key_take_varlen(h100_with_flash):
    cfg = _resolved("kernels.attention=sdpa", "kernels.attention_global=auto")
    assert cfg.kernels.attention_global == "varlen" and _global_backend(cfg) == "varlen"


def test_an_amd_gpu_keeps_flex(h100_with_flash, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert _resolved().kernels.attention_global is None


def test_a_rerun_of_a_run_trained_on_flex_keeps_flex(h100_with_flash, tmp_path):
    """A run folder whose checkpoints were trained before auto took varlen (its config
    records ``kernels.attention_global: null``) resumes on flex, as it trained, instead
    of being refused as another config; a fresh folder takes varlen."""
    import dataclasses

    from omegaconf import OmegaConf

    from recipes_lib.config.fingerprint import recorded_config_changes
    from recipes_lib.parallel.precision import resolve_device_choices
    from recipes_lib.train import _as_recorded

    given = to_run_config(
        compose_config(
            ["recipe=sft/lora", "model=llama_1b", "precision=bf16-mixed", f"run.dir={tmp_path}"]
        )
    )
    resolved = resolve_device_choices(given, gpu_visible=True)
    assert _as_recorded(given, resolved).kernels.attention_global == "varlen"  # nothing there
    # what the run recorded: the same config, its global layers on flex
    trained = dataclasses.replace(
        resolved, kernels=dataclasses.replace(resolved.kernels, attention_global=None)
    )
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(trained)))
    assert _as_recorded(given, resolved).kernels.attention_global == "varlen"  # no checkpoint
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")
    kept = _as_recorded(given, resolved)
    assert kept.kernels.attention_global is None
    assert not [
        c for c in recorded_config_changes(kept, tmp_path / "config.yaml") if "kernels" in c
    ]
    assert [
        c for c in recorded_config_changes(resolved, tmp_path / "config.yaml") if "kernels" in c
    ]
