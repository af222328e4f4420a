"""Two GPUs train as one (``pytest -m multigpu``; each run is a ``torchrun`` job).

pytest is one process, so every run here is a subprocess: ``multigpu_worker.py``
(``run(compose_config(...))`` plus a callback that averages each step's loss over the
ranks) or the ``recipes-train`` CLI itself. The same global batch on one GPU (16 rows)
and on two (8 rows each) reads the same samples at every step (the sampler interleaves
the ranks over one stream) and every strategy starts from the same weights, so the
per-step losses of DDP and FSDP on two GPUs must follow the one-GPU curve.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from gpu_helpers import WORKER, metric_series, read_metrics, torchrun

from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.models import Transformer

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]  # `pytest -m gpu` runs these too

STEPS = 20
GLOBAL_BATCH = 16
# bf16-mixed, where FSDP also rounds norm weights to bf16 in compute: per-step losses of
# equivalent runs differ by rounding, far less than this; a rank training on its own
# data, or from other weights, moves the curve by more
CURVE_ABS, CURVE_REL = 0.02, 0.01
# FSDP's mixed-precision policy computes with bf16 copies of the parameters (so the
# residual stream is bf16), where one GPU under bf16 autocast keeps fp32 weights: the
# curves agree to bf16 rounding, which compounds over the steps. (In fp32 the two agree
# to 2e-5 in the weights: tests/integration/test_distributed_cpu.py.)
TOLERANCE = {"ddp": (CURVE_ABS, CURVE_REL), "fsdp": (0.03, 0.025), "hsdp": (0.03, 0.025)}
RESUME_ABS = 0.01  # same card, same world size: only non-deterministic kernels differ


def _overrides(run_dir: Path, cache: Path, *extra: str, steps: int = STEPS) -> list[str]:
    """The tiny recipe's data and schedule with the ``small`` decoder, on the GPU."""
    return [
        "recipe=pretrain/tiny",
        "model=small",
        "trainer=gpu",
        "precision=bf16-mixed",
        "kernels.compile=false",
        f"run.dir={run_dir}",
        f"data.cache_dir={cache}",
        "data.sources.stdlib.max_documents=300",
        "data.seq_len=256",
        f"trainer.max_steps={steps}",
        "trainer.accumulate_grad_batches=1",
        "trainer.val_check_interval=10",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "scheduler.warmup=3",
        "run.checkpoint_every_n_steps=10",
        "run.save_top_k=-1",  # keep step000010: the resume test starts from it
        "callbacks=minimal",
        *extra,
    ]


def _worker(processes: int, folder: Path, *overrides: str, logits: bool = False) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "result.json"
    args = [str(WORKER), f"--out={out}"]
    if logits:
        args.append(f"--logits={folder / 'logits.pt'}")
    torchrun(processes, *args, *overrides)
    return json.loads(out.read_text())


def _losses(result: dict) -> dict[int, float]:
    return {int(step): loss for step, loss in result["losses"].items()}


def _assert_curves_match(got: dict[int, float], expected: dict[int, float], abs_tol, rel_tol):
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    bad = [
        (step, round(got[step], 4), round(expected[step], 4))
        for step in sorted(expected)
        if abs(got[step] - expected[step]) > abs_tol + rel_tol * abs(expected[step])
    ]
    assert not bad, f"(step, got, expected) beyond tolerance: {bad}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One tokenizer and shard cache for every run of this module."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """Runs by name, each trained once on first use: ``single`` (one GPU, 16 rows per
    step) and ``ddp`` / ``fsdp`` (two GPUs, 8 rows each); step checkpoints at 10 and 20."""
    root = tmp_path_factory.mktemp("runs")
    done: dict[str, dict] = {}
    failed: dict[str, str] = {}  # a run that failed once is not retried by the next test

    def get(name: str) -> dict:
        if name in failed:
            pytest.fail(f"the {name} run failed in an earlier test:\n{failed[name]}")
        if name not in done:
            folder = root / name
            processes = {"single": 1, "hsdp": 4}.get(name, 2)
            extra = [
                f"strategy={name}",
                f"trainer.devices={processes}",
                f"data.batch_size={GLOBAL_BATCH // processes}",
                *(["strategy.replicas=2"] if name == "hsdp" else []),  # 2 x 2
            ]
            overrides = _overrides(folder / "run", cache, *extra)
            try:
                result = _worker(processes, folder, *overrides, logits=True)
            except AssertionError as err:
                failed[name] = str(err)[-4000:]
                raise
            done[name] = {**result, "overrides": overrides, "folder": str(folder)}
        return done[name]

    return get


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_gpus_follow_the_one_gpu_loss_curve(runs, strategy):
    single, two = runs("single"), runs(strategy)
    assert single["world_size"] == 1 and two["world_size"] == 2
    assert two["global_step"] == single["global_step"] == STEPS
    abs_tol, rel_tol = TOLERANCE[strategy]
    _assert_curves_match(_losses(two), _losses(single), abs_tol, rel_tol)
    # validation is reduced over the ranks: the same held-out rows either way
    assert two["metrics"]["val/loss"] == pytest.approx(
        single["metrics"]["val/loss"], abs=abs_tol, rel=rel_tol
    )
    # the CSV log (rank 0) has every step
    logged = metric_series(read_metrics(Path(two["output_dir"])), "train/loss")
    assert len(logged) == STEPS and all(math.isfinite(v) for _, v in logged)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="HSDP 2 x 2 needs 4 GPUs")
def test_hsdp_on_four_gpus_follows_the_one_gpu_loss_curve(runs):
    """Two replicas, each sharded over two GPUs (4 rows per GPU): the one-GPU curve."""
    single, hsdp = runs("single"), runs("hsdp")
    assert hsdp["world_size"] == 4 and hsdp["global_step"] == STEPS
    _assert_curves_match(_losses(hsdp), _losses(single), *TOLERANCE["hsdp"])
    assert hsdp["metrics"]["val/loss"] == pytest.approx(
        single["metrics"]["val/loss"], abs=TOLERANCE["hsdp"][0], rel=TOLERANCE["hsdp"][1]
    )


def test_fsdp_resumes_from_a_sharded_checkpoint(runs, tmp_path, cache):
    from recipes_lib.checkpoint.sharded import is_sharded_checkpoint

    first = runs("fsdp")
    step10 = Path(first["output_dir"]) / "checkpoints" / "step000010.ckpt"
    assert is_sharded_checkpoint(step10), f"{step10} is not a sharded checkpoint folder"
    overrides = _overrides(
        tmp_path / "resumed",
        cache,
        "strategy=fsdp",
        "trainer.devices=2",
        f"data.batch_size={GLOBAL_BATCH // 2}",
        f"run.ckpt_path={step10}",
    )
    resumed = _worker(2, tmp_path / "worker", *overrides)
    assert resumed["global_step"] == STEPS
    expected = {step: loss for step, loss in _losses(first).items() if step > 10}
    _assert_curves_match(_losses(resumed), expected, RESUME_ABS, 0.0)


def test_fsdp_exports_one_file_that_gives_the_same_logits_on_one_gpu(runs):
    from multigpu_worker import probe_tokens

    fsdp = runs("fsdp")
    weights = Path(fsdp["weights_path"])
    assert weights.is_file() and weights.suffix == ".safetensors"
    cfg = to_run_config(compose_config(fsdp["overrides"]))
    with torch.device("cuda:0"):
        model = Transformer(cfg.model)
    model.load_state_dict(load_weights(weights), strict=True)  # whole tensors, every key
    model.eval()
    tokens = probe_tokens(cfg.model.vocab_size).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens).float().cpu()  # (B, T, V)
    sharded = torch.load(Path(fsdp["folder"]) / "logits.pt")  # the 2-GPU FSDP module's
    assert logits.shape == sharded.shape
    relative = (logits - sharded).abs().mean() / sharded.abs().mean()
    assert relative < 0.02, f"mean |difference| is {relative:.4f} of the mean |logit|"
    agreement = (logits.argmax(-1) == sharded.argmax(-1)).float().mean()
    assert agreement > 0.95, f"top-1 agreement {agreement:.3f}"
    targets = tokens[:, 1:].cpu().flatten()

    def loss(x: torch.Tensor) -> float:
        return torch.nn.functional.cross_entropy(x[:, :-1].flatten(0, 1), targets).item()

    assert loss(logits) == pytest.approx(loss(sharded), abs=0.02)


def _cli(processes: int, *overrides: str) -> list[tuple[int, float]]:
    """``recipes-train`` under torchrun; the per-step training losses of its CSV log."""
    torchrun(processes, "-m", "recipes_lib.cli", *overrides)
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run.dir="))
    return metric_series(read_metrics(Path(run_dir)), "train/loss")


@pytest.mark.parametrize(
    "strategy",
    [
        ["strategy=deepspeed_zero2"],
        ["strategy=deepspeed_zero3"],
        ["strategy=deepspeed_zero3", "strategy.cpu_offload=true"],
    ],
    ids=["zero2", "zero3", "zero3_offload"],
)
def test_deepspeed_trains_on_two_gpus(tmp_path, cache, strategy):
    pytest.importorskip("deepspeed")
    run_dir = tmp_path / "deepspeed"
    overrides = _overrides(
        run_dir, cache, *strategy, "trainer.devices=2", "data.batch_size=8", steps=6
    )
    losses = _cli(2, *overrides)
    assert len(losses) == 6 and all(math.isfinite(v) for _, v in losses)
    assert losses[-1][1] < losses[0][1]
    # ZeRO-3 holds a shard of each weight per rank: the export gathers whole tensors
    cfg = to_run_config(compose_config(overrides))
    with torch.device("meta"):
        expected = Transformer(cfg.model).state_dict()
    exported = load_weights(run_dir / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in exported.items()} == {
        k: tuple(v.shape) for k, v in expected.items()
    }


def _six_fsdp_steps(run_dir: Path, cache: Path, pretrained: dict, source: str) -> list[str]:
    """Six bf16 steps of a tiny recipe on two GPUs under FSDP, reading 400 documents of
    ``source`` with the pretrained run's tokenizer, one validation and one checkpoint."""
    return [
        f"run.dir={run_dir}",
        "trainer=gpu",
        "precision=bf16-mixed",
        "strategy=fsdp",
        "trainer.devices=2",
        f"data.tokenizer.path={pretrained['tokenizer_path']}",
        f"data.cache_dir={cache}",
        f"data.sources.{source}.max_documents=400",
        "data.seq_len=256",
        "data.batch_size=4",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "scheduler.warmup=1",
        "run.checkpoint_every_n_steps=6",
        "callbacks=minimal",
    ]


def test_lora_on_the_experts_runs_under_fsdp(runs, tmp_path):
    """LoRA on the attention and a mixture's routed experts (PEFT swaps each gathered
    expert weight for a computed one at every call), the experts sharded by FSDP like
    every weight, blocks recomputed in the backward pass: finite losses, the merged
    weights and the PEFT folder."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    pretrained = runs("single")
    with safe_open(pretrained["weights_path"], "pt") as weights:
        vocab = weights.get_slice("tok_embeddings.weight").get_shape()[0]
    run_dir = tmp_path / "moe_lora"
    losses = _cli(
        2,
        "recipe=sft/lora_tiny",
        *_six_fsdp_steps(run_dir, tmp_path / "cache", pretrained, "stdlib_sft"),
        "model=moe_tiny",
        f"model.vocab_size={vocab}",
        "adapter.target_modules=[wq,wk,wv,wo,experts]",
        "adapter.dropout=0",
        "kernels.compile=false",
        "kernels.activation_checkpointing=true",
    )
    assert len(losses) == 6 and all(math.isfinite(v) for _, v in losses)
    assert (run_dir / "model.safetensors").is_file()
    factors = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    experts_b = [v for k, v in factors.items() if ".mlp.experts." in k and "lora_B" in k]
    assert len(experts_b) == 4 and all(b.abs().max() > 0 for b in experts_b)  # B starts at 0


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("sft/lora_tiny", []),
        ("sft/lora_tiny", ["adapter=qlora", "adapter.r=8"]),
        ("dpo/tiny", []),
        ("grpo/tiny", ["stage.grpo.max_new_tokens=64", "stage.grpo.kl_coef=0.05"]),
        ("kto/tiny", []),
        ("distill/tiny", ["stage.distill.teacher_from={teacher}"]),
    ],
    ids=["lora_sft", "qlora_sft", "dpo", "grpo", "kto", "distill"],
)
def test_post_training_runs_under_fsdp(runs, tmp_path, recipe, extra):
    """LoRA and QLoRA SFT, DPO, GRPO, KTO and distillation from the one-GPU pretrained
    ``small`` model, sharded on two GPUs (QLoRA's 4-bit base weights stay whole on each
    GPU; GRPO samples on the same GPUs through the sharded model, both ranks decoding the
    same steps; KTO's twins run without a gradient; the teacher, the pretrained model
    itself, is whole on each GPU)."""
    if "adapter=qlora" in extra:
        pytest.importorskip("bitsandbytes")
    pretrained = runs("single")
    run_dir = tmp_path / recipe.replace("/", "_")
    objective = recipe.split("/")[0]
    sources = {"sft": "stdlib_sft", "grpo": "stdlib_grpo", "kto": "stdlib_kto"}
    source = {**sources, "distill": "stdlib_sft"}.get(objective, "stdlib_dpo")
    teacher = Path(pretrained["weights_path"]).parent
    extra = [e.format(teacher=teacher) for e in extra]
    start = [f"stage.init_from={pretrained['weights_path']}"]
    if objective == "distill":  # a student of the recipe's shape, from scratch
        from safetensors import safe_open

        with safe_open(pretrained["weights_path"], "pt") as weights:
            vocab = weights.get_slice("tok_embeddings.weight").get_shape()[0]
        start = [f"model.vocab_size={vocab}", f"data.tokenizer.vocab_size={vocab}"]
    losses = _cli(
        2,
        f"recipe={recipe}",
        *_six_fsdp_steps(run_dir, tmp_path / "cache", pretrained, source),
        "model=small",
        *start,
        *extra,
    )
    assert len(losses) == 6 and all(math.isfinite(v) for _, v in losses)
    assert (run_dir / "model.safetensors").is_file()
    if objective == "sft":
        assert (run_dir / "adapter" / "adapter_config.json").is_file()
    elif objective == "dpo":  # the policy starts as the reference: the sigmoid loss starts at log 2
        assert losses[0][1] == pytest.approx(math.log(2), abs=0.02)
