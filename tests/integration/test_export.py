"""A stage's output as a Hugging Face folder: ``hf/`` at the end of a stage started from
one (``stage.export_hf``), and ``recipes-export`` on any checkpoint, each checked
against transformers after writing; a pretraining run's folder carries its tokenizer."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_folders import TEMPLATE, write_chat_records
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.cli import export_command as main
from recipes_lib.cli import generate_command as generate_main
from recipes_lib.config import compose_config
from recipes_lib.errors import CheckpointError
from recipes_lib.export import check_against_transformers, load_checkpoint
from recipes_lib.train import run

transformers = pytest.importorskip("transformers")
PeftModel = pytest.importorskip("peft").PeftModel
SHORT = ["trainer=cpu", "trainer.max_steps=2", "scheduler.warmup=1", "trainer.val_check_interval=2"]


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, hf_folder):
    """A two-step LoRA SFT stage from the session's Hugging Face folder."""
    folder = tmp_path_factory.mktemp("lora")
    chat = write_chat_records(folder / "chat.jsonl", 60)
    overrides = ["recipe=sft/lora", f"stage.init_from={hf_folder}", f"data.path={chat}"]
    return run(compose_config([*overrides, *SHORT, *QUIET_OVERRIDES, f"run.dir={folder / 'run'}"]))


def test_a_lora_stage_from_a_folder_writes_its_merged_model_as_hf(lora_run, hf_folder):
    hf = lora_run.output_dir / "hf"
    assert lora_run.hf_path == hf
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(hf).float().eval()
    ours, _ = load_checkpoint(lora_run.output_dir)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(_logits(exported, x), ours.float()(x), atol=1e-4, rtol=1e-4)
        # the adapter alone loads over the folder it started from, with the same logits
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).float()
        adapted = PeftModel.from_pretrained(base, lora_run.output_dir / "adapter").eval()
        torch.testing.assert_close(_logits(adapted, x), _logits(exported, x), atol=1e-4, rtol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    assert tokenizer.chat_template == TEMPLATE


def test_the_closing_summary_names_the_weights_the_folder_and_the_next_commands(lora_run):
    text = "\n".join(lora_run.summary_lines())
    out = lora_run.output_dir
    assert f"weights: {out / 'model.safetensors'}" in text
    assert f"Hugging Face folder: {out / 'hf'}" in text
    assert f"recipes-generate checkpoint={out}" in text
    assert f"recipes-eval checkpoint={out}" in text


def test_a_logit_difference_fails_the_check_in_one_line(tmp_path, lora_run):
    model, config = load_checkpoint(lora_run.output_dir)
    folder = export_hf_checkpoint(model, config, tmp_path / "hf")
    with torch.no_grad():
        model.tok_embeddings.weight[:, 0] += 0.01
    with pytest.raises(CheckpointError, match=r"float32 logits differ .* by up to [\d.e-]+, more"):
        check_against_transformers(folder, model, config)


@pytest.mark.slow
def test_a_pretraining_run_carries_its_tokenizer_and_recipes_export_writes_it(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, module in enumerate((json, logging, shutil)):
        (corpus / f"doc{i}.txt").write_text(Path(module.__file__).read_text())
    overrides = ["recipe=pretrain/tiny", f"data.path={corpus}", *SMALL_VOCAB_OVERRIDES]
    overrides += ["data.seq_len=64", f"data.cache_dir={tmp_path / 'cache'}"]
    result = run(
        compose_config([*overrides, *SHORT, *QUIET_OVERRIDES, f"run.dir={tmp_path / 'run'}"])
    )
    out = result.output_dir
    assert (out / "tokenizer.json").is_file() and result.hf_path is None  # not from a folder
    assert "recipes-export checkpoint=" in "\n".join(result.summary_lines())
    assert generate_main([f"checkpoint={out}", "prompt=def ", "max_new_tokens=4"]) == 0

    # the run folder and its last checkpoint, each as the model's own family
    assert main([f"checkpoint={out}", f"out={tmp_path / 'hf'}"]) == 0
    last = out / "checkpoints" / "last.ckpt"
    assert main([f"checkpoint={last}", f"out={tmp_path / 'hf16'}", "dtype=bfloat16"]) == 0
    assert f"wrote {tmp_path / 'hf'}" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, model_config = load_checkpoint(out)
    x = torch.randint(0, model_config.vocab_size, (1, 32), generator=torch.Generator())
    with torch.no_grad():
        torch.testing.assert_close(_logits(theirs, x), ours(x), atol=1e-4, rtol=1e-4)


def test_recipes_export_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    assert main([f"checkpoint={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip() == "error: out: required; pass out=PATH"
    assert main([f"checkpoint={tmp_path}", "out=x", "check=maybe"]) == 2
    assert capsys.readouterr().err.startswith("error: check=maybe: ")
    assert main([f"checkpoint={tmp_path / 'missing'}", f"out={tmp_path / 'hf'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "missing" in err
    assert main(["--help"]) == 0 and "checkpoint: ???" in capsys.readouterr().out


def test_the_console_script_is_installed(tmp_path):
    script = Path(sys.executable).parent / "recipes-export"
    proc = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0 and "usage: recipes-export" in proc.stdout, proc.stderr
    assert list(tmp_path.iterdir()) == []
