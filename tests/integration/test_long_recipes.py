"""The long-context recipes: ``cpt/long`` and ``sft/long`` compose, pass the pre-flight
and fit an 80 GB H100 by the launch check's estimate with their rows split and their
block inputs offloaded; shrunk to a tiny model, each trains a few steps on the CPU over
two gloo processes with the recipe's context parallelism, YaRN, checkpointing and
activation offload. The long-context page's memory table is the estimate's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from integration_helpers import metric_series, read_metrics
from run_helpers import torchrun
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.launch_check import estimate_memory
from recipes_lib.preflight import check_run

ROOT = Path(__file__).resolve().parents[2]
RUNNER = str(Path(__file__).with_name("context_parallel_run.py"))
H100_GIB = 79.1
DATA = ("data.sources.main.path=LONG", "data.sources.short.path=SHORT")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


@pytest.mark.parametrize(
    ("recipe", "extra", "degree"),
    [("cpt/long", DATA, 4), ("cpt/long_8b", DATA, 4), ("sft/long", (), 2)],
)
def test_a_long_recipe_passes_the_preflight_and_fits_an_h100(recipe, extra, degree):
    cfg = to_run_config(compose_config([f"recipe={recipe}", *extra]))
    check_run(cfg, (cfg.stage.objective,))
    assert cfg.strategy.context_parallel == degree == cfg.trainer.devices
    assert cfg.model.rope_scaling.type == "yarn" and cfg.model.max_seq_len == 131072
    assert cfg.kernels.activation_offload and cfg.kernels.activation_checkpointing == "full"
    estimate = estimate_memory(cfg, world_size=degree)
    assert estimate.total < H100_GIB * 2**30
    assert any("context_parallel" in n for n in estimate.notes)
    assert any("activation_offload" in n for n in estimate.notes)
    without = estimate_memory(
        to_run_config(
            compose_config([f"recipe={recipe}", *extra, "kernels.activation_offload=false"])
        ),
        world_size=degree,
    )
    assert estimate.total < without.total


def _tiny(root: Path, recipe: str, *extra: str) -> list[str]:
    """The recipe on the tiny decoder (the recipe's YaRN kept), rows of 256 tokens split
    over two CPU processes, six steps."""
    return [
        f"recipe={recipe}",
        "model=tiny",
        "model.max_seq_len=1024",
        *SMALL_VOCAB_OVERRIDES,
        "trainer=cpu",
        "trainer.devices=2",
        "strategy.context_parallel=2",
        "precision=32-true",
        "data.seq_len=256",
        "data.batch_size=2",
        f"data.cache_dir={root / 'cache'}",
        f"run.dir={root / 'run'}",
        "optim.lr=3e-3",
        "scheduler.warmup=1",
        "trainer.max_steps=6",
        "trainer.accumulate_grad_batches=1",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "run.checkpoint_every_n_steps=6",
        "callbacks=minimal",
        *QUIET_OVERRIDES,
        *extra,
    ]


def _trains_split_and_offloaded(run_dir: Path) -> None:
    for rank in range(2):
        spied = json.loads((run_dir / f"sharded_rank{rank}.json").read_text())
        assert spied["calls"] > 0 and spied["lengths"] == [128]  # half of each row
        assert spied["offloaded"] > 0  # block inputs went through the host copies
    losses = [v for _, v in metric_series(read_metrics(run_dir), "train/loss")]
    assert len(losses) == 6 and losses[-1] < losses[0]


CPT_RECIPES = ("cpt/long", "cpt/long_8b")  # ddp; fsdp


def _chat_records(path: Path) -> Path:
    """Conversations for the shrunk SFT recipe, written to ``path``."""
    words = "sum the list of numbers and return it as a string in order".split()

    def text(i: int, n: int, step: int) -> str:
        return " ".join(words[(i + j * step) % len(words)] for j in range(n))

    records = [
        {
            "messages": [
                {"role": "user", "content": text(i, 20, 1)},
                {"role": "assistant", "content": text(i, 60, i)},
            ]
        }
        for i in range(80)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory) -> dict[str, Path]:
    """Both shrunk continued-pretraining recipes on the same texts, then the shrunk SFT
    recipe on conversations, one after the other in one ``torchrun`` job; each
    recipe's run folder."""
    root = tmp_path_factory.mktemp("long")
    words = "the of and a to in is was for on that with as by at from it an".split()
    for name, docs, length in (("long", 3, 6000), ("short", 40, 300)):
        text = "\n\n".join(
            " ".join(words[(d * 7 + i * i) % len(words)] for i in range(length))
            for d in range(docs)
        )
        (root / f"{name}.txt").write_text(text)
    args: list[str] = []
    for recipe in CPT_RECIPES:
        folder = root / recipe.replace("/", "_")
        folder.mkdir()
        args += [
            *(["+"] if args else []),
            *_tiny(
                folder,
                recipe,
                f"data.sources.main.path={root / 'long.txt'}",
                f"data.sources.short.path={root / 'short.txt'}",
                "data.val_fraction=0.3",
            ),
        ]
    sft = root / "sft_long"
    sft.mkdir()
    chats = _chat_records(root / "chats.jsonl")
    args += ["+", *_tiny(sft, "sft/long", f"data.path={chats}", "data.chat.chat_template=plain")]
    torchrun(2, RUNNER, *args, timeout=600, omp_threads=1)
    recipes = (*CPT_RECIPES, "sft/long")
    return {recipe: root / recipe.replace("/", "_") / "run" for recipe in recipes}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", CPT_RECIPES)
def test_cpt_long_shrunk_trains_on_the_cpu_with_split_rows_and_offload(long_runs, recipe):
    _trains_split_and_offloaded(long_runs[recipe])


@pytest.mark.slow
def test_sft_long_shrunk_trains_on_the_cpu_with_split_rows_and_offload(long_runs):
    _trains_split_and_offloaded(long_runs["sft/long"])


@pytest.mark.slow
def test_the_memory_table_of_the_long_context_page_is_the_estimate(monkeypatch, capsys):
    """What the script prints, run in this process (the estimate reads no data, and a
    process of its own would spend most of its time importing the library again)."""
    script = ROOT / "benchmarks" / "long_context_memory.py"
    monkeypatch.syspath_prepend(str(script.parent))
    monkeypatch.setattr(sys, "argv", [str(script)])
    import long_context_memory

    long_context_memory.main()
    table = capsys.readouterr().out.strip()
    assert table in (ROOT / "docs" / "long-context.md").read_text()
