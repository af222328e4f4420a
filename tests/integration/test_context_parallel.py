"""Context parallelism on the CPU over gloo: each row split over 2 and 4 processes gives
the one-process loss and gradients of a tiny decoder (fp32, within 1e-5), with plain
causal rows, packed rows whose documents cross the shards, and local-window layers.
The comparison runs inside each process (``context_parallel_worker.py``). Whole runs
(pretraining, SFT with LoRA on packed conversations, SFT on padded ones, DPO with a
reference of its own and with LoRA's, KTO, a reward model, distillation from a frozen
teacher) over two processes follow the one-process run's loss curve and reach its
weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from integration_helpers import metric_series, read_metrics, tiny_overrides
from run_helpers import built_once, torchrun
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config
from recipes_lib.train import run

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

WORKER = str(Path(__file__).with_name("context_parallel_worker.py"))
RUNNER = str(Path(__file__).with_name("context_parallel_run.py"))


@pytest.fixture(scope="module")
def two_processes() -> str:
    """The worker's output for its two-process cases, run in one ``torchrun`` job (it
    exits non-zero, failing both tests, if either case fails)."""
    args = "sdpa plain plain + flex docs plain".split()
    return torchrun(2, WORKER, *args, timeout=180, omp_threads=1).stdout


@pytest.mark.parametrize(
    ("processes", "attention", "documents", "window"),
    [
        (2, "sdpa", "plain", "plain"),
        (2, "flex", "docs", "plain"),
        (4, "flex", "docs", "window"),
    ],
)
def test_split_rows_give_the_one_process_loss_and_gradients(
    request, processes, attention, documents, window
):
    case = f"{attention} {documents} {window}"
    if processes == 2:
        stdout = request.getfixturevalue("two_processes")
    else:
        stdout = torchrun(processes, WORKER, *case.split(), timeout=120, omp_threads=1).stdout
    lines = [line for line in stdout.splitlines() if line.startswith(f"[{case}] ")]
    assert sum("worst grad diff" in line for line in lines) == processes


COMMON = (
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "run.checkpoint_every_n_steps=4",
    "scheduler.warmup=2",
    "kernels.attention=flex",
    "data.document_mask=true",
)


def _overrides(root: Path, name: str, *extra: str) -> list[str]:
    items = tiny_overrides(root, root / "cache", *COMMON, *extra)
    return [o if not o.startswith("run.dir=") else f"run.dir={root / name}" for o in items]


def _split_overrides(root: Path, name: str, processes: int, batch_size: int) -> list[str]:
    """The tiny pretraining run on ``processes`` gloo processes, each row split over two,
    in ``root / name``."""
    return _overrides(
        root,
        name,
        "strategy=ddp",
        "strategy.context_parallel=2",
        f"data.batch_size={batch_size}",
        f"trainer.devices={processes}",
    )


def _assert_split(run_dir: Path, processes: int) -> Path:
    """Each rank's attention ran on its half of every 64-token row."""
    for rank in range(processes):
        spied = json.loads((run_dir / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0 and spied["lengths"] == [32]
    return run_dir


def _one_job(processes: int, *runs: list[str]) -> None:
    """``runs`` one after another in one ``torchrun`` job of ``processes``."""
    args = [arg for overrides in runs for arg in ("+", *overrides)][1:]
    torchrun(processes, RUNNER, *args, omp_threads=1)


def _largest_weight_difference(a: Path, b: Path) -> float:
    x, y = load_weights(a / "model.safetensors"), load_weights(b / "model.safetensors")
    return max((x[k] - y[k]).abs().max().item() for k in x)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A folder holding the one-process pretraining run (``single``, two rows a step)
    that the split runs below follow, and the data cache they share."""

    def build(folder: Path) -> Path:
        run(compose_config(_overrides(folder, "single", "data.batch_size=2")))
        return folder

    return built_once(tmp_path_factory, "cp-root", build)


@pytest.fixture(scope="module")
def on_two(root, tmp_path_factory) -> Path:
    """The two-process runs with split rows, one after another in one ``torchrun`` job:
    the pretraining run (``split``) and each SFT case's (``<recipe>/split``, beside the
    data cache its one-process run shares), under ``root``."""

    def build(_: Path) -> Path:
        runs = [_split_overrides(root, "split", processes=2, batch_size=2)]
        split = ("strategy=ddp", "strategy.context_parallel=2", "trainer.devices=2")
        for recipe, rows in SFT_CASES.items():
            folder = _sft_folder(root, recipe)
            runs.append(_sft_overrides(folder, "split", recipe, *_sft_rows(rows), *split))
        for recipe in PAIR_CASES:
            runs.append(_dpo_overrides(root, recipe, "split", *split))
        runs.append(_distill_overrides(root, "split", *split))
        runs.append(_grpo_overrides(root, "split", *split))
        _one_job(2, *runs)
        return root

    return built_once(tmp_path_factory, "cp-on_two", build)


def test_a_pretraining_run_with_split_rows_follows_the_one_process_run(root, on_two):
    """``recipes_lib.train.run`` with strategy.context_parallel=2 over two gloo processes
    (one data-parallel replica) trains on the one-process run's rows, packed documents
    masked, and logs its loss curve within 1e-4."""
    split_dir = _assert_split(on_two / "split", processes=2)
    single = metric_series(read_metrics(root / "single"), "train/loss")
    split = metric_series(read_metrics(split_dir), "train/loss")
    assert len(single) == 4
    assert [s for s, _ in split] == [s for s, _ in single]
    assert [v for _, v in split] == pytest.approx([v for _, v in single], abs=1e-4)
    assert single[-1][1] < single[0][1]  # it trained
    assert _largest_weight_difference(root / "single", split_dir) < 1e-4


@pytest.mark.slow
def test_two_replicas_of_split_rows_reach_the_one_process_weights(root):
    """Four processes: two data-parallel replicas (one row a step each) of two ranks that
    share each row reach the weights and validation loss of one process reading both
    rows a step."""
    _one_job(4, _split_overrides(root, "split_replicas", processes=4, batch_size=1))
    split_dir = _assert_split(root / "split_replicas", processes=4)
    assert _largest_weight_difference(root / "single", split_dir) < 1e-4
    val = [v for _, v in metric_series(read_metrics(split_dir), "val/loss")]
    ref = [v for _, v in metric_series(read_metrics(root / "single"), "val/loss")]
    assert val == pytest.approx(ref, abs=1e-4)


def _sft_overrides(root: Path, name: str, recipe: str, *extra: str) -> list[str]:
    """A tiny SFT run from scratch (its tokenizer trained on the records, shared by both
    runs through the cache): rows of 64 tokens, two a step, four steps."""
    return [
        f"recipe={recipe}",
        f"run.dir={root / name}",
        f"data.cache_dir={root / 'cache'}",
        "data.seq_len=64",
        "data.batch_size=2",
        "data.sources.stdlib_sft.max_documents=200",
        *SMALL_VOCAB_OVERRIDES,
        *COMMON,
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        *QUIET_OVERRIDES,
        "callbacks=minimal",
        *extra,
    ]


SFT_CASES = {
    # packed conversations, LoRA; blocks recomputed in the backward (their attention
    # sharded again there) with their inputs offloaded
    "sft/lora_tiny": "data.chat.packing=true kernels.activation_offload=true",
    "sft/tiny": "data.chat.packing=false",  # one padded conversation a row
}


def _sft_rows(rows: str) -> tuple[str, ...]:
    return (*rows.split(), "kernels.activation_checkpointing=full")


def _sft_folder(root: Path, recipe: str) -> Path:
    return root / recipe.replace("/", "_")


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "rows"), list(SFT_CASES.items()))
def test_an_sft_run_with_split_rows_follows_the_one_process_run(on_two, recipe, rows):
    """SFT over two gloo processes at strategy.context_parallel=2 (one replica): the loss
    on the assistant's tokens only, conversations masked from each other, follows the
    one-process curve within 1e-4 (fp32), validation too, and the weights (LoRA's
    merged) agree. Padded rows of any length are widened to a multiple of four. Every
    block is recomputed in the backward pass, sharded as in the forward."""
    folder = _sft_folder(on_two, recipe)
    run(compose_config(_sft_overrides(folder, "single", recipe, *_sft_rows(rows))))
    for rank in range(2):
        spied = json.loads((folder / "split" / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0 and max(spied["lengths"]) <= 32  # half of each row
        if "packing=true" in rows:
            assert spied["lengths"] == [32]
            assert spied["offloaded"] > 0
    single = read_metrics(folder / "single")
    split = read_metrics(folder / "split")
    for name in ("train/loss", "val/loss"):
        ones, twos = metric_series(single, name), metric_series(split, name)
        assert ones and [s for s, _ in twos] == [s for s, _ in ones]
        assert [v for _, v in twos] == pytest.approx([v for _, v in ones], abs=1e-4)
    assert _largest_weight_difference(folder / "single", folder / "split") < 1e-4


# DPO with a separate frozen reference, and with LoRA's (the policy with its adapters
# bypassed); KTO, whose mismatched twins run in rows of their own without a gradient; a
# reward model, whose scores are read at one position of each sequence
PAIR_CASES = ("dpo/tiny", "dpo/lora_tiny", "kto/tiny", "reward/tiny")


def _pair_source(recipe: str) -> list[str]:
    """The built-in source of ``recipe``'s examples, cut short. KTO's completions are
    one per example, each with a twin from another: 100 leave no held-out example that
    fits 64-token rows."""
    if recipe.startswith("kto/"):
        return ["data.sources.stdlib_kto.max_documents=400"]
    return ["data.sources.stdlib_dpo.max_documents=100"]


def _dpo_overrides(root: Path, recipe: str, name: str, *extra: str) -> list[str]:
    """DPO from the one-process pretraining run's weights and tokenizer, on pairs packed
    into rows of 64 tokens with their documents masked, four pairs a step."""
    return [
        f"recipe={recipe}",
        f"run.dir={_sft_folder(root, recipe) / name}",
        f"data.cache_dir={root / 'cache'}",
        f"stage.init_from={root / 'single' / 'model.safetensors'}",
        f"data.tokenizer.path={root / 'single' / 'tokenizer.json'}",
        *SMALL_VOCAB_OVERRIDES,
        "data.seq_len=64",
        "data.batch_size=4",
        *_pair_source(recipe),
        "data.document_mask=true",
        "kernels.attention=flex",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "scheduler.warmup=1",
        "optim.lr=1e-3",  # the policy moves off the reference within the three steps
        *QUIET_OVERRIDES,
        "callbacks=minimal",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", PAIR_CASES)
def test_a_pair_run_with_split_rows_follows_the_one_process_run(on_two, recipe):
    """DPO, KTO and reward modelling over two gloo processes at
    strategy.context_parallel=2 (one replica): each rank runs the policy (and the
    reference) on half of every packed row, each sequence's log-probs are summed over
    the two halves (a reward model's score is read on the rank holding its position),
    and the loss, reward margins and weights follow the one-process run (fp32, within
    1e-4)."""
    folder = _sft_folder(on_two, recipe)
    run(compose_config(_dpo_overrides(on_two, recipe, "single")))
    for rank in range(2):
        spied = json.loads((folder / "split" / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0 and spied["lengths"] == [32]  # half of each row
    single = read_metrics(folder / "single")
    split = read_metrics(folder / "split")
    checked = ("train/loss", "train/rewards/margin", "val/loss", "val/rewards/accuracy")
    if recipe.startswith("kto/"):  # no accuracy without pairs; the twins' KL estimate
        checked = ("train/loss", "train/rewards/margin", "train/kl", "val/loss", "val/kl")
    for name in checked:
        ones, twos = metric_series(single, name), metric_series(split, name)
        assert ones and [s for s, _ in twos] == [s for s, _ in ones], name
        assert [v for _, v in twos] == pytest.approx([v for _, v in ones], abs=1e-4), name
    assert _largest_weight_difference(folder / "single", folder / "split") < 1e-4


def _distill_overrides(root: Path, name: str, *extra: str) -> list[str]:
    """A student from scratch distilled from the one-process pretraining run (its
    tokenizer too) on packed conversations, every block recomputed in the backward."""
    folder = _sft_folder(root, "distill/tiny")
    teacher = f"stage.distill.teacher_from={root / 'single'}"
    return _sft_overrides(
        folder, name, "distill/tiny", *_sft_rows("data.chat.packing=true"), teacher, *extra
    )


@pytest.mark.slow
def test_a_distillation_run_with_split_rows_follows_the_one_process_run(on_two):
    """Distillation over two gloo processes at strategy.context_parallel=2: the student
    and the frozen teacher each run on half of every packed row, and the divergence
    (a mean over the assistant's tokens), its validation and the student's weights
    follow the one-process run (fp32, within 1e-4)."""
    folder = _sft_folder(on_two, "distill/tiny")
    run(compose_config(_distill_overrides(on_two, "single")))
    for rank in range(2):
        spied = json.loads((folder / "split" / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0 and spied["lengths"] == [32]  # half of each row
    single = read_metrics(folder / "single")
    split = read_metrics(folder / "split")
    for name in ("train/loss", "val/loss"):
        ones, twos = metric_series(single, name), metric_series(split, name)
        assert ones and [s for s, _ in twos] == [s for s, _ in ones], name
        assert [v for _, v in twos] == pytest.approx([v for _, v in ones], abs=1e-4), name
    train = metric_series(single, "train/loss")
    assert train[-1][1] < train[0][1]  # the student moved toward the teacher
    assert _largest_weight_difference(folder / "single", folder / "split") < 1e-4


def _grpo_overrides(root: Path, name: str, *extra: str) -> list[str]:
    """GRPO from the one-process pretraining run's weights and tokenizer: two prompts a
    step, four completions of each of at most 16 tokens, two updates on each batch (the
    sampling policy's log-probs kept) and a KL term to a separate frozen reference, in
    padded rows of up to 128 tokens."""
    return [
        "recipe=grpo/tiny",
        f"run.dir={root / 'grpo_tiny' / name}",
        f"data.cache_dir={root / 'cache'}",
        f"stage.init_from={root / 'single' / 'model.safetensors'}",
        f"data.tokenizer.path={root / 'single' / 'tokenizer.json'}",
        *SMALL_VOCAB_OVERRIDES,
        "data.seq_len=128",
        "data.batch_size=2",
        "data.sources.stdlib_grpo.max_documents=60",
        "stage.grpo.completions_per_prompt=4",
        "stage.grpo.max_new_tokens=16",
        # a reward the barely trained model earns about half the time, so that groups
        # differ and the loss has a gradient (the recipe's own rewards give it none)
        "+stage.grpo.rewards.first.weight=1.0",
        "+stage.grpo.rewards.first.fn._target_=recipes_lib.rewards.format_match",
        '+stage.grpo.rewards.first.fn.pattern="[a-m].*"',
        "stage.grpo.kl_coef=0.1",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "optim.lr=1e-3",  # the policy moves off the sampling policy and the reference
        *QUIET_OVERRIDES,
        "callbacks=minimal",
        *extra,
    ]


@pytest.mark.slow
def test_a_grpo_run_with_split_rows_follows_the_one_process_run(on_two):
    """GRPO over two gloo processes at strategy.context_parallel=2 (one replica): both
    ranks take the completions one samples, each runs the policy, the sampling policy
    and the reference on half of every padded row, and the loss (each completion's sums
    added up over the halves), its KL and clipping figures and the weights follow the
    one-process run (fp32, within 1e-4)."""
    folder = on_two / "grpo_tiny"
    run(compose_config(_grpo_overrides(on_two, "single")))
    for rank in range(2):
        spied = json.loads((folder / "split" / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0
    single = read_metrics(folder / "single")
    split = read_metrics(folder / "split")
    for name in ("train/reward", "train/loss", "train/kl", "train/clip_fraction", "val/reward"):
        ones, twos = metric_series(single, name), metric_series(split, name)
        assert ones and [s for s, _ in twos] == [s for s, _ in ones], name
        assert [v for _, v in twos] == pytest.approx([v for _, v in ones], abs=1e-4), name
    kl = [v for _, v in metric_series(single, "train/kl")]
    assert max(kl) > 0  # the policy left the reference: the KL term was in the loss
    assert _largest_weight_difference(folder / "single", on_two / "single") > 1e-3  # it moved
    assert _largest_weight_difference(folder / "single", folder / "split") < 1e-4
