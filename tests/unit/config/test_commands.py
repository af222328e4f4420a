"""The single-job commands' command lines: text read back as written, lists from commas,
and one line for each bad override, all before Hydra composes."""

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from recipes_lib.config.commands import (
    COMMANDS,
    Dtype,
    EvalConfig,
    GenerateConfig,
    check_command_overrides,
    command_line,
    quoted,
    register_command_schemas,
    to_command_config,
)
from recipes_lib.config.store import compose_config
from recipes_lib.errors import ConfigError

TEXTS = [
    "def ",
    " a, b",
    "it's (x) [y] {z: 1}",
    'say "hi"',
    "${HOME} and \\${x} and $y",
    "back\\slash\\",
    "\\'",
    "null",
    "1e3",
    "two\nlines\t",
]


@pytest.mark.parametrize("text", TEXTS)
def test_quoted_text_reads_back_as_written(text):
    (override,) = OverridesParser.create().parse_overrides([f"prompt={quoted(text)}"])
    assert OmegaConf.create({"prompt": override.value()}).prompt == text


def test_command_line_quotes_text_and_brackets_lists():
    assert command_line(["prompt=a,b", "seed=1", "tokenizer=null"], GenerateConfig) == [
        "prompt='a,b'",
        "seed=1",
        "tokenizer=null",  # an optional text key still takes null
    ]
    assert command_line(["tasks=a, b/c.jsonl,", "task_dirs=[x]"], EvalConfig) == [
        "tasks=['a','b/c.jsonl']",
        "task_dirs=[x]",  # Hydra's own list syntax is left to Hydra
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("temprature=1", "temprature=1: no such key (did you mean temperature?)"),
        ("model=tiny", "model=tiny: no such key (the config takes: checkpoint, prompt"),
        ("seed=x", "seed=x: Value 'x' of type 'str' could not be converted to Integer"),
        ("dtype=int8", "dtype=int8: Invalid value 'int8', expected one of [auto, float32"),
        ("top_p=0.1,0.2", "top_p=0.1,0.2: a sweep; this command runs one job"),
        ("checkpoint", "checkpoint: not key=value"),
    ],
)
def test_a_bad_override_is_one_line(override, message):
    with pytest.raises(ConfigError) as caught:
        check_command_overrides(command_line([override], GenerateConfig), GenerateConfig)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_composes_typed_and_writes_nothing(name):
    register_command_schemas()
    cfg = compose_config(
        ["checkpoint=x", "out=y"] if name == "export" else ["checkpoint=x"],
        config_name=name,
        return_hydra_config=True,
    )
    assert cfg.hydra.run.dir == "." and cfg.hydra.output_subdir is None
    assert cfg.hydra.job_logging.root is None  # logging left as Python has it
    assert f"recipes-{name}" in cfg.hydra.help.template
    OmegaConf.set_struct(cfg, False)
    del cfg["hydra"]
    if name == "eval":
        with pytest.raises(ConfigError, match="tasks: required; pass tasks=NAME"):
            to_command_config(cfg, COMMANDS[name])
    else:
        typed = to_command_config(cfg, COMMANDS[name])
        assert isinstance(typed, COMMANDS[name]) and typed.dtype is Dtype.auto
