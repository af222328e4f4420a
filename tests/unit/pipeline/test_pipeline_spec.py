"""Pipeline configs: composition, stage parsing, defaults and bad keys."""

from __future__ import annotations

import pytest
from pipeline_helpers import make_pipeline

from recipes_lib.config import conf_dir
from recipes_lib.errors import ConfigError
from recipes_lib.pipeline import compose_pipeline, parse_pipeline, plan_pipeline
from recipes_lib.pipeline.compose import compose_stage


def shipped_pipelines() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "pipeline").glob("*.yaml"))


def test_demo_pipeline_parses_in_order_with_defaults():
    spec = parse_pipeline(compose_pipeline(["pipeline=demo"]))
    assert spec.name == "demo"
    assert spec.dir.as_posix().endswith("outputs/pipelines/demo")
    assert spec.on_change == "error"
    assert spec.stage_names() == ["pretrain", "anneal", "sft", "dpo", "release"]
    pretrain, anneal, sft, dpo, release = spec.stages
    assert (pretrain.recipe, pretrain.init, pretrain.source) == ("pretrain/tiny", "scratch", None)
    assert (anneal.recipe, anneal.init, anneal.source) == ("anneal/tiny", "weights", "pretrain")
    assert anneal.lr_from_previous and anneal.replay_fraction == 0.0
    assert (sft.recipe, sft.init, sft.source) == ("sft/tiny", "weights", "anneal")
    assert (dpo.recipe, dpo.init, dpo.source) == ("dpo/tiny", "weights", "sft")
    for stage in (sft, dpo):  # validated before their first step too
        callback = stage.settings["callbacks"]["validate_at_start"]
        assert callback["_target_"] == "recipes_lib.callbacks.ValidateAtStart"
    # every stage evaluated on the built-in task; the anneal and the release stage gated
    assert all(s.evaluate.tasks == ("stdlib_bodies",) for s in spec.stages)
    assert [g.metric for g in anneal.gates] == ["val/loss"] and anneal.gates[0].from_source
    assert (release.kind, release.source) == ("eval", "dpo")
    assert [(g.metric, g.threshold) for g in release.gates] == [("eval/stdlib_bodies/acc", 0.3)]


@pytest.mark.parametrize("name", shipped_pipelines())
def test_every_shipped_pipeline_validates(name, tmp_path):
    spec = parse_pipeline(compose_pipeline([f"pipeline={name}", f"dir={tmp_path / name}"]))
    plans = plan_pipeline(spec)  # composes every stage and checks every hand-off
    first_run = {"train": "train", "eval": "evaluate", "promote": "promote"}
    assert [p.action for p in plans] == [first_run[s.kind] for s in spec.stages]
    assert not (tmp_path / name).exists()  # planning writes nothing


def test_stage_keys_from_the_command_line_reach_the_stage_config(tmp_path):
    spec = parse_pipeline(
        compose_pipeline(
            ["pipeline=demo", "stages.anneal.optim.weight_decay=0.05", f"dir={tmp_path}"]
        )
    )
    anneal = spec.stages[1]
    # the command line's key beside the demo's own length for the stage
    assert anneal.settings == {"trainer": {"max_steps": 50}, "optim": {"weight_decay": 0.05}}
    cfg = compose_stage(spec, anneal)
    assert cfg.optim.weight_decay == 0.05
    assert cfg.scheduler.name == "linear"  # the recipe's own choices stay
    assert cfg.run.dir == str(tmp_path / "anneal")


def test_misspelt_stage_key_is_named_with_its_stage(tmp_path):
    spec = parse_pipeline(
        compose_pipeline(["pipeline=demo", "stages.anneal.optim.lrr=1e-4", f"dir={tmp_path}"])
    )
    with pytest.raises(ConfigError, match=r"stages\.anneal\.optim\.lrr"):
        plan_pipeline(spec)


def test_wrongly_typed_stage_value_is_named(tmp_path):
    spec = make_pipeline(tmp_path, {"pretrain": {"recipe": "pretrain/tiny", "optim": {"lr": "x"}}})
    with pytest.raises(ConfigError, match=r"stages\.pretrain\.optim\.lr"):
        plan_pipeline(spec)


def test_unknown_top_level_stage_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"stages\.anneal\.optimm"):
        make_pipeline(
            tmp_path,
            {"pretrain": {"recipe": "pretrain/tiny"}, "anneal": {"recipe": "x", "optimm": {}}},
        )


def test_misspelt_stage_name_on_the_command_line_is_reported(tmp_path):
    cfg = compose_pipeline(["pipeline=demo", "stages.aneal.optim.lr=1e-4", f"dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"stages\.aneal\.recipe is missing.*misspelt"):
        parse_pipeline(cfg)


def test_unknown_pipeline_key_fails_at_compose_time():
    with pytest.raises(Exception, match="on_chang"):
        compose_pipeline(["pipeline=demo", "on_chang=keep"])


@pytest.mark.parametrize(
    "stage,match",
    [
        ({"recipe": "pretrain/tiny", "init": "weightz"}, r"init='weightz' is not one of"),
        ({"recipe": "pretrain/tiny", "replay_fraction": 1.0}, r"replay_fraction=1.0"),
        ({"recipe": "pretrain/tiny", "lr_from_previous": "yes"}, r"lr_from_previous='yes'"),
        ({"recipe": "pretrain/tiny", "overrides": "optim.lr=1"}, r"overrides must be a list"),
    ],
)
def test_bad_stage_values_are_named(tmp_path, stage, match):
    with pytest.raises(ConfigError, match=match):
        make_pipeline(tmp_path, {"pretrain": {"recipe": "pretrain/tiny"}, "next": stage})


def test_scratch_stage_cannot_take_the_previous_learning_rate(tmp_path):
    with pytest.raises(ConfigError, match=r"stages\.pretrain\.lr_from_previous needs a stage"):
        make_pipeline(tmp_path, {"pretrain": {"recipe": "pretrain/tiny", "lr_from_previous": True}})


def test_reserved_stage_names_and_policies(tmp_path):
    with pytest.raises(ConfigError, match=r"stages\.report.*reserved"):
        make_pipeline(tmp_path, {"report": {"recipe": "pretrain/tiny"}})
    with pytest.raises(ConfigError, match=r"on_change='ignore'"):
        make_pipeline(tmp_path, {"a": {"recipe": "pretrain/tiny"}}, on_change="ignore")
    with pytest.raises(ConfigError, match="at least one stage"):
        make_pipeline(tmp_path, {})


def test_later_stage_defaults_to_weights_of_the_stage_before(tmp_path):
    spec = make_pipeline(
        tmp_path, {"a": {"recipe": "pretrain/tiny"}, "b": {"recipe": "anneal/tiny"}}
    )
    assert spec.stages[1].init == "weights" and spec.stages[1].source is None
    plans = plan_pipeline(spec)
    assert plans[1].source_stage == "a"
