"""A misspelt group option or key is refused before composition, naming the closest."""

from __future__ import annotations

import pytest

from recipes_lib.config.overrides import check_command_line, check_overrides
from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError
from recipes_lib.pipeline.spec import PipelineConfig


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("recipe=sft/ful", "recipe=sft/ful: no such recipe (did you mean sft/full?)"),
        ("model=llama1b", "model=llama1b: no such model (did you mean llama_1b?)"),
        ("strategy=fsd", "strategy=fsd: no such strategy (did you mean fsdp?)"),
        ("optim.lrr=1", "optim.lrr=1: no such key (did you mean optim.lr?)"),
        ("+optim.lrr=1", "+optim.lrr=1: no such key (did you mean optim.lr?)"),
        ("optm.lr=1", "optm.lr=1: no such key (did you mean optim.lr?)"),
        ("model=tiny,llama1b", "model=tiny,llama1b: no such model (did you mean llama_1b?)"),
    ],
)
def test_misspelt_overrides_name_the_closest(override, message):
    with pytest.raises(ConfigError) as caught:
        check_overrides([override], RunConfig)
    assert str(caught.value) == message


def test_misspelt_pipeline_name_and_key():
    with pytest.raises(ConfigError, match=r"pipeline=demoo: no such pipeline \(did you mean demo"):
        check_overrides(["pipeline=demoo"], PipelineConfig)
    with pytest.raises(ConfigError, match=r"dry_runn=true: no such key \(did you mean dry_run"):
        check_overrides(["dry_runn=true"], PipelineConfig)


@pytest.mark.parametrize(
    "argv",
    [
        ["recipe=sft/full", "optim.lr=1e-4", "model=tiny,llama_1b", "-m", "recipe=null"],
        ["data.sources.main.path=x", "callbacks.mine._target_=a.B", "+logger.x.y=1"],
        ["hydra/launcher=anything", "hydra.run.dir=x", "~stage.init_from"],
        ["-sc", "install=bash"],
        ["--config-path", "elsewhere", "recipe=mine"],
    ],
)
def test_valid_or_foreign_overrides_are_left_to_hydra(argv):
    check_command_line(argv, RunConfig)


def test_a_config_dir_adds_its_own_recipes(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\n")
    check_command_line(["--config-dir", str(tmp_path), "recipe=mine"], RunConfig)
    with pytest.raises(ConfigError, match=r"did you mean mine\?"):
        check_command_line(["--config-dir", str(tmp_path), "recipe=mien"], RunConfig)


def test_a_list_of_group_options_is_checked_option_by_option():
    check_overrides(["logger=[csv,mlflow]"], RunConfig)
    with pytest.raises(ConfigError, match=r"logger=\[csv,mlflw\]: no such logger .*mlflow"):
        check_overrides(["logger=[csv,mlflw]"], RunConfig)
