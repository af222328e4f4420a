"""Auto-fit in a run: a budget picks the configuration, the built model follows it, the
result and the saved config record it; a budget nothing fits stops before training."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import yaml
from integration_helpers import tiny_overrides
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.launch_check.autofit import FIT_SHARE
from recipes_lib.launch_check.memory import GIB, estimate_memory
from recipes_lib.train import run


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, shared_cache):
    root = tmp_path_factory.mktemp("pretrain")
    return run(compose_config(tiny_overrides(root, shared_cache, "trainer.max_steps=4")))


def sft(tmp_path, pretrained, *extra: str) -> list[str]:
    return [
        "recipe=sft/tiny",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"stage.init_from={pretrained.weights_path}",
        f"data.tokenizer.path={pretrained.tokenizer_path}",
        "data.sources.stdlib_sft.max_documents=60",
        "data.seq_len=128",
        "data.batch_size=4",
        *SMALL_VOCAB_OVERRIDES,
        *QUIET_OVERRIDES,
        "trainer.max_steps=2",
        "scheduler.warmup=1",
        "trainer.val_check_interval=null",
        "callbacks=minimal",
        *extra,
    ]


class RecordBlocks(L.Callback):
    """Which blocks recompute their activations, as the run built them."""

    def on_train_start(self, trainer, pl_module):
        self.flags = [
            m.checkpoint_activations
            for m in pl_module.modules()
            if hasattr(m, "checkpoint_activations")
        ]


def test_a_budget_picks_selective_checkpointing_and_the_run_records_it(tmp_path, pretrained):
    overrides = sft(tmp_path, pretrained)
    # a budget that every-2nd-block checkpointing fits and no checkpointing does not
    cfg = to_run_config(compose_config(overrides))
    selective = dataclasses.replace(
        cfg, kernels=dataclasses.replace(cfg.kernels, activation_checkpointing="selective")
    )
    budget = estimate_memory(selective).total / FIT_SHARE * 1.001 / GIB
    assert estimate_memory(cfg).total > FIT_SHARE * budget * GIB  # auto counted as off

    blocks = RecordBlocks()
    result = run(compose_config([*overrides, f"run.memory_budget_gib={budget}"]), [blocks])
    assert result.global_step == 2
    assert blocks.flags == [True, False]  # two blocks: the first is recomputed
    fit = result.memory_fit
    assert fit["activation_checkpointing"] == "selective" and fit["checkpoint_every"] == 2
    assert (fit["batch_size"], fit["accumulate_grad_batches"]) == (4, 1)
    assert fit["line"].startswith("auto-fit: activation checkpointing every 2nd block, loss")
    saved = yaml.safe_load((result.output_dir / "config.yaml").read_text())
    assert saved["kernels"]["activation_checkpointing"] == "selective"


def test_auto_on_the_cpu_without_a_budget_trains_with_checkpointing_off(tmp_path, pretrained):
    blocks = RecordBlocks()
    result = run(compose_config(sft(tmp_path, pretrained)), [blocks])
    assert blocks.flags == [False, False]
    assert result.memory_fit["activation_checkpointing"] == "off"
    assert "no CUDA card and no run.memory_budget_gib" in result.memory_fit["line"]


def test_a_budget_nothing_fits_exits_before_training_with_one_line(tmp_path, pretrained):
    script = Path(sys.executable).parent / "recipes-train"
    proc = subprocess.run(
        [str(script), *sft(tmp_path, pretrained, "run.memory_budget_gib=0.0001")],
        cwd=tmp_path,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(
        "error: run.memory_budget_gib=0.0001: the smallest configuration (activation "
        "checkpointing every block, loss chunk 256, 1 x 128 rows with 4 accumulation steps) "
        "needs an estimated"
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
