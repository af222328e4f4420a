"""Every ``_target_`` is checked against the allowlist at any depth, before anything is
imported from outside it or built: nested arguments, list items, ``_args_``,
``_partial_`` nodes, runs and pipeline stages. A refused target never runs."""

from __future__ import annotations

import pytest
from tiny import SMALL_VOCAB_OVERRIDES

from recipes_lib.config import compose_config
from recipes_lib.config.instantiate import check_targets, instantiate, instantiate_dict
from recipes_lib.errors import ConfigError
from recipes_lib.pipeline.plan import plan_pipeline
from recipes_lib.pipeline.spec import parse_pipeline
from recipes_lib.train import run

LAMBDA = "lightning.pytorch.callbacks.LambdaCallback"


def _pipeline(tmp_path, stages: dict):
    overrides = list(SMALL_VOCAB_OVERRIDES)
    return parse_pipeline(
        {"name": "p", "dir": str(tmp_path / "pipe"), "overrides": overrides, "stages": stages}
    )


def _open_node(path) -> dict:
    return {"_target_": "builtins.open", "file": str(path), "mode": "w"}


@pytest.fixture
def victim(tmp_path):
    """A file an ``open(..., 'w')`` would empty."""
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


def test_depth_one_is_refused_with_its_key():
    with pytest.raises(ConfigError, match=r"^callbacks\.x\._target_: 'os\.system' is outside"):
        check_targets({"_target_": "os.system", "command": "true"}, "callbacks.x")


def test_depth_two_argument_of_an_allowed_callback_is_refused(victim):
    node = {"_target_": LAMBDA, "on_fit_start": _open_node(victim)}
    refused = r"callbacks\.x\.on_fit_start\._target_: 'builtins\.open'"
    with pytest.raises(ConfigError, match=refused):
        instantiate(node, "callbacks.x")
    assert victim.read_text() == "precious"


def test_depth_three_inside_args_of_a_partial_is_refused(tmp_path):
    made = tmp_path / "made"
    node = {
        "_target_": LAMBDA,
        "on_fit_start": {
            "_target_": "recipes_lib.callbacks.ThroughputMonitor",
            "_partial_": True,
            "_args_": [{"_target_": "os.makedirs", "name": str(made)}],
        },
    }
    with pytest.raises(
        ConfigError, match=r"callbacks\.x\.on_fit_start\._args_\[0\]\._target_: 'os\.makedirs'"
    ):
        instantiate_dict({"x": node}, "callbacks")
    assert not made.exists()


def test_items_of_a_list_are_checked(victim):
    node = {"_target_": LAMBDA, "on_fit_start": [{"deep": [_open_node(victim)]}]}
    with pytest.raises(ConfigError, match=r"on_fit_start\[0\]\.deep\[0\]\._target_"):
        check_targets(node, "callbacks.x")


def test_an_allowed_module_cannot_hand_out_what_it_imported():
    # the path starts with an allowed prefix, but the function is Hydra's own
    # instantiate, imported there: it would build anything
    target = "recipes_lib.config.instantiate.hydra_instantiate"
    with pytest.raises(ConfigError, match=r"defined outside the allowed prefixes"):
        check_targets({"_target_": target}, "callbacks.x")


def test_every_node_is_checked_before_the_first_is_built(victim):
    nodes = {
        "fine": {"_target_": "lightning.pytorch.callbacks.ModelCheckpoint"},
        "bad": {"_target_": LAMBDA, "on_fit_start": _open_node(victim)},
    }
    with pytest.raises(ConfigError, match=r"callbacks\.bad\.on_fit_start"):
        instantiate_dict(nodes, "callbacks")


def test_a_nested_unknown_argument_is_named():
    node = {
        "_target_": LAMBDA,
        "on_fit_start": {"_target_": "recipes_lib.callbacks.GarbageCollection", "evry": 3},
    }
    with pytest.raises(ConfigError, match=r"callbacks\.x\.on_fit_start\.evry: not an argument"):
        check_targets(node, "callbacks.x")


def test_run_allowed_targets_extends_the_allowlist():
    node = {"_target_": "collections.OrderedDict"}
    with pytest.raises(ConfigError, match="outside the allowed prefixes"):
        instantiate(node, "callbacks.x")
    built = instantiate(node, "callbacks.x", ["collections.OrderedDict"])
    assert type(built).__name__ == "OrderedDict"
    with pytest.raises(ConfigError, match=r"run\.allowed_targets\[0\]"):
        check_targets(node, "callbacks.x", [""])


def test_a_run_refuses_a_nested_target_before_any_side_effect(tmp_path, victim):
    cfg = compose_config(
        [
            "recipe=pretrain/tiny",
            f"run.dir={tmp_path / 'run'}",
            f"+callbacks.x={{_target_: {LAMBDA}, on_fit_start: "
            f"{{_target_: builtins.open, file: '{victim}', mode: w}}}}",
        ]
    )
    with pytest.raises(ConfigError, match=r"^callbacks\.x\.on_fit_start\._target_: 'builtins"):
        run(cfg)
    assert victim.read_text() == "precious"
    assert not (tmp_path / "run").exists()  # nothing written, no data prepared


def test_a_pipeline_stage_key_is_refused_while_planning(tmp_path, victim):
    stage_cb = {"x": {"_target_": LAMBDA, "on_fit_start": _open_node(victim)}}
    pipeline = _pipeline(
        tmp_path,
        {
            "pretrain": {"recipe": "pretrain/tiny"},
            "anneal": {"recipe": "anneal/tiny", "callbacks": stage_cb},
        },
    )
    with pytest.raises(ConfigError, match=r"^stages\.anneal\.callbacks\.x\.on_fit_start\._target_"):
        plan_pipeline(pipeline)
    assert victim.read_text() == "precious"


def test_a_pipeline_override_is_refused_while_planning(tmp_path, victim):
    override = (
        f"+callbacks.x={{_target_: {LAMBDA}, on_fit_start: "
        f"{{_target_: os.makedirs, name: '{tmp_path / 'made'}'}}}}"
    )
    pipeline = _pipeline(
        tmp_path, {"pretrain": {"recipe": "pretrain/tiny", "overrides": [override]}}
    )
    with pytest.raises(ConfigError, match=r"^stages\.pretrain\.callbacks\.x\.on_fit_start"):
        plan_pipeline(pipeline)
    assert not (tmp_path / "made").exists()
