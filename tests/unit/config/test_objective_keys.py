"""Each objective's settings live under ``stage.<objective>``, typed by its spec's
dataclass; the root nodes they once had are refused in one line naming the new key. The
schema reads the built-in objectives' settings without their modules, so composing a
config and refusing a key import neither torch nor Lightning."""

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from recipes_lib.config import RunConfig, compose_config, to_run_config
from recipes_lib.config import objectives as schema_settings
from recipes_lib.config.overrides import check_overrides
from recipes_lib.errors import ConfigError
from recipes_lib.objectives import get_objective, objective_names
from recipes_lib.objectives.settings import DPOSettings


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("preference.beta=0.2", r"^preference\.beta: moved to stage\.dpo\.beta "),
        ("preference.gamma=1", r"^preference\.gamma: moved to stage\.simpo\.gamma$"),
        ("preference.loss=simpo", r"^preference\.loss=simpo: .*stage\.objective=simpo$"),
        ("grpo.kl_coef=0.1", r"^grpo\.kl_coef: moved to stage\.grpo\.kl_coef$"),
        (
            "distill.teacher_from=x",
            r"^distill\.teacher_from: moved to stage\.distill\.teacher_from$",
        ),
        ("stage.dpo.betaa=1", r"no such key \(did you mean stage\.dpo\.beta\?\)"),
    ],
)
def test_moved_and_misspelt_keys_on_the_command_line(override, line):
    with pytest.raises(ConfigError, match=line):
        check_overrides([override], RunConfig)


def test_a_moved_root_in_a_config_file_is_named():
    with pytest.raises(ConfigError, match=r"^reward: moved to stage\.reward$"):
        to_run_config(OmegaConf.create({"reward": {"center_coef": 0.1}}))


def test_settings_compose_typed_under_the_stage():
    cfg = to_run_config(compose_config(["recipe=dpo/tiny", "stage.dpo.beta=0.25"]))
    assert cfg.stage.dpo == DPOSettings(beta=0.25)
    with pytest.raises(Exception, match="stage.dpo.beta"):
        compose_config(["recipe=dpo/tiny", "stage.dpo.beta=warm"])


def test_the_schema_declares_the_settings_each_spec_names():
    declared = schema_settings.declared_settings()
    with_settings = {name: get_objective(name).settings for name in objective_names()}
    assert declared == {name: cls for name, cls in with_settings.items() if cls is not None}


def test_one_settings_class_under_two_names_is_refused(monkeypatch):
    monkeypatch.setattr(schema_settings, "_SETTINGS", dict(schema_settings.declared_settings()))
    already = r"^objective 'dpo2': DPOSettings is already stage\.dpo's settings$"
    with pytest.raises(ConfigError, match=already):
        schema_settings.declare_settings("dpo2", DPOSettings)


LIGHT = """
import sys
import recipes_lib.cli
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.overrides import check_command_line
from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError
for recipe in ("dpo/tiny", "kto/tiny", "grpo/tiny", "distill/tiny", "reward/tiny"):
    to_run_config(compose_config([f"recipe={recipe}"]))
try:
    check_command_line(["stage.dpo.betaa=1"], RunConfig)
except ConfigError:
    pass
else:
    raise SystemExit("stage.dpo.betaa was not refused")
print(sorted(m for m in ("torch", "lightning") if m in sys.modules))
"""


def test_composing_and_refusing_import_neither_torch_nor_lightning():
    proc = subprocess.run(
        [sys.executable, "-c", LIGHT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
