"""Context parallelism under FSDP2 on the CPU over gloo: the parameters sharded over
every process, the ranks of a row's group included, while each row is split over the
group. Two and four processes give the one-process loss and gradients of a tiny decoder
(fp32, within 1e-5), with plain causal rows and with packed documents crossing the
shards (``fsdp_context_parallel_worker.py``); losses scaled as if a group's partial
gradients were averaged instead of summed are caught. A whole pretraining run under
``strategy=fsdp strategy.context_parallel=2`` follows the one-process run's loss curve
and reaches its weights, and one resumed from its sharded checkpoint ends where the
run that went through does (the refusals are in
``tests/unit/parallel/test_context_parallel_checks.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from integration_helpers import metric_series, read_metrics, tiny_overrides
from run_helpers import built_once, torchrun

from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config
from recipes_lib.train import run

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

WORKER = str(Path(__file__).with_name("fsdp_context_parallel_worker.py"))
RUNNER = str(Path(__file__).with_name("context_parallel_run.py"))


def _case_lines(stdout: str, case: str) -> list[str]:
    """The lines the worker printed for one of its cases."""
    return [line for line in stdout.splitlines() if line.startswith(f"[{case}] ")]


@pytest.fixture(scope="module")
def two_processes() -> str:
    """The worker's output for its three two-process cases, run in one ``torchrun`` job
    (it exits non-zero, failing every test here, if any case fails)."""
    cases = ("2 plain sum", "2 docs sum", "2 docs average")
    args = " + ".join(cases).split()
    return torchrun(2, WORKER, *args, timeout=240, omp_threads=1).stdout


@pytest.mark.parametrize("documents", ["plain", "docs"])
def test_fsdp_with_split_rows_gives_the_one_process_loss_and_gradients(two_processes, documents):
    lines = _case_lines(two_processes, f"2 {documents} sum")
    assert sum("worst grad diff" in line for line in lines) == 2


def test_averaging_a_groups_partial_gradients_is_caught(two_processes):
    """The worker, with each rank's loss divided by the degree (a group's partial
    gradients averaged rather than summed), finds every gradient half the reference's
    and beyond the tolerance: the comparison above would fail on that mistake."""
    lines = _case_lines(two_processes, "2 docs average")
    assert sum("gradient norm ratio 0.500000..0.500000" in line for line in lines) == 2


@pytest.fixture(scope="module")
def four_processes() -> str:
    """The worker's output for its two four-process cases, in one ``torchrun`` job."""
    args = "2 docs sum + 4 docs sum".split()
    return torchrun(4, WORKER, *args, timeout=360, omp_threads=1).stdout


@pytest.mark.slow
@pytest.mark.parametrize("degree", ["2", "4"])
def test_four_processes_shard_over_all_and_split_rows_over_groups(four_processes, degree):
    """Four processes: two replicas of two ranks a row (each replica's own rows, of
    different token counts), and one group of four."""
    lines = _case_lines(four_processes, f"{degree} docs sum")
    assert sum("worst grad diff" in line for line in lines) == 4


COMMON = (
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "run.checkpoint_every_n_steps=4",
    "scheduler.warmup=2",
    "kernels.attention=flex",
    "data.document_mask=true",
    "data.batch_size=2",
)


def _overrides(root: Path, name: str, *extra: str) -> list[str]:
    items = tiny_overrides(root, root / "cache", *COMMON, *extra)
    return [o if not o.startswith("run.dir=") else f"run.dir={root / name}" for o in items]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A folder holding the one-process run (``single``) that the split runs below
    follow, and the data cache they share; each split run writes a folder of its own."""

    def build(folder: Path) -> Path:
        run(compose_config(_overrides(folder, "single")))
        return folder

    return built_once(tmp_path_factory, "fsdp-cp-root", build)


SPLIT = ("strategy=fsdp", "strategy.context_parallel=2", "trainer.devices=2")
MIDDLE = "step000002.ckpt"  # the resumed run's start


@pytest.fixture(scope="module")
def on_two(root, tmp_path_factory) -> Path:
    """The two-process runs, one after another in one ``torchrun`` job: ``split`` (FSDP
    with split rows), then ``through`` (the same, checkpointed every two steps) and
    ``resumed`` (from ``through``'s step-2 sharded checkpoint); each in its folder under
    ``root``."""

    def build(_: Path) -> Path:
        keep = (*SPLIT, "run.checkpoint_every_n_steps=2")
        middle = root / "through" / "checkpoints" / MIDDLE
        runs = [
            _overrides(root, "split", *SPLIT),
            _overrides(root, "through", *keep),
            _overrides(root, "resumed", *keep, f"run.ckpt_path={middle}"),
        ]
        torchrun(2, RUNNER, *[arg for r in runs for arg in ("+", *r)][1:], omp_threads=1)
        return root

    return built_once(tmp_path_factory, "fsdp-cp-on_two", build)


def test_a_pretraining_run_under_fsdp_with_split_rows_follows_the_one_process_run(root, on_two):
    """``recipes_lib.train.run`` with strategy=fsdp strategy.context_parallel=2 over two
    gloo processes: each rank's attention ran on half of every 64-token row, the loss
    curve is the one-process run's within 1e-4 and so are the weights it exports."""
    split = on_two / "split"
    for rank in range(2):
        spied = json.loads((split / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0 and spied["lengths"] == [32]
    ones = metric_series(read_metrics(root / "single"), "train/loss")
    twos = metric_series(read_metrics(split), "train/loss")
    assert len(ones) == 4 and [s for s, _ in twos] == [s for s, _ in ones]
    assert [v for _, v in twos] == pytest.approx([v for _, v in ones], abs=1e-4)
    assert ones[-1][1] < ones[0][1]  # it trained
    x = load_weights(root / "single" / "model.safetensors")
    y = load_weights(split / "model.safetensors")
    assert max((x[k] - y[k]).abs().max().item() for k in x) < 1e-4


FOUR = {"fsdp": ("strategy=fsdp",), "hsdp": ("strategy=hsdp", "strategy.replicas=2")}


@pytest.fixture(scope="module")
def on_four(root, tmp_path_factory) -> Path:
    """The four-process runs (``split_fsdp``, ``split_hsdp``), one after the other in one
    ``torchrun`` job, each in its folder under ``root``."""

    def build(_: Path) -> Path:
        runs = [
            _overrides(
                root,
                f"split_{name}",
                *strategy,
                "strategy.context_parallel=2",
                "data.batch_size=1",
                "trainer.devices=4",
            )
            for name, strategy in FOUR.items()
        ]
        torchrun(4, RUNNER, *[arg for r in runs for arg in ("+", *r)][1:], omp_threads=1)
        return root

    return built_once(tmp_path_factory, "fsdp-cp-on_four", build)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(FOUR))
def test_two_replicas_of_split_rows_under_sharding_reach_the_one_process_weights(
    root, on_four, strategy
):
    """Four processes, parameters sharded over all four (fsdp) or over each pair of one
    of two copies (hsdp): two data-parallel replicas, one row a step each, of two ranks
    sharing each row, reach the weights of one process reading both rows a step."""
    name = f"split_{strategy}"
    for rank in range(4):
        spied = json.loads((root / name / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0 and spied["lengths"] == [32]
    x = load_weights(root / "single" / "model.safetensors")
    y = load_weights(root / name / "model.safetensors")
    assert max((x[k] - y[k]).abs().max().item() for k in x) < 1e-4


@pytest.mark.slow
def test_a_run_under_fsdp_with_split_rows_resumes_from_its_sharded_checkpoint(on_two):
    """Resumed from its step-2 sharded checkpoint, a run under strategy=fsdp
    strategy.context_parallel=2 reads on where it stopped and ends at the weights of
    the run that went through."""
    assert (on_two / "through" / "checkpoints" / MIDDLE).is_dir()  # a sharded folder
    through = metric_series(read_metrics(on_two / "through"), "train/loss")
    resumed = metric_series(read_metrics(on_two / "resumed"), "train/loss")
    assert [s for s, _ in resumed] == [2, 3]  # it went on from the checkpoint
    assert [v for _, v in resumed] == pytest.approx([v for _, v in through[2:]], abs=1e-5)
    x = load_weights(on_two / "through" / "model.safetensors")
    y = load_weights(on_two / "resumed" / "model.safetensors")
    assert max((x[k] - y[k]).abs().max().item() for k in x) < 2e-5
