"""The on-ramp: a Hugging Face folder and a data file, and nothing else.

``recipes-train recipe=sft/full stage.init_from=DIR data.path=chat.jsonl`` (and
``sft/lora``, ``dpo/full``, ``dpo/lora``, ``kto/full``, ``reward/full``; ``trainer=cpu``
here) takes the model's shape, tokenizer and chat template from the folder, reads the
user's records, and refuses a bad record with its file and line. The runs here are a few
steps long: the on-ramp is what is tested, not learning (the stage tests show that).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_folders import (
    TEMPLATE,
    make_hf_folder,
    write_chat_records,
    write_preference_records,
    write_unpaired_records,
)
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.checkpoint.source import fill_model_from_init
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.chat.template import CHATML_TEMPLATE
from recipes_lib.errors import ConfigError, DataError
from recipes_lib.pipeline import parse_pipeline, run_pipeline
from recipes_lib.train import run

transformers = pytest.importorskip("transformers")
SHORT = ["trainer=cpu", "trainer.max_steps=2", "scheduler.warmup=1", "trainer.val_check_interval=2"]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("records")
    return {
        "chat": write_chat_records(folder / "chat.jsonl"),
        "pairs": write_preference_records(folder / "pairs.jsonl"),
        "examples": write_unpaired_records(folder / "examples.jsonl"),
    }


def _run(tmp_path, *overrides: str):
    return run(
        compose_config([*overrides, *SHORT, *QUIET_OVERRIDES, f"run.dir={tmp_path / 'run'}"])
    )


@pytest.mark.parametrize(
    "recipe,data",
    [
        ("sft/full", "chat"),
        ("sft/lora", "chat"),
        ("dpo/full", "pairs"),
        ("kto/full", "examples"),
        ("reward/full", "pairs"),
    ],
)
def test_a_folder_and_a_data_file_are_enough(tmp_path, hf_folder, records, recipe, data):
    result = _run(
        tmp_path, f"recipe={recipe}", f"stage.init_from={hf_folder}", f"data.path={records[data]}"
    )
    assert result.global_step == 2 and result.weights_path.is_file()
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "dim: 64" in config and "qkv_bias: true" in config  # the folder's qwen2 shape
    assert result.tokenizer_path == (hf_folder / "tokenizer.json").resolve()
    # rendered with the folder's own chat template, which the output carries on
    out_config = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert out_config["chat_template"] == TEMPLATE
    # started from a Hugging Face folder: the output is one too, checked against transformers
    assert result.hf_path == tmp_path / "run" / "hf" and (result.hf_path / "config.json").is_file()


def _readme_commands() -> list[list[str]]:
    """The on-ramp commands of the README, as argument lists."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"<!-- onramp-commands -->\s*```bash\n(.+?)\n```", text, re.S)
    assert block, "README has no onramp-commands block"
    return [shlex.split(line.split("#")[0]) for line in block[1].splitlines() if line.strip()]


def test_the_readme_commands_run_as_written(tmp_path, hf_folder, records):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(Path(json.__file__).read_text())
    values = {"DIR": str(hf_folder), "chat.jsonl": str(records["chat"])}
    values |= {"pairs.jsonl": str(records["pairs"]), "corpus/": str(corpus)}
    commands = _readme_commands()
    assert {c[1] for c in commands} >= {
        f"recipe={r}" for r in ("sft/full", "sft/lora", "dpo/full", "dpo/lora")
    }
    script = Path(sys.executable).parent / "recipes-train"
    for number, argv in enumerate(commands):
        assert argv[0] == "recipes-train"
        args = [
            a.split("=", 1)[0] + "=" + values.get(a.split("=", 1)[1], a.split("=", 1)[1])
            for a in argv[1:]
        ]
        if "recipe=sft/qlora" in args:  # CUDA only: it composes, and is refused here
            continue
        if "recipe=pretrain/tiny" in args:
            args += [*SMALL_VOCAB_OVERRIDES, "data.seq_len=64"]
            args.append(f"data.cache_dir={tmp_path / 'cache'}")
        if number not in (0, len(commands) - 1) and "recipe=dpo/lora" not in args:
            continue  # sft/full, dpo/lora and pretraining run here; the rest run in-process above
        run_dir = tmp_path / f"run{number}"
        command = [str(script) if script.is_file() else shutil.which("recipes-train")]
        proc = subprocess.run(
            [*command, *args, *SHORT, f"run.dir={run_dir}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=os.environ,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (run_dir / "model.safetensors").is_file()
        # the closing summary names the weights and what to run next
        console = proc.stdout + proc.stderr
        assert f"weights: {run_dir / 'model.safetensors'}" in console
        assert f"recipes-generate checkpoint={run_dir}" in console


def test_a_chosen_model_that_disagrees_is_listed_with_every_difference(
    tmp_path, hf_folder, records
):
    with pytest.raises(ConfigError) as info:
        _run(
            tmp_path,
            "recipe=sft/full",
            "model=tiny",
            f"stage.init_from={hf_folder}",
            f"data.path={records['chat']}",
        )
    message = str(info.value)
    for difference in (
        "model.vocab_size=",
        "model.dim=128 vs hidden_size=64",
        "ffn_dim",
        "qkv_bias",
    ):
        assert difference in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_data_sources_mix_files_named_on_the_command_line(tmp_path, hf_folder, records):
    other = tmp_path / "more.jsonl"
    write_chat_records(other, 40)
    result = _run(
        tmp_path,
        "recipe=sft/full",
        f"stage.init_from={hf_folder}",
        f"+data.sources.mine={{path: {records['chat']}}}",
        f"+data.sources.more={{path: {other}, weight: 0.5}}",
    )
    assert result.weights_path.is_file()


def test_a_user_template_wins_and_the_run_says_so(tmp_path, hf_folder, records, caplog):
    with caplog.at_level(logging.INFO, logger="recipes_lib"):
        _run(
            tmp_path,
            "recipe=sft/full",
            f"stage.init_from={hf_folder}",
            f"data.path={records['chat']}",
            "data.chat.chat_template=chatml",
        )
    assert "data.chat.chat_template=chatml is used instead of the tokenizer's own" in caplog.text
    saved = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] != TEMPLATE


def test_pretraining_reads_a_folder_of_text_files(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, module in enumerate((json, logging, shutil)):
        (corpus / f"doc{i}.txt").write_text(Path(module.__file__).read_text())
    result = _run(
        tmp_path,
        "recipe=pretrain/tiny",
        f"data.path={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *SMALL_VOCAB_OVERRIDES,
        "data.seq_len=64",
    )
    assert result.weights_path.is_file()
    assert torch.isfinite(torch.tensor(result.metrics["val/loss"]))


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def test_bad_records_are_named_by_file_and_line(tmp_path, hf_folder, records):
    base = ["recipe=sft/full", f"stage.init_from={hf_folder}"]
    lines = _lines(records["chat"])[:20]
    not_json = tmp_path / "not_json.jsonl"
    not_json.write_text("".join(lines[:6]) + '{"messages": [\n' + "".join(lines[6:]))
    with pytest.raises(DataError, match=r"^data\.path: .*not_json\.jsonl:7: not valid JSON"):
        _run(tmp_path, *base, f"data.path={not_json}")
    no_field = tmp_path / "no_field.jsonl"
    no_field.write_text("".join(lines[:3]) + "\n" + '{"mesages": []}\n' + "".join(lines[3:]))
    with pytest.raises(DataError, match=r"no_field\.jsonl:5 has neither field 'messages'"):
        _run(tmp_path, *base, f"data.path={no_field}")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"^data\.path: .*empty\.jsonl is empty$"):
        _run(tmp_path, *base, f"data.path={empty}")
    result = _run(tmp_path, *base, f"data.path={no_field}", "data.chat.on_bad_record=skip")
    assert result.skipped_records == {"malformed (data.chat.on_bad_record=skip)": 1}


def test_a_pipeline_starts_from_a_folder_with_data_per_stage(tmp_path, hf_folder, records):
    pipeline = parse_pipeline(
        {
            "name": "onramp",
            "dir": str(tmp_path / "pipe"),
            "overrides": SHORT,
            "stages": {
                "sft": {
                    "recipe": "sft/full",
                    "from": str(hf_folder),
                    "data": {"path": str(records["chat"])},
                },
                "dpo": {"recipe": "dpo/lora", "data": {"path": str(records["pairs"])}},
            },
        }
    )
    result = run_pipeline(pipeline)
    assert [s.status for s in result.stages] == ["trained", "trained"]
    assert result["dpo"].manifest.model["dim"] == 64
    tokenizer = result["dpo"].manifest.tokenizer_path.read_bytes()
    assert tokenizer == (hf_folder / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def short_folder(tmp_path_factory) -> Path:
    """A tiny Qwen2 of 512 positions: fewer than the on-ramp recipes' 2048."""
    return make_hf_folder(tmp_path_factory.mktemp("hf") / "short", max_position_embeddings=512)


def test_the_recipe_fits_its_defaults_to_the_model_and_the_run(
    tmp_path, short_folder, records, caplog
):
    base = ["recipe=sft/full", f"stage.init_from={short_folder}", f"data.path={records['chat']}"]
    short = ["trainer=cpu", "trainer.max_steps=5", "trainer.val_check_interval=5"]
    with caplog.at_level(logging.INFO, logger="recipes_lib"):
        result = run(compose_config([*base, *short, *QUIET_OVERRIDES, f"run.dir={tmp_path}"]))
    assert result.global_step == 5 and result.weights_path.is_file()
    assert "data.seq_len=512: the recipe's 2048 is more than the model's 512 positions" in (
        caplog.text
    )
    assert "scheduler.warmup=0: the recipe's 20 steps of warmup cut to a tenth" in caplog.text
    # a run long enough keeps the recipe's warmup
    cfg = to_run_config(fill_model_from_init(compose_config([*base, "trainer.max_steps=1000"])))
    assert (cfg.data.seq_len, cfg.scheduler.warmup) == (512, 20)


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.seq_len=1024", r"^data\.seq_len=1024 is above model\.max_seq_len=512$"),
        ("scheduler.warmup=20", r"^scheduler\.warmup \(20 steps\) .* exceed the run's 5 steps"),
    ],
)
def test_a_value_the_user_sets_is_kept_and_refused_when_it_does_not_fit(
    tmp_path, short_folder, records, override, message
):
    with pytest.raises(ConfigError, match=message):
        run(
            compose_config(
                [
                    "recipe=sft/full",
                    f"stage.init_from={short_folder}",
                    f"data.path={records['chat']}",
                    "trainer=cpu",
                    "trainer.max_steps=5",
                    override,
                    *QUIET_OVERRIDES,
                    f"run.dir={tmp_path}",
                ]
            )
        )


def test_a_folder_without_a_chat_template_gets_chatml_and_the_run_says_so(
    tmp_path, hf_folder, records, caplog
):
    folder = tmp_path / "no-template"
    shutil.copytree(hf_folder, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    del settings["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with caplog.at_level(logging.INFO, logger="recipes_lib"):
        _run(
            tmp_path, "recipe=sft/full", f"stage.init_from={folder}", f"data.path={records['chat']}"
        )
    assert "has no chat template of its own: the built-in chatml is used" in caplog.text
    assert str(folder) in caplog.text
    saved = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == CHATML_TEMPLATE
