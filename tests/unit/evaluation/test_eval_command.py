"""``recipes-eval``: a table and JSON from a checkpoint; one line for each bad input, and
tasks checked before any weight is read."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from tiny import tiny_model_config

from recipes_lib.checkpoint.weights import save_weights
from recipes_lib.cli import eval_command as main
from recipes_lib.config.schema import RunConfig
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer
from recipes_lib.models import Transformer


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    """A native run folder: weights, the run's config.yaml and its tokenizer."""
    folder = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    config = tiny_model_config(vocab_size=512, dim=32, max_seq_len=512)
    model = Transformer(config, "sdpa")
    save_weights(model.state_dict(), folder / "model.safetensors")
    texts = [r["response"] for r in stdlib_instruction_records(60)]
    save_tokenizer(train_bpe_tokenizer(texts, 500, "<|endoftext|>"), folder / "tokenizer.json")
    run_config = RunConfig(model=config)
    OmegaConf.save(OmegaConf.structured(run_config), folder / "config.yaml")
    return folder


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_evaluates_a_native_run_and_writes_json(native_run, tmp_path, capsys):
    output = tmp_path / "results.json"
    code, out, err = run(
        capsys,
        f"checkpoint={native_run}",
        "tasks=stdlib_bodies",
        "limit=8",
        "batch_size=16",
        f"output={output}",
    )
    assert code == 0, err
    assert "stdlib_bodies" in out and "acc_norm" in out
    saved = json.loads(output.read_text())
    assert saved["checkpoint"] == str(native_run)
    assert saved["examples"] == {"stdlib_bodies": 8}
    assert set(saved["results"]["stdlib_bodies"]) == {"acc", "acc_norm"}


def one_line_error(capsys, *args) -> str:
    code, out, err = run(capsys, *args)
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_bad_arguments_are_one_line(native_run, capsys):
    assert one_line_error(capsys, "tasks=stdlib_bodies") == (
        "error: checkpoint: required; pass checkpoint=PATH"
    )
    line = one_line_error(capsys, f"checkpoint={native_run}")
    assert line == "error: tasks: required; pass tasks=NAME[,NAME...]"
    line = one_line_error(capsys, "task=x", "checkpoint=y")
    assert line == "error: task=x: no such key (did you mean tasks?)"
    line = one_line_error(capsys, "checkpoint=y", "tasks=a", "limit=many")
    assert line.startswith("error: limit=many: Value 'many' of type 'str' could not be converted")
    assert one_line_error(capsys, "checkpoint=y", "tasks=a", "limit=0").startswith(
        "error: limit=0 must be at least 1"
    )
    assert "chat_template=maybe: " in one_line_error(
        capsys, "checkpoint=y", "tasks=a", "chat_template=maybe"
    )


def test_task_lists_take_commas_or_brackets(native_run, tmp_path, capsys, monkeypatch):
    choices = tmp_path / "choices.jsonl"
    choices.write_text('{"context": "x", "choices": [" a", " b"], "answer": 0}\n')
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for tasks in (f"tasks=stdlib_bodies,{choices}", f"tasks=[stdlib_bodies,'{choices}']"):
        code, out, err = run(capsys, f"checkpoint={native_run}", tasks, "limit=2")
        assert code == 0, err
        # the table's title (rich centres it and may wrap a long path)
        assert out.split()[:3] == ["evaluation", "of", str(native_run)]
        assert "stdlib_bodies" in out and "choices" in out
    assert list(work.iterdir()) == []  # no outputs/, no .hydra/, no log file


def test_a_bad_task_is_named_before_the_checkpoint_is_read(tmp_path, capsys):
    line = one_line_error(capsys, f"checkpoint={tmp_path / 'missing'}", "tasks=stdlib_bodys")
    assert "task 'stdlib_bodys' is not a built-in task" in line
    assert "did you mean stdlib_bodies" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "choices": ["a", "b"], "answer": 0}\n{"context": 1}\n')
    line = one_line_error(capsys, f"checkpoint={tmp_path / 'missing'}", f"tasks={bad}")
    assert f"{bad}:2:" in line
    line = one_line_error(capsys, f"checkpoint={tmp_path / 'missing'}", "tasks=stdlib_bodies")
    assert "no such file or folder" in line


def test_a_checkpoint_without_its_tokenizer_is_named(native_run, tmp_path, capsys):
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("model.safetensors", "config.yaml"):
        (folder / name).write_bytes((native_run / name).read_bytes())
    line = one_line_error(capsys, f"checkpoint={folder}", "tasks=stdlib_bodies")
    assert "no tokenizer found" in line and str(folder) in line


def test_help_prints_the_keys_their_defaults_and_an_example(capsys):
    code, out, err = run(capsys, "--help")
    assert code == 0 and not err
    assert "tasks: ???" in out and "batch_size: 256" in out
    assert "recipes-eval checkpoint=" in out
