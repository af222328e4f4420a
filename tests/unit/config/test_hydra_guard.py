"""What of Hydra's own config would run code is refused, naming the key, before Hydra
acts on it: callbacks other than the shipped one, logging factories and classes that are
not logging's, imports through ext://, log files elsewhere; the shipped choices pass."""

from __future__ import annotations

import pytest

from recipes_lib.cli import CONFIG_PATH, _pipeline, _train
from recipes_lib.config.hydra_guard import check_hydra_app
from recipes_lib.errors import ConfigError


def _check(*argv: str, pipeline: bool = False) -> None:
    task, name = (_pipeline, "pipeline_root") if pipeline else (_train, "config")
    check_hydra_app(task, CONFIG_PATH, name, list(argv))


def _user_recipe(tmp_path, hydra_node: str) -> list[str]:
    """A recipe of the user's own setting ``hydra``; the arguments that choose it."""
    folder = tmp_path / "user_conf" / "recipe"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /recipe/pretrain/tiny\nhydra:\n" + hydra_node
    )
    return ["--config-dir", str(tmp_path / "user_conf"), "recipe=mine"]


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


def test_a_callback_added_on_the_command_line_is_refused(tmp_path):
    made = tmp_path / "made"
    adds = ["+hydra.callbacks.x._target_=os.makedirs", f"+hydra.callbacks.x.name={made}"]
    with pytest.raises(ConfigError, match=r"^hydra\.callbacks\.x: Hydra runs only the shipped"):
        _check("recipe=pretrain/tiny", *adds)
    with pytest.raises(ConfigError, match=r"^hydra\.callbacks\.x: "):
        _check("pipeline=demo", *adds, pipeline=True)
    with pytest.raises(ConfigError, match=r"^hydra\.callbacks\.sweep_check: "):
        _check("hydra.callbacks.sweep_check._target_=os.getcwd")
    assert not made.exists()


def test_a_callback_in_a_recipe_is_refused(tmp_path):
    node = f"  callbacks:\n    x: {{_target_: os.makedirs, name: '{tmp_path / 'made'}'}}\n"
    with pytest.raises(ConfigError, match=r"^hydra\.callbacks\.x: "):
        _check(*_user_recipe(tmp_path, node))


@pytest.mark.parametrize("logging_key", ["job_logging", "hydra_logging"])
def test_a_logging_factory_in_a_recipe_is_refused(tmp_path, victim, logging_key):
    node = (
        f"  {logging_key}:\n    formatters:\n      evil:\n        (): builtins.open\n"
        f"        file: '{victim}'\n        mode: w\n"
    )
    refused = rf"^hydra\.{logging_key}\.formatters\.evil\.\(\): 'builtins\.open' is not a factory"
    with pytest.raises(ConfigError, match=refused):
        _check(*_user_recipe(tmp_path, node))
    assert victim.read_text() == "precious"


def test_a_logging_class_that_is_not_logging_is_refused():
    # dictConfig calls a handler's class with the handler's keys: logging.config's own
    # functions would read more configuration (fileConfig evaluates it)
    for target in ("logging.config.dictConfig", "os.system", "builtins.open"):
        with pytest.raises(ConfigError, match=r"^hydra\.job_logging\.handlers\.x\.class: "):
            _check("recipe=pretrain/tiny", f"+hydra.job_logging.handlers.x={{class: {target}}}")


def test_an_import_through_ext_and_a_log_file_elsewhere_are_refused(victim):
    with pytest.raises(ConfigError, match=r"^hydra\.hydra_logging\.handlers\.console\.stream: "):
        _check("hydra.hydra_logging.handlers.console.stream=ext://antigravity")
    with pytest.raises(ConfigError, match=r"^hydra\.job_logging\.handlers\.file\.filename: "):
        _check(f"hydra.job_logging.handlers.file.filename={victim}")
    with pytest.raises(ConfigError, match=r"^hydra\.job_logging\.handlers\.file\.mode: 'w'"):
        _check("+hydra.job_logging.handlers.file.mode=w")


def test_a_swept_recipe_is_composed_and_refused(tmp_path):
    config_dir, path, _ = _user_recipe(tmp_path, "  callbacks:\n    x: {_target_: os.getcwd}\n")
    with pytest.raises(ConfigError, match=r"^hydra\.callbacks\.x: "):
        _check(config_dir, path, "-m", "recipe=pretrain/tiny,mine")


def test_a_recipe_widening_allowed_targets_is_refused_before_hydra_runs(tmp_path):
    folder = tmp_path / "user_conf" / "recipe"
    folder.mkdir(parents=True)
    (folder / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /recipe/pretrain/tiny\nrun: {allowed_targets: [os.]}\n"
    )
    argv = ["--config-dir", str(tmp_path / "user_conf"), "recipe=mine"]
    with pytest.raises(ConfigError, match=r"^run\.allowed_targets=.* \(recipe=mine\)"):
        _check(*argv)
    _check(*argv, "run.allowed_targets=[os.]")  # the command line's own choice


def test_a_pickled_config_is_refused():
    with pytest.raises(ConfigError, match=r"^--experimental-rerun: "):
        _check("--experimental-rerun", "config.pickle")


@pytest.mark.parametrize(
    "argv",
    [
        ["recipe=pretrain/tiny"],
        ["recipe=pretrain/tiny", "--cfg", "job"],
        ["--help"],
        ["-m", "recipe=pretrain/tiny,sft/tiny", "optim.lr=1e-3,1e-4"],
        ["hydra/job_logging=default", "hydra/hydra_logging=disabled"],
        ["hydra/job_logging=stdout", "hydra.job_logging.root.level=WARNING"],
        ["hydra/job_logging=disabled", "hydra.output_subdir=null"],  # ranks other than 0
        ["hydra.job_logging.formatters.detailed.format='%(message)s'"],
        ["~hydra.callbacks.sweep_check"],
    ],
)
def test_the_shipped_choices_pass(argv):
    _check(*argv)


def test_the_pipeline_passes():
    _check("pipeline=demo", "stages.pretrain.run.allowed_targets=[mypkg.]", pipeline=True)
