"""Each stage's loss curve on one GPU matches the values recorded on this card type.

Pretraining (the ``tiny`` and ``small`` decoders), SFT, LoRA SFT and DPO each train
``STEPS`` steps through ``run(compose_config(...))`` with ``trainer=gpu
precision=bf16-mixed``, a fixed seed and no compilation, and every step's training loss
and the final validation loss are compared with ``reference_losses.json``, keyed by
``torch.cuda.get_device_name()`` and test name (QLoRA has its own tests in
``test_qlora.py``). A card with no record fails and says how to make one::

    RECIPES_RECORD_LOSSES=1 python -m pytest -m gpu tests/gpu/test_stage_curves.py

writes this card's values into ``reference_losses.json`` (commit it) instead of
comparing. The data are the embedded standard-library corpus, so a record holds for
the Python version it was made with (stored beside the values).
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import pytest
import torch
from gpu_helpers import metric_series, read_metrics

from recipes_lib.config import compose_config
from recipes_lib.train import RunResult, run

pytestmark = pytest.mark.gpu

REFERENCE = Path(__file__).with_name("reference_losses.json")
RECORD_ENV = "RECIPES_RECORD_LOSSES"
STEPS = 30
# bf16 on one card with a fixed seed: the curve repeats up to non-deterministic kernels
# (atomic adds in some backward passes), a few thousandths after 30 steps
ABS_TOL, REL_TOL = 0.02, 0.005


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


def _environment() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__}


def check_against_reference(name: str, curve: dict) -> None:
    """Compare ``curve`` with the record of this card, or record it."""
    assert all(math.isfinite(x) for x in [*curve["train/loss"], curve["val/loss"]]), curve
    records = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}
    card = _card()
    if os.environ.get(RECORD_ENV) == "1":
        records.setdefault(card, {})[name] = {**curve, "recorded_with": _environment()}
        REFERENCE.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        return
    expected = records.get(card, {}).get(name)
    if expected is None:
        pytest.fail(
            f"no recorded losses for {name!r} on {card!r} in {REFERENCE}. Record them once on "
            f"this card with `{RECORD_ENV}=1 python -m pytest -m gpu "
            "tests/gpu/test_stage_curves.py`, check that the curves look right, and commit "
            "tests/gpu/reference_losses.json."
        )
    note = f"recorded with {expected.get('recorded_with')}, now {_environment()}"
    got_train, want_train = curve["train/loss"], expected["train/loss"]
    assert len(got_train) == len(want_train), (len(got_train), len(want_train), note)
    bad = [
        (step, got, want)
        for step, (got, want) in enumerate(zip(got_train, want_train, strict=True))
        if abs(got - want) > ABS_TOL + REL_TOL * abs(want)
    ]
    assert not bad, f"{name}: (step, got, recorded) beyond tolerance: {bad[:8]}; {note}"
    assert curve["val/loss"] == pytest.approx(expected["val/loss"], abs=ABS_TOL, rel=REL_TOL), note


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


def test_pretrain_tiny_curve(pretrained):
    curve = _curve(pretrained)
    assert curve["train/loss"][-1] < curve["train/loss"][0] - 0.5  # it learns
    check_against_reference("pretrain_tiny", curve)


def test_pretrain_small_curve(tmp_path, cache):
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
    check_against_reference("pretrain_small", curve)


@pytest.mark.parametrize(
    "name,recipe,source",
    [
        ("sft", "sft/tiny", "stdlib_sft"),
        ("sft_lora", "sft/lora_tiny", "stdlib_sft"),
        ("dpo", "dpo/tiny", "stdlib_dpo"),
    ],
)
def test_post_training_curve(pretrained, tmp_path, cache, name, recipe, source):
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
    check_against_reference(name, curve)
