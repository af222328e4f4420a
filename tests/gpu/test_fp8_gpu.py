"""FP8 training on one float8-capable CUDA card tracks BF16 (``pytest -m gpu``).

Needs compute capability 8.9 or newer (L4, RTX 4090, H100, H200) and torchao
(``pip install 'recipes-lib[fp8]'``). About a minute on an H100.
"""

from __future__ import annotations

import importlib.util
import math

import lightning as L
import pytest
from tiny import family_overrides

from recipes_lib.config import compose_config
from recipes_lib.parallel.fp8 import float8_layers
from recipes_lib.parallel.precision import FP8_MIN_CAPABILITY, detect_cuda_capability
from recipes_lib.train import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        (detect_cuda_capability() or (0, 0)) < FP8_MIN_CAPABILITY,
        reason="needs a CUDA GPU with float8 tensor cores (compute capability 8.9+)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("torchao") is None,
        reason="needs torchao's float8 training (pip install 'recipes-lib[fp8]')",
    ),
]

N_LAYERS = 4
# ~60M parameters: every block matmul is at least 1024 wide and a multiple of 16, so all
# 7 Linear layers of each block are converted at the default precision.fp8_min_features
SHAPE = (
    "model.dim=1024",
    f"model.n_layers={N_LAYERS}",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "model.ffn_dim=2816",
)


class Float8Probe(L.Callback):
    """Records which modules are torchao ``Float8Linear`` once training starts."""

    def __init__(self) -> None:
        self.layers: list[str] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.layers = float8_layers(pl_module)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One tokenizer and one set of shards for every run of this file."""
    return tmp_path_factory.mktemp("fp8-cache")


def _run(tmp_path, cache_dir, precision: str, steps: int, *extra: str):
    probe = Float8Probe()
    overrides = [
        "recipe=pretrain/tiny",
        "trainer=gpu",
        "trainer.devices=1",
        "strategy=single",
        f"precision={precision}",
        *SHAPE,
        f"run.dir={tmp_path / precision}",
        f"data.cache_dir={cache_dir}",
        "data.sources.stdlib.max_documents=600",
        "data.seq_len=512",
        "data.batch_size=16",
        "optim.lr=1e-3",
        "scheduler.warmup=20",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.limit_val_batches=8",
        "trainer.enable_progress_bar=false",
        f"run.checkpoint_every_n_steps={steps}",
        *extra,
    ]
    result = run(compose_config(overrides), callbacks=[probe])
    assert result.global_step == steps
    return result, probe.layers


def test_fp8_loss_tracks_bf16_over_200_steps(tmp_path, cache_dir):
    bf16, bf16_layers = _run(tmp_path, cache_dir, "bf16-mixed", 200)
    fp8, fp8_layers = _run(tmp_path, cache_dir, "fp8", 200)

    assert bf16_layers == []
    assert len(fp8_layers) == 7 * N_LAYERS  # wq wk wv wo w1 w2 w3 of every block
    assert not any(name.endswith("output") for name in fp8_layers)  # the head stays bf16

    expected, got = bf16.metrics["val/loss"], fp8.metrics["val/loss"]
    assert expected < math.log(4096) - 2.0  # the model learnt something (from ~8.3)
    # Same seed, same batches: the runs differ only in the matmuls' rounding. float8
    # (e4m3 forward, e5m2 gradients) adds noise comparable to bf16's own run-to-run
    # spread on GPU (a few hundredths after 200 steps), averaged over 1024+ long dot
    # products; a wrong scale or cast diverges by tenths or stops learning.
    assert abs(got - expected) <= max(0.05, 0.02 * expected), (got, expected)


def test_fp8_composes_with_per_block_compile(tmp_path, cache_dir):
    result, layers = _run(tmp_path, cache_dir, "fp8", 30, "kernels.compile=true")
    assert len(layers) == 7 * N_LAYERS
    assert math.isfinite(result.metrics["train/loss"])
    assert result.metrics["val/loss"] < math.log(4096)


FAMILY_OPTIONS = {
    "qwen3": ("model.family=qwen3", "model.qk_norm=head"),
    "gemma3": (
        *family_overrides("gemma3"),
        "model.query_pre_attn_scalar=128",
        "model.sliding_window=64",
        "model.window_layers=[0,1,2]",
        "model.local_rope_theta=10000",
        "kernels=flex_compiled",
    ),
}


@pytest.mark.parametrize("family", FAMILY_OPTIONS)
def test_fp8_trains_each_family_compiled(tmp_path, cache_dir, family):
    """Qwen3's and Gemma 3's norms and Gemma 3's local layers stay as they are; every
    block linear computes in float8."""
    result, layers = _run(
        tmp_path, cache_dir, "fp8", 30, "kernels.compile=true", *FAMILY_OPTIONS[family]
    )
    assert len(layers) == 7 * N_LAYERS
    assert math.isfinite(result.metrics["train/loss"])
    assert result.metrics["val/loss"] < math.log(4096)
