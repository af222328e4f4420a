"""Only the command line (or RECIPES_ALLOWED_TARGETS) widens what a run builds: a
recipe or pipeline file that sets run.allowed_targets is refused, naming the file."""

from __future__ import annotations

import pytest

from recipes_lib.config import compose_config
from recipes_lib.config.instantiate import CALLBACKS, instantiate
from recipes_lib.config.widening import ENV_VAR, widening_line
from recipes_lib.errors import ConfigError
from recipes_lib.pipeline import compose_pipeline
from recipes_lib.pipeline.spec import parse_pipeline


def _user_conf(tmp_path, group: str, name: str, body: str) -> str:
    """A user's config folder holding ``<group>/<name>.yaml``; its search path override."""
    folder = tmp_path / "user_conf" / group
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(body)
    return f"hydra.searchpath=[file://{tmp_path / 'user_conf'}]"


def test_a_recipe_cannot_widen_allowed_targets(tmp_path):
    search = _user_conf(
        tmp_path,
        "recipe",
        "mine",
        "# @package _global_\ndefaults:\n  - /recipe/pretrain/tiny\n"
        "run:\n  allowed_targets: [os.]\n",
    )
    refused = r"^run\.allowed_targets=\['os\.'\] is set by a config file \(recipe=mine\)"
    with pytest.raises(ConfigError, match=refused):
        compose_config([search, "recipe=mine"])
    # the same value given on the command line is the user's own choice
    cfg = compose_config([search, "recipe=mine", "run.allowed_targets=[os.]"])
    assert list(cfg.run.allowed_targets) == ["os."]


def test_the_override_list_widens_and_the_run_says_so():
    cfg = compose_config(["recipe=pretrain/tiny", "run.allowed_targets=[mypkg.callbacks.]"])
    assert list(cfg.run.allowed_targets) == ["mypkg.callbacks."]
    line = widening_line(cfg.run.allowed_targets)
    assert line is not None and line.endswith(": mypkg.callbacks.") and "\n" not in line


def test_the_environment_widens(monkeypatch):
    node = {"_target_": "collections.OrderedDict"}
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert widening_line([]) is None
    with pytest.raises(ConfigError, match="is not a callback"):
        instantiate(node, "callbacks.x", CALLBACKS)
    monkeypatch.setenv(ENV_VAR, "mypkg., collections.OrderedDict")
    assert type(instantiate(node, "callbacks.x", CALLBACKS)).__name__ == "OrderedDict"
    assert widening_line([]).endswith(": mypkg., collections.OrderedDict")
    monkeypatch.setenv(ENV_VAR, "mypkg.,.")
    with pytest.raises(ConfigError, match=rf"^{ENV_VAR}\[1\]='\.'"):
        instantiate(node, "callbacks.x", CALLBACKS)


def test_a_pipeline_file_cannot_widen_a_stage(tmp_path):
    search = _user_conf(
        tmp_path,
        "pipeline",
        "mine",
        "# @package _global_\nname: mine\nstages:\n  pretrain:\n    recipe: pretrain/tiny\n"
        "    run: {allowed_targets: [os.]}\n",
    )
    refused = r"^stages\.pretrain\.run\.allowed_targets=\['os\.'\] is set by a config file"
    with pytest.raises(ConfigError, match=refused + r" \(pipeline=mine\)"):
        compose_pipeline([search, "pipeline=mine"])
    widened = "stages.pretrain.run.allowed_targets=[os.]"
    assert compose_pipeline([search, "pipeline=mine", widened]).stages.pretrain.run


def test_a_pipeline_override_list_cannot_widen():
    stage = {"recipe": "pretrain/tiny"}
    shared = {"name": "p", "overrides": ["run.allowed_targets=[os.]"], "stages": {"a": stage}}
    with pytest.raises(ConfigError, match=r"^overrides\[0\]='run\.allowed_targets=\[os\.\]'"):
        parse_pipeline(shared)
    own = {**stage, "overrides": ["optim.lr=1e-3", "+run={allowed_targets: [os.]}"]}
    with pytest.raises(ConfigError, match=r"^stages\.a\.overrides\[1\]="):
        parse_pipeline({"name": "p", "stages": {"a": own}})
