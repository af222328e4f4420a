"""Pipelines that decide on numbers: a stage's evaluation after training, an eval stage
that trains nothing, a promote stage that hands on the best of two candidates, and
gates that stop the pipeline with one line when a stage falls short; every bad gate,
task or choice metric is refused before anything trains."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.checkpoint.manifest import read_manifest
from recipes_lib.errors import ConfigError, GateFailed
from recipes_lib.pipeline import parse_pipeline, plan_pipeline, run_pipeline

EVALUATE = {"tasks": ["stdlib_bodies"], "limit": 12, "batch_size": 16}
ACC = "eval/stdlib_bodies/acc"
ACC_NORM = "eval/stdlib_bodies/acc_norm"


def spec(tmp_path, stages: dict, name: str = "gated"):
    return parse_pipeline(
        {
            "name": name,
            "dir": str(tmp_path / name),
            "overrides": [
                *SMALL_VOCAB_OVERRIDES,
                "data.sources.stdlib.max_documents=120",
                "data.seq_len=64",
                "data.batch_size=4",
                "trainer.limit_val_batches=1",
                "trainer.val_check_interval=4",
                "trainer.log_every_n_steps=1",
                *QUIET_OVERRIDES,
                "callbacks=minimal",
            ],
            "stages": stages,
        }
    )


def stages(gate: str = ">= 0.0") -> dict:
    short = {"scheduler": {"warmup": 1}}
    anneal = {"recipe": "pretrain/tiny", "from": "pretrain", "trainer": {"max_steps": 4}, **short}
    return {
        "pretrain": {
            "recipe": "pretrain/tiny",
            "trainer": {"max_steps": 8},
            "evaluate": EVALUATE,
            **short,
        },
        "slow": {**anneal, "optim": {"lr": 1e-5}, "evaluate": EVALUATE},
        "fast": {
            **anneal,
            "optim": {"lr": 3e-3},
            "evaluate": EVALUATE,
            "gates": {"val/loss": "<= from + 0.5", ACC: ">= from - 1.0"},
        },
        "best": {"kind": "promote", "candidates": ["slow", "fast"], "by": "val/loss"},
        "check": {"kind": "eval", "from": "best", "evaluate": EVALUATE, "gates": {ACC: gate}},
        "after": {"recipe": "pretrain/tiny", "from": "check", "trainer": {"max_steps": 2}, **short},
    }


@pytest.fixture(scope="module")
def gated(tmp_path_factory, shared_cache):
    tmp_path = tmp_path_factory.mktemp("gated")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RECIPES_CACHE", str(shared_cache))
        pipeline = spec(tmp_path, stages())
        return pipeline, run_pipeline(pipeline)


def test_stages_are_evaluated_gated_and_the_best_promoted(gated):
    pipeline, result = gated
    assert [s.status for s in result.stages] == ["trained"] * 3 + ["promoted", "evaluated"] + [
        "trained"
    ]
    for name in ("pretrain", "slow", "fast"):
        evaluation = result[name].manifest.evaluation
        assert evaluation["examples"] == {"stdlib_bodies": 12}
        assert 0.0 <= evaluation["results"]["stdlib_bodies"]["acc"] <= 1.0
    # the promote stage chose the lower validation loss and hands on its weights
    best = result["best"].manifest
    losses = {n: result[n].manifest.metrics.val_loss for n in ("slow", "fast")}
    winner = min(losses, key=losses.get)
    assert best.promotion["winner"] == winner
    assert best.promotion["candidates"] == pytest.approx(losses)
    assert best.weights.sha256 == result[winner].manifest.weights.sha256
    assert best.weights_path.resolve() == result[winner].manifest.weights_path.resolve()
    # the eval stage evaluated those weights: the winner's own evaluation, recomputed
    check = read_manifest(pipeline.dir / "check")  # verifies the weights it points at
    assert check.kind == "eval" and check.upstream["stage"] == "best"
    assert check.evaluation["results"] == result[winner].manifest.evaluation["results"]
    # gates: recorded with their values; "from" read the source stage's values
    fast = result["fast"].manifest
    by_metric = {g["metric"]: g for g in fast.gates}
    assert by_metric["val/loss"]["passed"] and by_metric["val/loss"]["source"] == "stage pretrain"
    assert by_metric["val/loss"]["source_value"] == result["pretrain"].manifest.metrics.val_loss
    pretrain_acc = result["pretrain"].manifest.evaluation["results"]["stdlib_bodies"]["acc"]
    assert by_metric[ACC]["target"] == pytest.approx(pretrain_acc - 1.0)
    summary = json.loads((pipeline.dir / "report" / "summary.json").read_text())
    rows = {s["stage"]: s for s in summary["stages"]}
    assert rows["check"]["gates"][0]["passed"] and ACC in rows["pretrain"]["evaluation"]
    assert rows["best"]["promotion"]["winner"] == winner


def replanned(pipeline, tmp_path, changes: dict, **top):
    """The plan of the same pipeline folder with ``changes`` to its stages."""
    changed = spec(tmp_path, {**stages(), **changes})
    changed = dataclasses.replace(changed, dir=pipeline.dir, **top)
    return [(p.spec.name, p.action) for p in plan_pipeline(changed)]


def test_what_a_change_reruns_after_an_eval_stage(gated, shared_cache, monkeypatch, tmp_path):
    pipeline, _ = gated
    monkeypatch.setenv("RECIPES_CACHE", str(shared_cache))
    assert [a for _, a in replanned(pipeline, tmp_path, {})] == ["skip"] * 6
    # evaluated again with other settings: the weights it hands on are the same
    check = {**stages()["check"], "evaluate": {**EVALUATE, "limit": 6}}
    assert replanned(pipeline, tmp_path, {"check": check})[-2:] == [
        ("check", "evaluate"),
        ("after", "skip"),
    ]
    # a retrained first stage changes everything after it, through both decision stages
    pretrain = {**stages()["pretrain"], "optim": {"lr": 1e-3}}
    actions = replanned(pipeline, tmp_path, {"pretrain": pretrain}, on_change="rerun")
    assert [a for _, a in actions] == ["rerun"] * 3 + ["promote", "evaluate", "rerun"]
    # an eval stage whose source's weights changed under it is evaluated again, not refused
    manifest_file = pipeline.dir / "check" / "manifest.json"
    saved = manifest_file.read_text()
    stale = json.loads(saved)
    stale["weights"]["sha256"] = "f" * 64
    stale["config_sha256"] = "e" * 64
    manifest_file.write_text(json.dumps(stale))
    try:
        assert replanned(pipeline, tmp_path, {})[-2:] == [("check", "evaluate"), ("after", "skip")]
    finally:
        manifest_file.write_text(saved)


def test_a_rerun_decides_again_without_training(gated, shared_cache, monkeypatch, tmp_path):
    pipeline, _ = gated
    monkeypatch.setenv("RECIPES_CACHE", str(shared_cache))
    assert [p.action for p in plan_pipeline(pipeline)] == ["skip"] * 6
    # a gate the eval stage cannot meet: the pipeline stops with one line naming it,
    # after recording the outcome; nothing trains
    strict = dataclasses.replace(spec(tmp_path, stages(gate=">= 1.01")), dir=pipeline.dir)
    with pytest.raises(GateFailed) as err:
        run_pipeline(strict)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("stage check stopped the pipeline: gate eval/stdlib_bodies/acc")
    assert ">= 1.01" in message and "FAILED" in message
    recorded = read_manifest(pipeline.dir / "check").gates
    assert recorded[0]["passed"] is False
    assert [p.action for p in plan_pipeline(strict)][:3] == ["skip"] * 3
    assert not (pipeline.dir / "after").joinpath("manifest.json").read_text() == ""


def test_a_promote_stage_produces_what_every_candidate_does(tmp_path):
    best = {**stages()["best"], "gates": {"val/loss": "<= 20", ACC: ">= 0.0"}}
    after = {**stages()["after"], "from": "best", "gates": {"val/loss": "<= from + 1"}}
    plan_pipeline(spec(tmp_path, {**stages(), "best": best, "after": after}))  # accepted
    slow = {**stages()["slow"], "evaluate": None}
    with pytest.raises(ConfigError, match="its candidate slow does not produce it"):
        plan_pipeline(spec(tmp_path, {**stages(), "best": best, "slow": slow}))


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {
                "check": {
                    "kind": "eval",
                    "from": "best",
                    "evaluate": EVALUATE,
                    "gates": {"eval/stdlib_bodies/f1": ">= 0.1"},
                }
            },
            "stages.check.gates.eval/stdlib_bodies/f1: no such metric .* reports acc, acc_norm",
        ),
        (
            {
                "check": {
                    "kind": "eval",
                    "from": "best",
                    "evaluate": EVALUATE,
                    "gates": {"val/loss": "<= 3"},
                }
            },
            "eval stages train nothing",
        ),
        (
            {"slow": {"recipe": "pretrain/tiny", "from": "pretrain", "gates": {ACC: ">= from"}}},
            "stages.slow.gates.eval/stdlib_bodies/acc: no such metric from stage slow: it does "
            "not evaluate task 'stdlib_bodies'",
        ),
        (
            {
                "best": {"kind": "promote", "candidates": ["slow", "fast"], "by": ACC_NORM},
                "slow": {"recipe": "pretrain/tiny", "from": "pretrain"},
            },
            "stages.best.by=eval/stdlib_bodies/acc_norm: candidate stage slow produces no such",
        ),
        (
            {"check": {"kind": "eval", "from": "best", "evaluate": {"tasks": ["gone.jsonl"]}}},
            "stages.check.evaluate: choice task 'gone.jsonl': no such file",
        ),
        (
            {"check": {"kind": "eval", "from": "nowhere", "evaluate": EVALUATE}},
            "stages.check.from: 'nowhere' is not an earlier stage",
        ),
        (
            {"fast": {"recipe": "pretrain/tiny", "gates": {"val/loss": "about 3"}}},
            "stages.fast.gates.val/loss='about 3': a condition reads",
        ),
        (
            {"check": {"kind": "eval", "from": "best", "evaluate": EVALUATE, "recipe": "x"}},
            "stages.check.recipe: eval stages train nothing",
        ),
        (
            {"after": {"recipe": "pretrain/tiny", "from": "check", "init": "full"}},
            "stages.after.init=full continues a Lightning checkpoint, but stage check is an eval",
        ),
        (
            {
                "check": {
                    "kind": "eval",
                    "from": "best",
                    "evaluate": EVALUATE,
                    "gates": {ACC: ">= from"},
                }
            },
            "eval stages' gates compare with numbers",
        ),
        (
            {
                "after": {
                    "recipe": "pretrain/tiny",
                    "from": "check",
                    "gates": {"val/loss": "<= from"},
                }
            },
            "its source, stage check, produces no val/loss: eval stages train nothing",
        ),
        (
            {"best": {"kind": "promote", "candidates": ["slow", "fast"], "by": "eval/x"}},
            "stages.best.by: the metric the candidates are compared by",
        ),
        (
            {"check": {"kind": "eval", "from": "best", "evaluate": {"tasks": "stdlib_bodies"}}},
            "stages.check.evaluate.tasks must be a list",
        ),
    ],
)
def test_bad_decisions_are_refused_before_anything_trains(tmp_path, change, match):
    with pytest.raises(ConfigError, match=match):
        plan_pipeline(spec(tmp_path, {**stages(), **change}))
    assert not (tmp_path / "gated").exists()
