"""``run.launch_check`` asks for the pre-launch check; the old ``run.preflight`` is refused
in one line naming it, from the command line and from a config file alike."""

import pytest
from omegaconf import OmegaConf

from recipes_lib.config import RunConfig, compose_config, to_run_config
from recipes_lib.config.overrides import check_overrides
from recipes_lib.errors import ConfigError


def test_the_old_key_on_the_command_line_names_the_new_one():
    with pytest.raises(ConfigError, match=r"^run\.preflight: moved to run\.launch_check$"):
        check_overrides(["run.preflight=true"], RunConfig)


def test_the_old_key_in_a_config_file_names_the_new_one():
    with pytest.raises(ConfigError, match=r"^run\.preflight: moved to run\.launch_check$"):
        to_run_config(OmegaConf.create({"run": {"preflight": True}}))


def test_the_new_key_composes():
    check_overrides(["run.launch_check=true"], RunConfig)
    cfg = compose_config(["recipe=pretrain/tiny", "run.launch_check=true"])
    assert cfg.run.launch_check is True
