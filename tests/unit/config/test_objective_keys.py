"""Each objective's settings live under ``stage.<objective>``, typed by its spec's
dataclass; the root nodes they once had are refused in one line naming the new key."""

import pytest
from omegaconf import OmegaConf

from recipes_lib.config import RunConfig, compose_config, to_run_config
from recipes_lib.config.overrides import check_overrides
from recipes_lib.errors import ConfigError
from recipes_lib.objectives.dpo import DPOSettings


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
