"""Everything wrong with a pipeline is found before any stage trains, naming the stage;
completed stages are recognised, and a changed one is reported with its changed keys."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from pipeline_helpers import (
    complete_without_training,
    fake_manifest,
    fake_weights,
    make_pipeline,
    tiny_model,
)

from recipes_lib.checkpoint.manifest import MANIFEST_NAME
from recipes_lib.config import SourceConfig
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.pipeline import parse_pipeline, plan_pipeline, run_pipeline
from recipes_lib.pipeline.compose import compose_stage
from recipes_lib.pipeline.handoff import (
    apply_handoff,
    handoff_from_manifest,
    replay_sources,
)

PRETRAIN = {"recipe": "pretrain/tiny"}
ANNEAL = {"recipe": "anneal/tiny", "lr_from_previous": True}


def _two_stage(tmp_path, anneal=None, **top):
    return make_pipeline(tmp_path, {"pretrain": dict(PRETRAIN), "anneal": anneal or ANNEAL}, **top)


def _fails_before_training(spec, error, match):
    with pytest.raises(error, match=match):
        run_pipeline(spec)
    assert not any(spec.dir.glob("*/logs")), "a stage trained before the error"


def test_unknown_recipe_is_named_with_its_stage(tmp_path):
    spec = _two_stage(tmp_path, {"recipe": "anneal/nope"})
    _fails_before_training(spec, ConfigError, r"stages\.anneal\.recipe='anneal/nope': no such")


@pytest.mark.parametrize(
    ("stage", "match"),
    [
        (
            {"recipe": "anneal/tny"},
            r"anneal\.recipe='anneal/tny': no such recipe \(did you mean anneal/tiny\?\)",
        ),
        (
            {**ANNEAL, "overrides": ["optim.lrr=1"]},
            r"stage anneal: optim\.lrr=1: no such key \(did you mean optim\.lr\?\)",
        ),
        (
            {**ANNEAL, "optim": {"lrr": 1}},
            r"stages\.anneal\.optim\.lrr: no such key \(did you mean optim\.lr\?\)",
        ),
    ],
)
def test_misspelt_stage_recipe_or_key_names_the_closest(tmp_path, stage, match):
    _fails_before_training(_two_stage(tmp_path, stage), ConfigError, match)


@pytest.mark.parametrize("init", ["weights", "weights+optimizer"])
def test_a_later_stage_fails_the_run_preflight_before_the_first_trains(tmp_path, init):
    # the source's weights and checkpoint are not written yet: the pre-flight runs on
    # the paths it will write
    anneal = {**ANNEAL, "init": init, "trainer": {"max_steps": -3}}
    _fails_before_training(
        _two_stage(tmp_path, anneal), ConfigError, "stage anneal: trainer.max_steps=-3"
    )


def test_unknown_or_later_source_stage(tmp_path):
    spec = _two_stage(tmp_path, {"recipe": "anneal/tiny", "from": "pretrian"})
    _fails_before_training(
        spec, ConfigError, r"stages\.anneal\.from='pretrian' is neither an earlier stage"
    )
    spec = make_pipeline(
        tmp_path,
        {
            "a": {"recipe": "pretrain/tiny"},
            "b": {"recipe": "anneal/tiny", "from": "c"},
            "c": {"recipe": "anneal/tiny"},
        },
    )
    _fails_before_training(spec, ConfigError, r"stages\.b\.from='c' is not an earlier stage")


def test_missing_init_source_file(tmp_path):
    missing = tmp_path / "elsewhere" / "manifest.json"
    spec = make_pipeline(tmp_path, {"cpt": {"recipe": "cpt/tiny", "from": str(missing)}})
    _fails_before_training(spec, ConfigError, rf"stages\.cpt\.from='{missing}'")


def test_first_stage_with_init_needs_a_source(tmp_path):
    spec = make_pipeline(tmp_path, {"cpt": {"recipe": "cpt/tiny", "init": "weights"}})
    _fails_before_training(spec, ConfigError, r"stages\.cpt\.init=weights: the first stage")


@pytest.mark.parametrize(
    "key,value", [("dim", 64), ("n_layers", 3), ("n_kv_heads", 4), ("ffn_dim", 256)]
)
def test_model_shapes_must_match_between_stages(tmp_path, key, value):
    spec = _two_stage(tmp_path, {**ANNEAL, "model": {key: value}})
    _fails_before_training(
        spec, ConfigError, rf"stage anneal: model\.{key}={value} vs .*stage pretrain"
    )


def test_vocabulary_must_match_between_stages(tmp_path):
    spec = make_pipeline(
        tmp_path,
        {"pretrain": dict(PRETRAIN), "anneal": {**ANNEAL, "overrides": ["model.vocab_size=1024"]}},
    )
    _fails_before_training(spec, ConfigError, r"stage anneal: model\.vocab_size=1024")


def test_context_extension_may_change_rope_and_length(tmp_path):
    spec = _two_stage(
        tmp_path,
        {**ANNEAL, "model": {"rope_theta": 5e5, "max_seq_len": 2048}, "data": {"seq_len": 512}},
    )
    plans = plan_pipeline(spec)
    assert plans[1].config.model.rope_theta == 5e5
    assert plans[1].config.data.seq_len == 512


def test_later_stage_cannot_bring_its_own_tokenizer(tmp_path):
    tokenizer = tmp_path / "other" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text('{"another": "tokenizer"}')
    spec = _two_stage(tmp_path, {**ANNEAL, "data": {"tokenizer": {"path": str(tokenizer)}}})
    # the source stage trains its own tokenizer: a different file cannot be it
    _fails_before_training(spec, ConfigError, r"stage anneal: .*trains its own.*reuse")

    # once the source has finished, its tokenizer is known: another file is refused...
    manifests = {}
    complete_without_training(spec, "pretrain", manifests)
    _fails_before_training(spec, ConfigError, r"stage anneal: .* is not the tokenizer of stage")
    # ...and the same file is accepted
    same = _two_stage(
        tmp_path,
        {**ANNEAL, "data": {"tokenizer": {"path": str(manifests["pretrain"].tokenizer_path)}}},
    )
    assert [p.action for p in plan_pipeline(same)] == ["skip", "train"]


def test_outside_sources_are_checked(tmp_path):
    model = tiny_model()
    small = fake_weights(tmp_path / "w" / "model.safetensors", tiny_model(dim=64))
    spec = make_pipeline(tmp_path, {"cpt": {"recipe": "cpt/tiny", "from": str(small.parent)}})
    _fails_before_training(spec, ConfigError, r"stage cpt: .* does not fit the stage's model")

    weights = fake_weights(tmp_path / "ok" / "model.safetensors", model)
    spec = make_pipeline(
        tmp_path, {"cpt": {"recipe": "cpt/tiny", "from": str(weights), "init": "full"}}
    )
    _fails_before_training(spec, ConfigError, r"stages\.cpt\.init=full .* holds weights only")
    # weights without a manifest name no tokenizer: the stage must name it
    spec = make_pipeline(tmp_path, {"cpt": {"recipe": "cpt/tiny", "from": str(weights)}})
    _fails_before_training(spec, ConfigError, r"set stages\.cpt\.data\.tokenizer\.path")

    # a manifest from elsewhere: verified, and its tokenizer reused
    fake_manifest(tmp_path / "outside", model=model)
    spec = make_pipeline(
        tmp_path, {"cpt": {"recipe": "cpt/tiny", "from": str(tmp_path / "outside")}}
    )
    (plan,) = plan_pipeline(spec)
    assert plan.source_file is not None and plan.source_file.manifest is not None
    cfg = apply_handoff(spec, spec.stages[0], plan.config, plan.source_file)
    assert cfg.data.tokenizer.path == str(tmp_path / "outside" / "tokenizer.json")
    assert cfg.stage.init_from == str(tmp_path / "outside" / "model.safetensors")
    (tmp_path / "outside" / "model.safetensors").write_bytes(b"corrupt")
    _fails_before_training(spec, CheckpointError, r"stage cpt .*checksum mismatch")


def test_full_init_needs_steps_left(tmp_path):
    spec = _two_stage(tmp_path, {"recipe": "pretrain/tiny", "init": "full"})
    _fails_before_training(spec, ConfigError, r"init=full continues the step count .* 300")
    spec = _two_stage(tmp_path, {"recipe": "anneal/tiny", "init": "full", "lr_from_previous": True})
    _fails_before_training(spec, ConfigError, r"lr_from_previous has no effect with init=full")


def test_previous_rate_of_zero_is_refused_before_training(tmp_path):
    spec = make_pipeline(
        tmp_path,
        {"a": {"recipe": "anneal/tiny"}, "b": {"recipe": "anneal/tiny", "lr_from_previous": True}},
    )
    _fails_before_training(spec, ConfigError, r"stages\.b\.lr_from_previous: stage a decays")


def test_runner_keys_cannot_be_set_by_a_stage(tmp_path):
    spec = _two_stage(tmp_path, {**ANNEAL, "stage": {"init_from": "/x.safetensors"}})
    _fails_before_training(spec, ConfigError, r"stages\.anneal\.stage\.init_from is set by")
    spec = _two_stage(tmp_path, {**ANNEAL, "overrides": ["run.dir=/tmp/x"]})
    _fails_before_training(spec, ConfigError, r"stages\.anneal\.run\.dir is set by")


def test_handoff_sets_init_tokenizer_and_previous_lr(tmp_path):
    spec = _two_stage(tmp_path)
    manifests = {}
    complete_without_training(spec, "pretrain", manifests)
    plans = plan_pipeline(spec)
    assert [p.action for p in plans] == ["skip", "train"]
    anneal = plans[1]
    handoff = handoff_from_manifest(manifests["pretrain"], "stage pretrain")
    cfg = apply_handoff(spec, anneal.spec, anneal.config, handoff)
    assert cfg.stage.init_from == str(spec.dir / "pretrain" / "model.safetensors")
    assert cfg.data.tokenizer.path == str(spec.dir / "pretrain" / "tokenizer.json")
    assert cfg.optim.lr == manifests["pretrain"].last_lr == 3e-4
    assert (cfg.scheduler.name, cfg.scheduler.warmup, cfg.scheduler.min_lr_ratio) == (
        "linear",
        0,
        0.0,
    )

    # an explicit optim.lr in the stage wins over lr_from_previous
    explicit = _two_stage(tmp_path, {**ANNEAL, "optim": {"lr": 1e-4}})
    stage = explicit.stages[1]
    cfg = apply_handoff(explicit, stage, compose_stage(explicit, stage), handoff)
    assert cfg.optim.lr == 1e-4


def test_replay_weights_make_the_requested_share():
    own = {"code": SourceConfig(builtin="stdlib", weight=3.0), "web": SourceConfig(hub="x")}
    previous = {"old": {"builtin": "stdlib", "weight": 2.0}, "other": {"hub": "y", "weight": 6.0}}
    spec = parse_pipeline({"name": "p", "stages": {"a": {"recipe": "cpt/tiny"}}}).stages[0]
    mixed = replay_sources(spec, own, previous, 0.2)
    total = sum(s.weight for s in mixed.values())
    replayed = mixed["replay_old"].weight + mixed["replay_other"].weight
    assert replayed / total == pytest.approx(0.2)
    assert mixed["replay_other"].weight == pytest.approx(3 * mixed["replay_old"].weight)
    assert mixed["code"].weight == 3.0 and mixed["replay_old"].builtin == "stdlib"


def test_completed_stages_are_skipped_and_changes_named(tmp_path):
    spec = _two_stage(tmp_path)
    manifests = {}
    complete_without_training(spec, "pretrain", manifests)
    complete_without_training(spec, "anneal", manifests)
    assert [p.action for p in plan_pipeline(spec)] == ["skip", "skip"]
    # the stage's folder is not part of its identity: a moved pipeline is still complete
    moved = spec.dir.with_name("moved")
    spec.dir.rename(moved)
    assert [p.action for p in plan_pipeline(replace(spec, dir=moved))] == ["skip", "skip"]
    moved.rename(spec.dir)

    changed = _two_stage(tmp_path, {**ANNEAL, "optim": {"weight_decay": 0.2}})
    with pytest.raises(ConfigError) as info:
        run_pipeline(changed)
    message = str(info.value)
    assert "stage anneal changed since it completed" in message
    assert "optim.weight_decay: 0.01 -> 0.2" in message
    assert "on_change=rerun" in message
    assert not any(spec.dir.glob("*/logs"))

    keep = _two_stage(tmp_path, {**ANNEAL, "optim": {"weight_decay": 0.2}}, on_change="keep")
    assert [p.action for p in plan_pipeline(keep)] == ["skip", "keep"]
    rerun = _two_stage(tmp_path, {**ANNEAL, "optim": {"weight_decay": 0.2}}, on_change="rerun")
    assert [p.action for p in plan_pipeline(rerun)] == ["skip", "rerun"]

    # a changed source: it trains again, so the stage after it is stale too
    upstream = make_pipeline(
        tmp_path,
        {"pretrain": {**PRETRAIN, "optim": {"lr": 1e-3}}, "anneal": ANNEAL},
        on_change="rerun",
    )
    plans = plan_pipeline(upstream)
    assert [p.action for p in plans] == ["rerun", "rerun"]
    assert "optim.lr: 0.003 -> 0.001" in plans[0].reason
    assert "source stage pretrain will be trained again" in plans[1].reason


def test_interrupted_stage_resumes_unless_changed(tmp_path):
    spec = _two_stage(tmp_path)
    complete_without_training(spec, "pretrain", {})
    checkpoints = spec.dir / "anneal" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.save({"global_step": 3}, checkpoints / "last.ckpt")
    plans = plan_pipeline(spec)
    assert plans[1].action == "resume"

    # the fingerprint written when it started no longer matches: on_change decides
    (spec.dir / "anneal" / "stage_fingerprint.json").write_text(
        json.dumps({"config": {"optim": {"lr": 1.0}}, "config_sha256": "0" * 64})
    )
    with pytest.raises(ConfigError, match=r"stage anneal changed since it started"):
        plan_pipeline(spec)
    assert (spec.dir / "pretrain" / MANIFEST_NAME).is_file()


def test_a_reward_model_starts_from_a_language_model_and_hands_on_only_to_reward_stages(
    tmp_path,
):
    """A reward stage takes a language model's body (its head starts fresh); a language
    model stage cannot start from a reward model's weights."""
    reward = {"recipe": "reward/tiny", "from": "pretrain", "init": "weights"}
    plans = plan_pipeline(make_pipeline(tmp_path, {"pretrain": dict(PRETRAIN), "reward": reward}))
    assert plans[1].config.model.head == "score"
    assert plans[1].config.stage.objective == "reward"
    spec = make_pipeline(
        tmp_path / "back",
        {
            "pretrain": dict(PRETRAIN),
            "reward": reward,
            "sft": {"recipe": "sft/tiny", "from": "reward", "init": "weights"},
        },
    )
    _fails_before_training(spec, ConfigError, r"stage sft: model\.head=lm vs score")
