"""Every ``_target_`` is checked against the kind its key builds, at any depth, before
anything is imported from outside it or built: nested arguments, list items, ``_args_``,
``_partial_`` nodes, runs and pipeline stages. A refused target never runs."""

from __future__ import annotations

import pytest
from tiny import SMALL_VOCAB_OVERRIDES

from recipes_lib.config import compose_config
from recipes_lib.config.instantiate import (
    CALLBACKS,
    LOGGERS,
    check_targets,
    instantiate,
    instantiate_dict,
)
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
    with pytest.raises(
        ConfigError, match=r"^callbacks\.x\._target_: 'os\.system' is not a callback"
    ):
        check_targets({"_target_": "os.system", "command": "true"}, "callbacks.x", CALLBACKS)


def test_depth_two_argument_of_an_allowed_callback_is_refused(victim):
    node = {"_target_": LAMBDA, "on_fit_start": _open_node(victim)}
    refused = r"callbacks\.x\.on_fit_start\._target_: 'builtins\.open'"
    with pytest.raises(ConfigError, match=refused):
        instantiate(node, "callbacks.x", CALLBACKS)
    assert victim.read_text() == "precious"


def test_depth_three_inside_args_of_a_partial_is_refused(tmp_path):
    made = tmp_path / "made"
    node = {
        "_target_": LAMBDA,
        "on_fit_start": {  # trusted by the run, so its own arguments are checked
            "_target_": "collections.OrderedDict",
            "_partial_": True,
            "_args_": [{"_target_": "os.makedirs", "name": str(made)}],
        },
    }
    with pytest.raises(
        ConfigError, match=r"callbacks\.x\.on_fit_start\._args_\[0\]\._target_: 'os\.makedirs'"
    ):
        instantiate_dict({"x": node}, "callbacks", CALLBACKS, ["collections.OrderedDict"])
    assert not made.exists()


def test_items_of_a_list_are_checked(victim):
    node = {"_target_": LAMBDA, "on_fit_start": [{"deep": [_open_node(victim)]}]}
    with pytest.raises(ConfigError, match=r"on_fit_start\[0\]\.deep\[0\]\._target_"):
        check_targets(node, "callbacks.x", CALLBACKS)


def test_a_trusted_module_cannot_hand_out_what_it_imported():
    # the path starts with a trusted prefix, but the function is Hydra's own
    # instantiate, imported there: it would build anything
    target = "recipes_lib.config.instantiate.hydra_instantiate"
    with pytest.raises(ConfigError, match=r"defined outside run\.allowed_targets"):
        check_targets({"_target_": target}, "callbacks.x", CALLBACKS, ["recipes_lib.config."])


def test_a_kind_module_cannot_hand_out_what_it_imported():
    # Lightning's Callback base class is imported into the project's callbacks too, but
    # a module imported there is not a callback
    with pytest.raises(ConfigError, match=r"'recipes_lib\.callbacks\.watchdog\.os' is not a"):
        check_targets({"_target_": "recipes_lib.callbacks.watchdog.os"}, "callbacks.x", CALLBACKS)


def test_every_node_is_checked_before_the_first_is_built(victim):
    nodes = {
        "fine": {"_target_": "lightning.pytorch.callbacks.ModelCheckpoint"},
        "bad": {"_target_": LAMBDA, "on_fit_start": _open_node(victim)},
    }
    with pytest.raises(ConfigError, match=r"callbacks\.bad\.on_fit_start"):
        instantiate_dict(nodes, "callbacks", CALLBACKS)


def test_a_nested_unknown_argument_is_named():
    node = {
        "_target_": LAMBDA,
        "on_fit_start": {"_target_": "recipes_lib.callbacks.GarbageCollection", "evry": 3},
    }
    with pytest.raises(ConfigError, match=r"callbacks\.x\.on_fit_start\.evry: not an argument"):
        check_targets(node, "callbacks.x", CALLBACKS, ["recipes_lib.callbacks."])


def test_a_callback_argument_built_from_config_is_refused():
    # even a callback of the project: nothing takes an object built from config
    node = {
        "_target_": LAMBDA,
        "on_fit_start": {"_target_": "recipes_lib.callbacks.GarbageCollection"},
    }
    with pytest.raises(
        ConfigError, match=r"^callbacks\.x\.on_fit_start\._target_: .*allowed_targets"
    ):
        check_targets(node, "callbacks.x", CALLBACKS)


def test_run_allowed_targets_extends_the_allowlist():
    node = {"_target_": "collections.OrderedDict"}
    with pytest.raises(ConfigError, match="is not a callback"):
        instantiate(node, "callbacks.x", CALLBACKS)
    built = instantiate(node, "callbacks.x", CALLBACKS, ["collections.OrderedDict"])
    assert type(built).__name__ == "OrderedDict"
    with pytest.raises(ConfigError, match=r"run\.allowed_targets\[0\]"):
        check_targets(node, "callbacks.x", CALLBACKS, [""])


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


def test_a_file_writer_of_the_project_is_not_a_callback(victim):
    node = {"_target_": "recipes_lib.files.write_text_atomic", "path": str(victim), "text": ""}
    refused = r"^callbacks\.x\._target_: 'recipes_lib\.files\.write_text_atomic' is not a callback"
    with pytest.raises(ConfigError, match=refused):
        instantiate_dict({"x": node}, "callbacks", CALLBACKS)
    assert victim.read_text() == "precious"


def test_a_reward_function_is_not_a_callback(victim):
    node = {
        "_target_": "recipes_lib.rewards.unit_tests",
        "completion": f"open({str(victim)!r}, 'w').close()",
        "record": {"tests": ""},
    }
    with pytest.raises(ConfigError, match=r"'recipes_lib\.rewards\.unit_tests' is not a callback"):
        instantiate(node, "callbacks.x", CALLBACKS)
    assert victim.read_text() == "precious"


def test_a_reward_function_is_not_built_inside_a_reward(victim):
    from recipes_lib.rewards import build_rewards

    runs = {
        "_target_": "recipes_lib.rewards.unit_tests",
        "completion": f"open({str(victim)!r}, 'w').close()",
        "record": {"tests": ""},
    }
    fn = {"_target_": "recipes_lib.rewards.exact_match", "field": runs}
    with pytest.raises(ConfigError, match=r"^grpo\.rewards\.x\.fn\.field\._target_"):
        build_rewards({"x": {"fn": fn}})
    assert victim.read_text() == "precious"


def test_a_callback_is_not_a_logger():
    node = {"_target_": "lightning.pytorch.callbacks.ModelCheckpoint"}
    with pytest.raises(ConfigError, match=r"^logger\.x\._target_: .* is not a logger"):
        check_targets(node, "logger.x", LOGGERS)


def test_a_target_where_nothing_is_built_is_refused():
    from recipes_lib.config import to_run_config
    from recipes_lib.preflight.targets import check_run_targets

    cfg = to_run_config(
        compose_config(["recipe=pretrain/tiny", "+optim.args.x={_target_: os.getcwd}"])
    )
    with pytest.raises(ConfigError, match=r"^optim\.args\.x\._target_: nothing is built"):
        check_run_targets(cfg)


def test_every_shipped_callback_logger_and_reward_is_accepted():
    from recipes_lib.config import list_group_options, to_run_config
    from recipes_lib.preflight.targets import check_run_targets

    overrides = [[f"callbacks={name}"] for name in list_group_options("callbacks")]
    overrides += [[f"logger={name}"] for name in list_group_options("logger")]
    overrides += [["recipe=grpo/tiny"], ["recipe=grpo/full", "model=tiny"]]
    for extra in overrides:
        check_run_targets(to_run_config(compose_config(["recipe=pretrain/tiny", *extra])))
