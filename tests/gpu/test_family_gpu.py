"""Every model family, a mixture of experts among them, trains on a GPU the fast way
(``pytest -m gpu``): blocks compiled, FlexAttention with packed documents (and Gemma 3's
and OLMo 3's windows), bf16; under FSDP on two
GPUs a Gemma 3 follows its one-GPU loss curve."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from gpu_helpers import WORKER, torchrun
from tiny import family_overrides

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.models import Transformer
from recipes_lib.train import run

pytestmark = pytest.mark.gpu

# each family's options on the `small` decoder (6 layers, dim 384, 6:2 heads)
FAMILIES = {
    "qwen3": ("model.family=qwen3", "model.qk_norm=head", "model.head_dim=96"),
    "olmo2": ("model.family=olmo2", "model.qk_norm=full", "model.norm_placement=post"),
    # OLMo 3: windows on three layers of four, YaRN on the global ones
    "olmo3": (
        *family_overrides("olmo3"),
        "model.sliding_window=64",
        "model.window_layers=[0,1,2,4]",
        "model.local_rope_theta=10000",
        "model.rope_scaling.type=yarn",
        "model.rope_scaling.factor=4",
        "model.rope_scaling.original_max_seq_len=64",
    ),
    "smollm3": ("model.family=smollm3", "model.nope_layers=[3]"),
    "phi3": ("model.family=phi3", "model.partial_rotary_factor=0.5"),
    # experts in every layer: the grouped GEMM path, compiled, with the auxiliary losses
    "qwen3_moe": (
        "model.family=qwen3_moe",
        "model.qk_norm=head",
        "model.moe_experts=8",
        "model.moe_top_k=2",
        "model.moe_ffn_dim=512",
        "model.moe_aux_loss_coef=0.01",
        "model.moe_z_loss_coef=0.001",
    ),
    "gemma3": (
        *family_overrides("gemma3"),
        "model.query_pre_attn_scalar=48",
        "model.sliding_window=64",
        "model.window_layers=[0,1,2,3,4]",
        "model.local_rope_theta=10000",
    ),
}


def _overrides(run_dir: Path, cache: Path, family: str, *extra: str) -> list[str]:
    return [
        "recipe=pretrain/tiny_packed",
        "model=small",
        *FAMILIES[family],
        "trainer=gpu",
        "precision=bf16-mixed",
        "kernels=flex_compiled",
        f"run.dir={run_dir}",
        f"data.cache_dir={cache}",
        "data.sources.stdlib.max_documents=300",
        "data.seq_len=256",
        "data.batch_size=16",
        "trainer.max_steps=30",
        "trainer.accumulate_grad_batches=1",
        "trainer.val_check_interval=30",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "scheduler.warmup=3",
        "run.checkpoint_every_n_steps=30",
        "callbacks=minimal",
        *extra,
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


class Losses:
    """Each step's training loss, as the run logged it."""

    def __init__(self):
        self.values: list[float] = []

    def __call__(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_compiled_with_document_masks(tmp_path, cache, family):
    from lightning.pytorch.callbacks import LambdaCallback

    losses = Losses()
    result = run(
        compose_config(_overrides(tmp_path / "run", cache, family)),
        callbacks=[LambdaCallback(on_train_batch_end=losses)],
    )
    assert result.global_step == 30 and result.weights_path.is_file()
    assert all(math.isfinite(v) for v in losses.values)
    first, last = sum(losses.values[:5]) / 5, sum(losses.values[-5:]) / 5
    assert last < first - 0.5, (first, last)  # it learns, not merely runs


def test_compiled_flex_windows_match_each_document_alone():
    """On the GPU the compiled FlexAttention kernel with a window and packed documents
    computes what a model given each document alone computes (fp32)."""
    cfg = to_run_config(compose_config(["model=small", *FAMILIES["gemma3"]])).model
    torch.manual_seed(0)
    flex = Transformer(cfg, "flex").cuda().eval()
    sdpa = Transformer(cfg, "sdpa").cuda().eval()
    sdpa.load_state_dict(flex.state_dict())
    x = torch.randint(0, cfg.vocab_size, (2, 300), device="cuda")
    doc_ids = torch.zeros_like(x)
    doc_ids[:, 170:] = 1  # two documents per row, the first longer than the window
    with torch.no_grad():
        packed = flex(x, doc_ids)
        alone = torch.cat([sdpa(x[:, :170]), sdpa(x[:, 170:])], dim=1)
    torch.testing.assert_close(packed, alone, atol=2e-4, rtol=2e-4)


def _curve(tmp_path: Path, cache: Path, family: str, name: str, *more: str, **kw) -> dict:
    """The per-step losses (averaged over the ranks) of twelve steps of ``family`` on one
    GPU (``name`` single) or two (fsdp), fp32 unless ``precision`` says otherwise."""
    processes = 1 if name.startswith("single") else 2
    folder = tmp_path / name
    folder.mkdir()
    out = folder / "result.json"
    overrides = _overrides(
        folder / "run",
        cache,
        family,
        f"strategy={name.split('_')[0]}",
        f"trainer.devices={processes}",
        f"data.batch_size={16 // processes}",
        "trainer.max_steps=12",
        "kernels.compile=false",
        f"precision={kw.get('precision', '32-true')}",
        *more,
    )
    torchrun(processes, str(WORKER), f"--out={out}", *overrides)
    return {int(step): loss for step, loss in json.loads(out.read_text())["losses"].items()}


def _assert_curves_agree(got: dict, expected: dict, label: str) -> None:
    """At every step within 0.01 + 1% of ``expected``."""
    assert sorted(got) == sorted(expected)
    far = [
        (step, round(got[step], 4), round(loss, 4))
        for step, loss in sorted(expected.items())
        if abs(got[step] - loss) > 0.01 + 0.01 * abs(loss)
    ]
    assert not far, f"(step, {label}) beyond tolerance: {far}; all: {got} vs {expected}"


def _fsdp_against_one_gpu(tmp_path: Path, cache: Path, family: str, *extra: str) -> None:
    """Twelve fp32 steps of ``family`` under FSDP on two GPUs (with ``extra``) against
    one GPU: the loss curves agree within 0.01 + 1% at every step."""
    single = _curve(tmp_path, cache, family, "single")
    fsdp = _curve(tmp_path, cache, family, "fsdp", *extra)
    _assert_curves_agree(fsdp, single, "two GPUs, one GPU")


@pytest.mark.multigpu
def test_gemma3_under_fsdp_follows_one_gpu_in_fp32(tmp_path, cache):
    """FSDP on two GPUs against one GPU, fp32 (where the two compute alike: under
    bf16-mixed FSDP's bf16 parameters and one GPU's fp32 weights under autocast differ
    by policy, not by error)."""
    _fsdp_against_one_gpu(tmp_path, cache, "gemma3")


@pytest.mark.multigpu
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_expert_parallel_on_two_gpus_follows_the_gathered_experts(tmp_path, cache, precision):
    """A Qwen3-MoE with its 8 experts spread 4 and 4 over two GPUs (the tokens sent to
    them by all-to-all) against the same two GPUs with every expert gathered by FSDP:
    the same computation, so the curves agree within 0.01 + 1% at every step; in fp32
    with one GPU's curve too. In fp32
    the experts run as a loop (a rank's idle experts included, so that every rank's
    backward runs the exchange), under bf16-mixed as one grouped GEMM, at half the
    recipe's learning rate: at 3e-3 this run is at the edge of stability (every
    computation's loss rises at step 11), and there the expert-parallel run alone spiked
    at step 8 (6.636 against 6.327 gathered, 6.333 DDP, 6.325 one GPU; H100 and H200)
    before rejoining the others by step 12 (6.572 against 6.575), a departure not
    explained (see benchmarks/results/NOTES.md). The balance loss is off, as when these
    curves were measured."""
    settings = ["model.moe_aux_loss_coef=0"]
    if precision == "bf16-mixed":
        settings.append("optim.lr=1.5e-3")
    gathered = _curve(tmp_path, cache, "qwen3_moe", "fsdp", *settings, precision=precision)
    parallel = _curve(
        tmp_path,
        cache,
        "qwen3_moe",
        "fsdp_ep",
        *settings,
        "strategy.expert_parallel=true",
        "callbacks.watchdog.minutes=2",  # a hang fails the test with every rank's stacks
        precision=precision,
    )
    print(f"{precision} gathered {gathered}\n{precision} expert-parallel {parallel}")
    _assert_curves_agree(parallel, gathered, "expert-parallel, gathered")
    if precision == "32-true":  # and one GPU's curve, where the two compute alike
        single = _curve(tmp_path, cache, "qwen3_moe", "single", *settings, precision=precision)
        _assert_curves_agree(parallel, single, "expert-parallel, one GPU")
