"""The GPU recipes run end to end for a few steps on one CUDA card (``pytest -m gpu``)."""

from __future__ import annotations

import math

import pytest
import torch

from recipes_lib.config import compose_config
from recipes_lib.train import run

pytestmark = pytest.mark.gpu


def _gpu_overrides(recipe: str, tmp_path, *extra: str) -> list[str]:
    return [
        f"recipe={recipe}",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.sources.stdlib.max_documents=300",
        "trainer.max_steps=6",
        "trainer.accumulate_grad_batches=1",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "scheduler.warmup=2",
        "run.checkpoint_every_n_steps=6",
        "callbacks.throughput.window=2",
        *extra,
    ]


@pytest.mark.parametrize(
    "recipe,extra",
    [
        ("pretrain/gpt_124m", ("data.batch_size=4", "data.tokenizer.vocab_size=8192")),
        ("pretrain/llama_1b", ("data.batch_size=2", "data.tokenizer.vocab_size=8192")),
        ("pretrain/tiny_packed", ("trainer=gpu", "trainer.max_steps=6")),
    ],
)
def test_gpu_recipe_runs_a_few_steps(recipe, extra, tmp_path):
    torch.cuda.reset_peak_memory_stats()
    result = run(compose_config(_gpu_overrides(recipe, tmp_path, *extra)))
    assert result.global_step == 6
    assert math.isfinite(result.metrics["train/loss"])
    assert math.isfinite(result.metrics["val/loss"])
    assert result.last_checkpoint is not None and result.last_checkpoint.is_file()
    # on the GPU the throughput callback knows the card's peak and logs MFU
    assert 0.0 < result.metrics["perf/mfu"] < 1.0


def test_gpu_resume_continues_from_last_checkpoint(tmp_path):
    small = ("data.batch_size=2", "data.tokenizer.vocab_size=8192")
    first = run(compose_config(_gpu_overrides("pretrain/gpt_124m", tmp_path, *small)))
    resumed = run(
        compose_config(
            _gpu_overrides(
                "pretrain/gpt_124m",
                tmp_path,
                "data.batch_size=2",
                "trainer.max_steps=8",
                "run.ckpt_path=last",
            )
        )
    )
    assert first.global_step == 6 and resumed.global_step == 8
    assert resumed.tokens_seen == 8 * 2 * 2048
