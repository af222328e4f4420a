"""Multi-process runs on the CPU: two ``torchrun`` processes over gloo.

The same global batch on one process (batch 4) and on two (batch 2 each) reads the same
samples at every step (the sampler interleaves ranks over one stream), and gradients
are averaged over ranks, so DDP and FSDP must reach the single-process weights. A
sharded FSDP checkpoint must resume to the same weights and read back as one state
dict.

The runs whose tests read their weights, metrics and what the library logged run one
after another in one ``torchrun`` job of two processes (``distributed_batch.py``, the
:func:`batch` fixture) and one of four (:func:`batch_of_four`); the FSDP reference run,
whose test reads what the console script writes, is a ``recipes-train`` job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_batch import run_log
from integration_helpers import metric_series, read_metrics, tiny_overrides
from run_helpers import built_once, torchrun
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES, family_overrides

from recipes_lib.checkpoint.sharded import (
    is_sharded_checkpoint,
    read_sharded_checkpoint,
)
from recipes_lib.checkpoint.weights import (
    MODEL_PREFIX,
    consolidate_sharded_checkpoint,
    list_step_checkpoints,
    load_weights,
)
from recipes_lib.config import compose_config
from recipes_lib.train import run

BATCH = str(Path(__file__).with_name("distributed_batch.py"))

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

STEPS = 6
COMMON = (
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=3",
    "run.checkpoint_every_n_steps=3",
    "run.save_top_k=-1",
    "scheduler.warmup=2",
)


def _overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    items = tiny_overrides(run_dir.parent, cache, *COMMON, *extra)
    return [o if not o.startswith("run.dir=") else f"run.dir={run_dir}" for o in items]


def _recipes_train(run_dir: Path, cache: Path, *extra: str) -> None:
    """``recipes-train`` on two torchrun processes, one thread each."""
    overrides = _overrides(run_dir, cache, *extra)
    torchrun(2, "-m", "recipes_lib.cli", *overrides, "trainer.devices=2", omp_threads=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One single-process reference run (batch 4) and the same run on two FSDP processes
    (a ``recipes-train`` job: its console log is read)."""
    return built_once(tmp_path_factory, "distributed-runs", _reference_runs)


def _reference_runs(root: Path) -> dict[str, Path]:
    cache = root / "cache"
    dirs = {name: root / name for name in ("single", "fsdp")}
    single = run(compose_config(_overrides(dirs["single"], cache)))  # prepares the shards
    dirs["tokenizer"] = single.tokenizer_path
    _recipes_train(dirs["fsdp"], cache, "strategy=fsdp", "data.batch_size=2")
    dirs["cache"] = cache
    return dirs


def _run_batch(processes: int, jobs: dict[str, list[str]], root: Path) -> dict[str, Path]:
    """``jobs`` (name: overrides, ``run.dir`` under ``root``) one after another in one
    ``torchrun`` job of ``processes``; each run's folder by its name."""
    listed = root / "runs.json"
    listed.write_text(json.dumps([[*o, f"trainer.devices={processes}"] for o in jobs.values()]))
    torchrun(processes, BATCH, str(listed), timeout=900, omp_threads=1)
    return {name: root / name for name in jobs}


@pytest.fixture(scope="module")
def batch(runs, tmp_path_factory) -> dict[str, Path]:
    """The two-process runs of the tests below, each in its own folder, run in one
    ``torchrun`` job; each test runs its one-process reference itself."""
    return built_once(tmp_path_factory, "distributed-batch", lambda root: _batch(runs, root))


def _batch(runs: dict[str, Path], root: Path) -> dict[str, Path]:
    cache = runs["cache"]
    on_two = ("data.batch_size=2", "strategy=fsdp")
    middle = f"step{STEPS // 2:06d}.ckpt"
    jobs: dict[str, list[str]] = {
        "ddp": _overrides(root / "ddp", cache, "strategy=ddp", "data.batch_size=2"),
        "fsdp_resumed": _overrides(
            root / "fsdp_resumed",
            cache,
            *on_two,
            f"run.ckpt_path={runs['fsdp'] / 'checkpoints' / middle}",
        ),
        "muon": _overrides(root / "muon", cache, *on_two, "optim=muon"),
        "muon_resumed": _overrides(
            root / "muon_resumed",
            cache,
            *on_two,
            "optim=muon",
            f"run.ckpt_path={root / 'muon' / 'checkpoints' / middle}",
        ),
        "gemma3": _overrides(root / "gemma3", cache, *on_two, *GEMMA3),
        "lora_experts": _overrides(root / "lora_experts", cache, *on_two, *LORA_EXPERTS),
        "reward": ["recipe=reward/tiny", *_dpo_overrides(root / "reward", runs, *on_two)],
        "grpo": _grpo_overrides(root / "grpo", runs),
        "kto": _kto_overrides(root / "kto", runs, "data.batch_size=2", "strategy=ddp"),
        "moe_gathered": _overrides(root / "moe_gathered", cache, *on_two, *MOE),
        "moe_expert_parallel": _overrides(
            root / "moe_expert_parallel", cache, *on_two, *MOE, "strategy.expert_parallel=true"
        ),
    }
    for recipe in ("dpo/tiny", "dpo/lora_tiny"):
        jobs[recipe] = [f"recipe={recipe}", *_dpo_overrides(root / recipe, runs, *on_two)]
    for strategy in ("ddp", "fsdp"):
        jobs[f"distill_{strategy}"] = _distill_overrides(
            root / f"distill_{strategy}", runs, "data.batch_size=2", f"strategy={strategy}"
        )
    return _run_batch(2, jobs, root)


@pytest.fixture(scope="module")
def batch_of_four(runs, tmp_path_factory) -> dict[str, Path]:
    """The four-process runs (HSDP: two copies, each sharded over two processes, a
    quarter of the global batch each), in one ``torchrun`` job."""
    return built_once(
        tmp_path_factory, "distributed-batch4", lambda root: _batch_of_four(runs, root)
    )


def _batch_of_four(runs: dict[str, Path], root: Path) -> dict[str, Path]:
    hsdp = ("strategy=hsdp", "strategy.replicas=2", "data.batch_size=1")
    jobs = {
        "hsdp": _overrides(root / "hsdp", runs["cache"], *hsdp),
        "hsdp_lora_experts": _overrides(
            root / "hsdp_lora_experts", runs["cache"], *hsdp, *LORA_EXPERTS
        ),
    }
    return _run_batch(4, jobs, root)


def _assert_same_weights(a: dict, b: dict, atol: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < atol, f"largest weight difference {worst:.2e}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_reach_the_single_process_weights(runs, batch, strategy):
    single = load_weights(runs["single"] / "model.safetensors")
    folder = batch["ddp"] if strategy == "ddp" else runs["fsdp"]
    parallel = load_weights(folder / "model.safetensors")
    _assert_same_weights(single, parallel)
    # the validation loss is reduced over ranks: the same as on one process
    val = [float(r["val/loss"]) for r in read_metrics(folder) if r.get("val/loss")]
    ref = [float(r["val/loss"]) for r in read_metrics(runs["single"]) if r.get("val/loss")]
    assert val == pytest.approx(ref, abs=1e-3)


def test_only_rank_zero_writes_the_run_folder(runs):
    assert (runs["fsdp"] / "config.yaml").is_file()
    assert len(list((runs["fsdp"] / "logs").glob("version_*"))) == 1
    log = (runs["fsdp"] / "cli.log").read_text()
    assert log.count("finished at step") == 1


def test_fsdp_writes_sharded_checkpoints_that_read_back_whole(runs, tmp_path):
    final = runs["fsdp"] / "checkpoints" / f"step{STEPS:06d}.ckpt"
    assert is_sharded_checkpoint(final)
    # the step of each folder is read from its metadata, not from the shards
    steps = [step for step, _ in list_step_checkpoints(runs["fsdp"] / "checkpoints")]
    assert steps == [STEPS // 2, STEPS]
    state = read_sharded_checkpoint(final)
    weights = {k.removeprefix(MODEL_PREFIX): v for k, v in state.items()}
    exported = load_weights(runs["fsdp"] / "model.safetensors")
    _assert_same_weights(weights, exported, atol=1e-12)
    # one file, readable wherever weights are (stage.init_from, export, generate)
    single_file = consolidate_sharded_checkpoint(final, tmp_path / "consolidated.safetensors")
    _assert_same_weights(load_weights(single_file), exported, atol=1e-12)
    _assert_same_weights(load_weights(final), exported, atol=1e-12)


def test_fsdp_resumes_from_a_sharded_checkpoint(runs, batch):
    # batch["fsdp_resumed"]: the FSDP run resumed from its step-3 sharded checkpoint
    _assert_same_weights(
        load_weights(runs["fsdp"] / "model.safetensors"),
        load_weights(batch["fsdp_resumed"] / "model.safetensors"),
        atol=1e-6,
    )


def test_muon_under_fsdp_follows_one_process_and_resumes_from_its_sharded_checkpoint(
    runs, batch, tmp_path
):
    """``optim=muon`` under FSDP: each rank holds a shard of every matrix, and Muon's
    Newton-Schulz iterations run on the sharded tensors as whole matrices (their
    products gather what they need), so two processes follow one; Muon iterates in
    bf16, so the runs agree to its rounding (DDP against one process differs as much,
    3e-4, after these six steps at a learning rate of 3e-3). Its state is sharded like
    AdamW's and resumes."""
    one = run(compose_config(_overrides(tmp_path / "single", runs["cache"], "optim=muon")))
    fsdp = batch["muon"]
    _assert_same_weights(
        load_weights(one.output_dir / "model.safetensors"),
        load_weights(fsdp / "model.safetensors"),
        atol=1e-3,
    )
    middle = fsdp / "checkpoints" / f"step{STEPS // 2:06d}.ckpt"
    assert is_sharded_checkpoint(middle)
    # batch["muon_resumed"]: the same run resumed from ``middle``
    _assert_same_weights(
        load_weights(fsdp / "model.safetensors"),
        load_weights(batch["muon_resumed"] / "model.safetensors"),
        atol=1e-6,
    )


def _dpo_overrides(run_dir: Path, runs: dict, *extra: str) -> list[str]:
    return [
        f"run.dir={run_dir}",
        f"data.cache_dir={runs['cache']}",
        f"stage.init_from={runs['single'] / 'model.safetensors'}",
        f"data.tokenizer.path={runs['tokenizer']}",
        *SMALL_VOCAB_OVERRIDES,
        "data.seq_len=128",
        "data.sources.stdlib_dpo.max_documents=200",
        "scheduler.warmup=1",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
        *QUIET_OVERRIDES,
        "callbacks=minimal",
        *extra,
    ]


@pytest.mark.parametrize("recipe", ["dpo/tiny", "dpo/lora_tiny"])
def test_dpo_under_fsdp_matches_one_process(runs, batch, tmp_path, recipe):
    """A separate reference model is sharded like the policy; with LoRA the reference is
    the sharded policy with its adapters bypassed."""
    single_dir, fsdp_dir = tmp_path / "single", batch[recipe]
    run(
        compose_config([f"recipe={recipe}", *_dpo_overrides(single_dir, runs, "data.batch_size=4")])
    )
    _assert_same_weights(
        load_weights(single_dir / "model.safetensors"), load_weights(fsdp_dir / "model.safetensors")
    )
    if recipe == "dpo/lora_tiny":
        assert (fsdp_dir / "adapter" / "adapter_model.safetensors").is_file()


def _distill_overrides(run_dir: Path, runs: dict, *extra: str) -> list[str]:
    return [
        "recipe=distill/tiny",
        f"run.dir={run_dir}",
        f"data.cache_dir={runs['cache']}",
        f"stage.distill.teacher_from={runs['single']}",
        f"data.tokenizer.path={runs['tokenizer']}",
        *SMALL_VOCAB_OVERRIDES,
        "data.seq_len=128",
        "data.sources.stdlib_sft.max_documents=200",
        "scheduler.warmup=1",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
        *QUIET_OVERRIDES,
        "callbacks=minimal",
        *extra,
    ]


def test_distillation_under_fsdp_trains_as_under_ddp(runs, batch):
    """The divergence is computed inside the sharded student's head (gathered there);
    the teacher, the pretrained run, is whole on each rank. It is a mean over each rank's
    assistant tokens (as SFT's loss is), so two ranks are compared with two ranks."""
    ddp, fsdp = (
        load_weights(batch[f"distill_{strategy}"] / "model.safetensors")
        for strategy in ("ddp", "fsdp")
    )
    _assert_same_weights(ddp, fsdp)
    start = load_weights(runs["single"] / "model.safetensors")  # the teacher: a bigger model
    assert start.keys() == ddp.keys() and any(start[k].shape != ddp[k].shape for k in ddp)


GEMMA3 = (
    *family_overrides("gemma3"),
    "model.query_pre_attn_scalar=12",
    "model.sliding_window=8",
    "model.window_layers=[0]",
    "model.local_rope_theta=10000",
)


def test_a_gemma3_under_fsdp_reaches_the_single_process_weights(runs, batch, tmp_path):
    """Gemma 3's local layers, four norms per block and scaled embeddings shard and
    train under FSDP as on one process (fp32)."""
    single = run(compose_config(_overrides(tmp_path / "single", runs["cache"], *GEMMA3)))
    _assert_same_weights(
        load_weights(single.weights_path), load_weights(batch["gemma3"] / "model.safetensors")
    )


MOE = (
    "model.family=qwen3_moe",
    "model.qk_norm=head",
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_dim=64",
    "model.moe_router=sigmoid",
    "model.moe_bias_update_rate=0.01",
    "model.moe_z_loss_coef=0.001",
    "model.moe_aux_loss_coef=0.01",
)


@pytest.fixture(scope="module")
def moe_single(runs, tmp_path_factory) -> Path:
    """The mixture's one-process weights, for both of its FSDP runs to reach."""

    def build(folder: Path) -> Path:
        overrides = _overrides(folder / "single", runs["cache"], *MOE)
        return Path(run(compose_config(overrides)).weights_path)

    return built_once(tmp_path_factory, "distributed-moe-single", build)


@pytest.mark.parametrize("experts", ["gathered", "expert_parallel"])
def test_a_mixture_of_experts_under_fsdp_reaches_the_single_process_weights(
    batch, moe_single, experts
):
    """The stacked experts shard and train under FSDP as on one process, gathered like
    every weight or each rank keeping two of the four (expert parallelism, the tokens
    sent to them and back), and the sigmoid router's bias, moved by the token counts
    summed over both ranks, is the one process's; so is the balance loss, each expert's
    share of the tokens summed over both ranks."""
    folder = batch[f"moe_{experts}"]
    ours = load_weights(folder / "model.safetensors")
    log = run_log(folder).read_text()
    assert ("each of 2 ranks holds 2 experts" in log) == (experts == "expert_parallel")
    theirs = load_weights(moe_single)
    _assert_same_weights(theirs, ours)
    biases = [name for name in ours if name.endswith("expert_bias")]
    assert len(biases) == 2 and all(ours[b].abs().sum() > 0 for b in biases)


LORA_EXPERTS = (
    *MOE,
    "adapter=lora",
    "adapter.target_modules=[wq,experts]",
    "adapter.dropout=0",
    "optim.name=SGD",
    "optim.lr=3.0",
)


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_lora_on_the_experts_under_fsdp_reaches_the_single_process_weights(
    runs, batch, batch_of_four, tmp_path, strategy
):
    """Adapters on the routed experts (PEFT swaps each expert weight for a computed one at
    every call) with the experts sharded by FSDP like every weight (HSDP: two copies,
    each sharded over two processes): the merged output and the adapter folder are the
    one process's. Plain SGD: under AdamW one row of one
    factor ends 5e-4 from the one process's, under DDP exactly as under FSDP, while
    under SGD every factor agrees within 1e-8; AdamW divides each update by its
    gradient's own running scale, which magnifies the rounding of a row whose gradient
    is small."""
    single = run(compose_config(_overrides(tmp_path / "single", runs["cache"], *LORA_EXPERTS)))
    parallel = batch["lora_experts"] if strategy == "fsdp" else batch_of_four["hsdp_lora_experts"]
    theirs = load_weights(single.weights_path)
    ours = load_weights(parallel / "model.safetensors")
    _assert_same_weights(theirs, ours)
    adapters = [
        load_weights(run_dir / "adapter" / "adapter_model.safetensors")
        for run_dir in (tmp_path / "single", parallel)
    ]
    _assert_same_weights(*adapters)
    experts_b = [v for k, v in adapters[1].items() if "mlp.experts" in k and "lora_B" in k]
    assert len(experts_b) == 4 and all(b.abs().max() > 0 for b in experts_b)  # B starts at 0


def test_hsdp_on_two_by_two_processes_reaches_the_single_process_weights(runs, batch_of_four):
    """Two copies of the model, each sharded over two processes (FSDP2's 2-D mesh), with
    a quarter of the global batch each: the one-process weights, and sharded checkpoints
    that read back as FSDP's do."""
    folder = batch_of_four["hsdp"]
    _assert_same_weights(
        load_weights(runs["single"] / "model.safetensors"),
        load_weights(folder / "model.safetensors"),
    )
    assert "hsdp: 2 copies of the model, each sharded over 2 ranks" in run_log(folder).read_text()
    step = f"step{STEPS // 2:06d}.ckpt"
    hsdp = read_sharded_checkpoint(folder / "checkpoints" / step)
    fsdp = read_sharded_checkpoint(runs["fsdp"] / "checkpoints" / step)
    assert hsdp.keys() == fsdp.keys() and any(k.startswith(MODEL_PREFIX) for k in hsdp)
    _assert_same_weights(hsdp, fsdp)


def test_a_local_submitit_sweep_runs_each_job_on_two_processes(runs, tmp_path):
    """``recipes-train -m hydra/launcher=local``: two jobs (two learning rates), each
    submitit's job of two processes over gloo. The job at the recipe's own rate reaches
    the one-process weights (its two processes were one data-parallel run), the other
    does not (its override reached it)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    root = tmp_path / "sweep"
    overrides = _overrides(root, runs["cache"], "strategy=ddp", "data.batch_size=2")
    lr = compose_config(overrides).optim.lr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "recipes_lib.cli", "-m", "hydra/launcher=local", *overrides]
        + ["trainer.devices=2", f"optim.lr={lr},{lr * 3}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    single = load_weights(runs["single"] / "model.safetensors")
    jobs = [root / "multirun" / str(n) for n in (0, 1)]
    _assert_same_weights(single, load_weights(jobs[0] / "model.safetensors"))
    other = load_weights(jobs[1] / "model.safetensors")
    assert max((other[k] - single[k]).abs().max().item() for k in single) > 1e-3
    # submitit's logs: two processes per job
    logs = sorted(p.name for p in (root / "multirun" / ".submitit").rglob("*_log.out"))
    assert len(logs) == 4 and sum(name.endswith("_1_log.out") for name in logs) == 2, logs


def test_a_reward_model_under_fsdp_matches_one_process(runs, batch, tmp_path):
    """The score head, one row wide, shards with the body (FSDP pads the uneven shard)."""
    single_dir, fsdp_dir = tmp_path / "single", batch["reward"]
    run(
        compose_config(
            ["recipe=reward/tiny", *_dpo_overrides(single_dir, runs, "data.batch_size=4")]
        )
    )
    _assert_same_weights(
        load_weights(single_dir / "model.safetensors"), load_weights(fsdp_dir / "model.safetensors")
    )


def _grpo_overrides(run_dir: Path, runs: dict) -> list[str]:
    return [
        "recipe=grpo/tiny",
        f"run.dir={run_dir}",
        f"data.cache_dir={runs['cache']}",
        f"stage.init_from={runs['single'] / 'model.safetensors'}",
        f"data.tokenizer.path={runs['tokenizer']}",
        *SMALL_VOCAB_OVERRIDES,
        "data.seq_len=128",
        "data.batch_size=2",
        "data.sources.stdlib_grpo.max_documents=200",
        "stage.grpo.max_new_tokens=24",
        "stage.grpo.completions_per_prompt=4",
        "stage.grpo.kl_coef=0.05",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "strategy=fsdp",
        *QUIET_OVERRIDES,
        "callbacks=minimal",
    ]


def test_grpo_samples_through_the_sharded_model_on_two_processes(batch):
    """Both ranks decode the same number of steps (each gathers the weights), whatever
    their own completions; the KL reference is sharded like the policy."""
    run_dir = batch["grpo"]
    weights = load_weights(run_dir / "model.safetensors")
    assert all(t.isfinite().all() for t in weights.values())
    rows = read_metrics(run_dir)
    assert len(metric_series(rows, "train/reward")) == 4
    assert metric_series(rows, "val/reward")


def _kto_overrides(run_dir: Path, runs: dict, *extra: str) -> list[str]:
    kto = [o.replace("stdlib_dpo", "stdlib_kto") for o in _dpo_overrides(run_dir, runs)]
    return ["recipe=kto/tiny", *kto, "optim.lr=3e-3", "stage.kto.undesirable_weight=0", *extra]


def test_kto_on_two_processes_matches_one_process(runs, batch, tmp_path):
    """KTO's reference point, the mismatched completions' mean log-ratio, is taken over
    every rank's twins: two processes with half the batch each reach the one process's
    weights (each rank's own estimate would not). Only desirable examples weigh, so the
    policy rises on code in general and the estimate, clamped at 0, stays above it."""
    single = run(compose_config(_kto_overrides(tmp_path / "single", runs, "data.batch_size=4")))
    assert single.metrics["train/kl"] > 0  # the estimate took part in the last step
    _assert_same_weights(
        load_weights(single.weights_path), load_weights(batch["kto"] / "model.safetensors")
    )
