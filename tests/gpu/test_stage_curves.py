"""Each stage's loss curve on one GPU against the curves recorded per card.

Pretraining (the ``tiny`` and ``small`` decoders), SFT, LoRA SFT and DPO each train
``STEPS`` steps through ``run(compose_config(...))`` with ``trainer=gpu
precision=bf16-mixed``, a fixed seed and no compilation (QLoRA has its own tests in
``test_qlora.py``). Every curve must be finite and fall; then its training losses and
final validation loss are compared with ``reference_losses.json``, keyed by
``torch.cuda.get_device_name()`` and test name: with this card's record step by step, or,
on a card without one, with the nearest recorded card's (same compute capability first)
within a wider band on window means. The rules and their tolerances are in
``tests/reference_curves.py``; each test reports the record it used as the
``loss_reference`` property (``--junitxml``), and a warning when it was another card's.
A missing record never fails by itself. To record this card's curves::

    RECIPES_RECORD_LOSSES=1 python -m pytest -m gpu tests/gpu/test_stage_curves.py

writes them into ``reference_losses.json`` (commit it; ``tests/unit/test_reference_curves.py``
then checks the recorded cards agree within the cross-card band) instead of comparing. The
data are the embedded standard-library corpus, so a record holds for the Python version it
was made with (stored beside the values).
"""

from __future__ import annotations

import math
import os
import platform
import warnings
from pathlib import Path

import pytest
import torch
from gpu_helpers import metric_series, read_metrics
from reference_curves import (
    REFERENCE,
    LossReferenceWarning,
    curve_problems,
    find_reference,
    load_records,
    mismatches,
    record_curve,
)

from recipes_lib.config import compose_config
from recipes_lib.train import RunResult, run

pytestmark = pytest.mark.gpu

RECORD_ENV = "RECIPES_RECORD_LOSSES"
RECORD_COMMAND = f"{RECORD_ENV}=1 python -m pytest -m gpu tests/gpu/test_stage_curves.py"
STEPS = 30


def _overrides(recipe: str, run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [
        f"recipe={recipe}",
        "trainer=gpu",
        "precision=bf16-mixed",
        "strategy=single",
        "kernels.compile=false",
        "run.seed=1234",
        f"run.dir={run_dir}",
        f"data.cache_dir={cache}",
        f"trainer.max_steps={STEPS}",
        "trainer.accumulate_grad_batches=1",
        f"trainer.val_check_interval={STEPS}",
        "trainer.limit_val_batches=4",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "scheduler.warmup=5",
        f"run.checkpoint_every_n_steps={STEPS}",
        "run.save_top_k=0",
        "callbacks=minimal",
        "logger=csv",
        *extra,
    ]


def _curve(result: RunResult) -> dict:
    rows = read_metrics(result.output_dir)
    train = metric_series(rows, "train/loss")
    assert [step for step, _ in train] == list(range(STEPS)), "one train/loss row per step"
    assert "val/loss" in result.metrics, f"no validation ran: {sorted(result.metrics)}"
    return {
        "train/loss": [round(loss, 5) for _, loss in train],
        "val/loss": round(result.metrics["val/loss"], 5),
    }


def _card() -> str:
    return torch.cuda.get_device_name(0)


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


def _environment() -> dict:
    major, minor = _capability()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "capability": f"{major}.{minor}",
    }


def check_against_reference(name: str, curve: dict, record_property) -> None:
    """Check ``curve`` on its own, then against the nearest record, or record it."""
    problems = curve_problems(curve)
    # before recording too: a broken curve must not become a card's reference
    assert not problems, f"{name} on {_card()!r}: {problems}"
    card = _card()
    if os.environ.get(RECORD_ENV) == "1":
        record_curve(card, name, curve, _environment())
        record_property("loss_reference", f"recorded for {card!r} in {REFERENCE}")
        return
    reference = find_reference(load_records(), card, _capability(), name)
    if reference is None:
        record_property("loss_reference", "none")
        warnings.warn(
            f"{name}: no card has a recorded curve in {REFERENCE}, so it was only checked to "
            f"be finite and to fall. Record one with `{RECORD_COMMAND}`.",
            LossReferenceWarning,
            stacklevel=2,
        )
        return
    record_property("loss_reference", reference.describe())
    if reference.card != card:
        warnings.warn(
            f"{name}: {card!r} has no record; compared with {reference.describe()} within "
            f"the cross-card band. Record this card with `{RECORD_COMMAND}`, check that the "
            "curves look right, and commit tests/gpu/reference_losses.json.",
            LossReferenceWarning,
            stacklevel=2,
        )
    problems = mismatches(curve, reference)
    assert not problems, (
        f"{name} on {card!r} against {reference.describe()}, now {_environment()}: {problems}"
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One tokenizer and shard cache for the module."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, cache) -> RunResult:
    """Pretraining of the tiny decoder; its weights start the post-training stages."""
    run_dir = tmp_path_factory.mktemp("pretrain_tiny") / "run"
    return run(
        compose_config(
            _overrides("pretrain/tiny", run_dir, cache, "data.sources.stdlib.max_documents=300")
        )
    )


def test_pretrain_tiny_curve(pretrained, record_property):
    curve = _curve(pretrained)
    assert curve["train/loss"][-1] < curve["train/loss"][0] - 0.5  # it learns
    check_against_reference("pretrain_tiny", curve, record_property)


def test_pretrain_small_curve(tmp_path, cache, record_property):
    result = run(
        compose_config(
            _overrides(
                "pretrain/tiny",
                tmp_path / "run",
                cache,
                "model=small",
                "data.sources.stdlib.max_documents=300",
            )
        )
    )
    curve = _curve(result)
    assert curve["train/loss"][-1] < curve["train/loss"][0] - 0.5
    check_against_reference("pretrain_small", curve, record_property)


@pytest.mark.parametrize(
    "name,recipe,source",
    [
        ("sft", "sft/tiny", "stdlib_sft"),
        ("sft_lora", "sft/lora_tiny", "stdlib_sft"),
        ("dpo", "dpo/tiny", "stdlib_dpo"),
    ],
)
def test_post_training_curve(pretrained, tmp_path, cache, record_property, name, recipe, source):
    result = run(
        compose_config(
            _overrides(
                recipe,
                tmp_path / "run",
                cache,
                f"stage.init_from={pretrained.weights_path}",
                f"data.tokenizer.path={pretrained.tokenizer_path}",
                f"data.sources.{source}.max_documents=400",
            )
        )
    )
    assert result.global_step == STEPS
    curve = _curve(result)
    if name == "dpo":  # the policy starts as the reference: the sigmoid loss is log 2
        assert curve["train/loss"][0] == pytest.approx(math.log(2), abs=0.02)
    check_against_reference(name, curve, record_property)
