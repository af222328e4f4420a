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


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=abc", "optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float"),
        ("trainer.max_steps=1.5", "trainer.max_steps=1.5: Value '1.5' of type 'float' could not"),
        ("trainer.max_steps=null", "trainer.max_steps=null: field 'max_steps' is not Optional"),
        ("run.launch_check=maybe", "run.launch_check=maybe: Value 'maybe' is not a valid bool"),
        ("optim.betas=[0.9,x]", "optim.betas=[0.9,x]: Value 'x' of type 'str' could not be"),
        ("stage.dpo.beta=hi", "stage.dpo.beta=hi: Value 'hi' of type 'str' could not be"),
        ("data.tokenizer={vocab_size:x}", "data.tokenizer={vocab_size:x}: Value 'x' of type"),
        ("optim.lr=1e-3,abc", "optim.lr=1e-3,abc: Value 'abc' of type 'str' could not be"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line(override, message):
    with pytest.raises(ConfigError) as caught:
        check_overrides([override], RunConfig)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=1e-3",
        "optim.lr='1e-3'",  # text a float converts from, as Hydra's merge takes it
        "optim.lr=${oc.env:LR}",  # an interpolation is resolved later
        "optim.fused=null",
        "data.tokenizer={path:x}",  # merged into the node, as Hydra merges it
        "data.sources.main.weight=abc",  # open keys: nothing declares a type
        "+optim.args.momentum=0.9",
        "optim.lr=range(1,3)",
    ],
)
def test_a_value_its_key_can_hold_passes(override):
    check_overrides([override], RunConfig)


def test_the_pipeline_schema_types_its_keys_too():
    with pytest.raises(ConfigError, match=r"^dry_run=abc: Value 'abc' is not a valid bool"):
        check_overrides(["dry_run=abc"], PipelineConfig)
