"""The console scripts behave as Hydra apps: --cfg job, -m multirun, shell completion, errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml
from integration_helpers import tiny_overrides
from tiny import SMALL_VOCAB_OVERRIDES


def _script(name: str) -> str:
    """A console script of the installed package (next to this interpreter, or on PATH)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else (shutil.which(name) or name)


TRAIN = _script("recipes-train")


def _run_cli(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(
        [TRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def test_cfg_job_prints_the_composed_config(tmp_path):
    proc = _run_cli("recipe=pretrain/tiny", "optim.lr=0.002", "--cfg", "job", cwd=tmp_path)
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["model"]["name"] == "tiny"
    assert cfg["optim"]["lr"] == 0.002
    assert not (tmp_path / "outputs").exists()  # printing trains nothing


def test_shell_completion_script_installs(tmp_path):
    proc = _run_cli("-sc", "install=bash", cwd=tmp_path)
    assert "complete" in proc.stdout and "recipes-train" in proc.stdout


def test_multirun_gives_each_job_its_own_folder(tmp_path, shared_cache):
    overrides = [
        o
        for o in tiny_overrides(tmp_path, shared_cache, "trainer.max_steps=4")
        if "max_steps=16" not in o
    ]
    _run_cli("-m", *overrides, "optim.lr=0.001,0.004", cwd=tmp_path)
    jobs = sorted((tmp_path / "run" / "multirun").iterdir())
    jobs = [j for j in jobs if j.is_dir()]
    assert len(jobs) == 2
    lrs = set()
    for job in jobs:
        assert (job / "checkpoints" / "last.ckpt").is_file()
        lrs.add(yaml.safe_load((job / "config.yaml").read_text())["optim"]["lr"])
    assert lrs == {0.001, 0.004}


def test_bad_input_exits_with_a_one_line_message(tmp_path, shared_cache):
    missing = tmp_path / "missing_dir"
    proc = _run_cli(
        *tiny_overrides(
            tmp_path, shared_cache, "data=local_text", f"data.sources.main.path={missing}"
        ),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    assert "error: " in proc.stderr and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_misspelt_recipe_or_key_names_the_closest_before_composing(tmp_path):
    for override, expected in [
        ("recipe=sft/ful", "error: recipe=sft/ful: no such recipe (did you mean sft/full?)"),
        ("optim.lrr=1", "error: optim.lrr=1: no such key (did you mean optim.lr?)"),
    ]:
        proc = _run_cli(override, cwd=tmp_path, check=False)
        assert proc.returncode == 2
        assert proc.stderr.strip() == expected
    pipeline = subprocess.run(
        [_script("recipes-pipeline"), "pipeline=demoo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pipeline.returncode == 2
    assert pipeline.stderr.strip() == "error: pipeline=demoo: no such pipeline (did you mean demo?)"


def test_a_value_of_the_wrong_type_is_one_line_before_anything_is_written(tmp_path):
    proc = _run_cli("recipe=pretrain/tiny", "optim.lr=abc", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float"
    )
    assert list(tmp_path.iterdir()) == []  # no outputs/ folder, no .hydra/ copy


def test_non_finite_learning_rate_exits_with_one_error_line(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    proc = _run_cli(
        "recipe=pretrain/tiny",
        f"run.dir={run_dir}",
        f"data.cache_dir={cache}",
        "optim.lr=nan",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: optim.lr=nan must be a finite number"]
    assert "Traceback" not in proc.stderr and not cache.exists()


def test_prepare_command_writes_shards(tmp_path):
    prepare = _script("recipes-prepare")
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [
            prepare,
            "recipe=pretrain/tiny",
            f"data.cache_dir={cache}",
            f"run.dir={tmp_path / 'run'}",
            "data.sources.stdlib.max_documents=40",
            *SMALL_VOCAB_OVERRIDES,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(cache.glob("shards/**/tokens.bin"))
    assert list(cache.glob("tokenizers/**/tokenizer.json"))


def _user_recipe(folder: Path, body: str) -> Path:
    """A user's own recipe in ``folder/recipe/mine.yaml``, for ``--config-dir``."""
    (folder / "recipe").mkdir(parents=True, exist_ok=True)
    (folder / "recipe" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - pretrain/tiny\n" + body
    )
    return folder


def test_user_recipe_with_a_nested_target_is_refused_before_it_runs(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    made = tmp_path / "made"
    user = _user_recipe(
        tmp_path / "user_conf",
        "callbacks:\n  x:\n    _target_: lightning.pytorch.callbacks.LambdaCallback\n"
        f"    on_fit_start: {{_target_: builtins.open, file: '{victim}', mode: w}}\n"
        f"    on_train_start: {{_target_: os.makedirs, name: '{made}'}}\n",
    )
    proc = _run_cli(
        "--config-dir",
        str(user),
        "recipe=mine",
        f"run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    assert "callbacks.x.on_fit_start._target_: 'builtins.open'" in errors[0]
    assert "run.allowed_targets" in errors[0]
    assert victim.read_text() == "precious" and not made.exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_user_callback_module_runs_once_its_prefix_is_allowed(tmp_path, shared_cache):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "callbacks.py").write_text(
        "from pathlib import Path\n"
        "import lightning as L\n\n"
        "class Marker(L.Callback):\n"
        "    def __init__(self, path: str):\n"
        "        self.path = Path(path)\n\n"
        "    def on_fit_start(self, trainer, pl_module):\n"
        "        self.path.write_text(str(trainer.max_steps))\n"
    )
    marker = tmp_path / "marker.txt"
    user = _user_recipe(
        tmp_path / "user_conf",
        f"callbacks:\n  marker: {{_target_: mypkg.callbacks.Marker, path: '{marker}'}}\n",
    )
    overrides = [o for o in tiny_overrides(tmp_path, shared_cache) if not o.startswith("recipe=")]
    env_path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    common = ["--config-dir", str(user), "recipe=mine", *overrides, "trainer.max_steps=6"]
    os.environ["PYTHONPATH"], saved = env_path, os.environ.get("PYTHONPATH")
    try:
        refused = _run_cli(*common, cwd=tmp_path, check=False)
        assert refused.returncode == 2 and "mypkg.callbacks.Marker" in refused.stderr
        _run_cli(*common, "run.allowed_targets=[mypkg.callbacks.]", cwd=tmp_path)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    assert marker.read_text() == "6"


def test_code_in_hydra_config_or_a_widening_recipe_is_refused_before_hydra_acts(tmp_path):
    victim, made = tmp_path / "victim.txt", tmp_path / "made"
    victim.write_text("precious")
    hydra_code = (
        f"hydra:\n  callbacks:\n    x: {{_target_: os.makedirs, name: '{made}'}}\n"
        "  job_logging:\n    formatters:\n      evil:\n        (): builtins.open\n"
        f"        file: '{victim}'\n        mode: w\n"
    )
    commands = {
        "hydra.callbacks.x: ": [
            TRAIN,
            "--config-dir",
            str(_user_recipe(tmp_path / "a", hydra_code)),
        ],
        "run.allowed_targets=['os.'] is set by a config file (recipe=mine)": [
            TRAIN,
            "--config-dir",
            str(_user_recipe(tmp_path / "b", "run: {allowed_targets: [os.]}\n")),
        ],
        "hydra.callbacks.y: ": [
            _script("recipes-pipeline"),
            "+hydra.callbacks.y._target_=os.makedirs",
            f"+hydra.callbacks.y.name={made}",
        ],
    }
    for message, command in commands.items():
        recipe = ["recipe=mine"] if "--config-dir" in command else []
        proc = subprocess.run(
            [*command, *recipe, f"run.dir={tmp_path / 'run'}" if recipe else f"dir={tmp_path}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
        assert errors[0].startswith(f"error: {message}")
    assert victim.read_text() == "precious" and not made.exists()
    assert not (tmp_path / "run").exists()


def test_console_shows_each_line_once_and_no_library_noise(tmp_path, shared_cache, monkeypatch):
    """What a user sees of a run (progress line, model summary, Lightning's records),
    piped: every line once, no advertisement, no epoch counter, no library warnings."""
    for name in ("RECIPES_VERBOSE", "PYTHONWARNINGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "80")  # the console width off a terminal
    replaced = ("trainer.max_steps=", "trainer.enable_", "callbacks=", "trainer.val_check_")
    overrides = [o for o in tiny_overrides(tmp_path, shared_cache) if not o.startswith(replaced)]
    proc = _run_cli(
        *overrides,
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "callbacks=default",
        "~callbacks.checkpoint",  # Lightning's default checkpoint: its litmodels tip
        cwd=tmp_path,
    )
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    assert not [line for line, n in Counter(lines).items() if n > 1], output
    for noise in ("litlogger", "litmodels", "Tip:", "Epoch", "v_num", "Total FLOPs"):
        assert noise not in output, (noise, output)
    assert "Warning" not in output and "deprecated" not in output.lower(), output
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == [f"step {s}/6" for s in range(1, 7)]
    assert all(len(line) <= 80 and "loss " in line for line in steps), steps
    assert "GPU available" in output  # Lightning's own records still show, once
    assert any("FLOPs per token" in line for line in lines)  # the summary line instead
    log_file = (tmp_path / "run" / "cli.log").read_text()
    assert "GPU available" in log_file and "finished at step 6" in log_file
