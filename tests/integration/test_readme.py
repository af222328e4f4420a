"""The README's commands are the ones that work: the main command runs the demo pipeline
(pretrain, anneal, SFT, DPO, then an eval stage) on the embedded corpus; pretraining
takes the loss well below where it started and the downstream task above chance, SFT
lowers the held-out loss on instructions, DPO raises the held-out preference accuracy
and margin, every stage is evaluated and the gates pass, the summary and report are
written, recipes-eval scores the demo's output as its stage did, and the SFT output
exports to a folder transformers renders conversations in as training did; the test
command is the one CI runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from integration_helpers import metric_series, read_metrics
from omegaconf import OmegaConf

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.cli import eval_command as eval_main
from recipes_lib.config import to_run_config
from recipes_lib.data.chat.messages import record_messages
from recipes_lib.data.chat.module import ChatDataModule
from recipes_lib.data.chat.template import PLAIN_TEMPLATE
from recipes_lib.data.records import split_records

ROOT = Path(__file__).resolve().parents[2]
SFT_MIN_DROP = 0.3  # held-out SFT loss: start (the annealed weights) minus end, at least
DPO_MIN_ACCURACY = 0.7  # held-out DPO preference accuracy at the end, at least
DOWNSTREAM_MIN_ACCURACY = 0.3  # stdlib_bodies after pretraining (chance: 0.25; 0.40 seen)


def readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", text, re.S)
    assert match, f"README has no {marker} block"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command():
    test_command = readme_command("test-command").split("&&")[-1].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_main_command_runs_the_demo_pipeline_on_embedded_corpus(tmp_path):
    command = readme_command("main-command").split("&&")[-1].strip()
    argv = shlex.split(command)
    assert argv[0] == "recipes-pipeline"
    script = Path(sys.executable).parent / argv[0]
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            str(script),
            *argv[1:],
            f"dir={out}",
            "overrides=['trainer.enable_progress_bar=false']",
        ],
        cwd=tmp_path,
        env={**os.environ, "RECIPES_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = read_metrics(out / "pretrain")
    train = metric_series(rows, "train/loss")
    val = metric_series(rows, "val/loss")
    ppl = metric_series(rows, "val/ppl")
    assert train[-1][0] == 199  # the demo's 200 optimizer steps
    start = train[0][1]
    assert start > 7.0  # close to ln(4096) = 8.3 at the start
    assert val[-1][1] < start - 3.0, (start, val)
    assert [p for _, p in ppl] == sorted((p for _, p in ppl), reverse=True)  # keeps improving
    assert (out / "pretrain" / "checkpoints" / "last.ckpt").is_file()
    assert (out / "pretrain" / "config.yaml").is_file()
    tokens = metric_series(rows, "perf/tokens_per_sec")
    assert tokens and all(t > 0 for _, t in tokens)
    # the downstream task in the loop: above chance (0.25) once pretrained
    downstream = metric_series(rows, "eval/stdlib_bodies/acc")
    assert [step for step, _ in downstream] == [0, 100, 200]
    assert downstream[-1][1] >= DOWNSTREAM_MIN_ACCURACY > downstream[0][1], downstream

    # the anneal continues from the pretrained weights and lowers the validation loss
    anneal = read_metrics(out / "anneal")
    assert metric_series(anneal, "train/loss")[-1][0] == 49  # 50 more steps
    assert metric_series(anneal, "val/loss")[-1][1] < val[-1][1]
    for stage in ("pretrain", "anneal", "sft", "dpo"):
        assert (out / stage / "manifest.json").is_file()
        assert (out / stage / "model.safetensors").is_file()

    # SFT, validated before its first step, lowers the loss on held-out instructions
    sft = metric_series(read_metrics(out / "sft"), "val/loss")
    assert sft[0][0] == 0 and len(sft) >= 3
    assert sft[-1][1] < sft[0][1] - SFT_MIN_DROP, sft
    assert sft[-1][1] < sft[1][1], sft  # still falling after its first interval

    # DPO starts as its reference (no pair preferred, margin 0), then learns held-out pairs
    dpo = read_metrics(out / "dpo")
    accuracy = metric_series(dpo, "val/rewards/accuracy")
    margin = metric_series(dpo, "val/rewards/margin")
    assert accuracy[0] == (0, 0.0) and margin[0] == (0, 0.0)
    assert accuracy[-1][1] >= DPO_MIN_ACCURACY, accuracy
    assert accuracy[-1][1] >= accuracy[1][1], accuracy  # no worse than after its first interval
    assert margin[-1][1] > margin[1][1] > 0, margin  # and the margin keeps growing

    # every stage evaluated; the anneal's gate and the release stage's gate passed
    manifests = {
        stage: json.loads((out / stage / "manifest.json").read_text())
        for stage in ("pretrain", "anneal", "sft", "dpo", "release")
    }
    for manifest in manifests.values():
        assert set(manifest["evaluation"]["results"]["stdlib_bodies"]) == {"acc", "acc_norm"}
    assert manifests["pretrain"]["evaluation"]["results"]["stdlib_bodies"]["acc"] >= 0.3
    assert [g["passed"] for g in manifests["anneal"]["gates"]] == [True]
    release = manifests["release"]
    assert release["kind"] == "eval" and [g["passed"] for g in release["gates"]] == [True]
    assert release["weights"]["sha256"] == manifests["dpo"]["weights"]["sha256"]
    assert "gate eval/stdlib_bodies/acc" in proc.stderr + proc.stdout

    # the summary table and the report
    assert "pipeline demo" in proc.stdout and "held-out: first → last" in proc.stdout
    assert "stdlib_bodies acc" in proc.stdout and "gates passed 1/1" in proc.stdout
    assert "accuracy 0.00 →" in proc.stdout  # DPO's held-out change, in the table
    summary = json.loads((out / "report" / "summary.json").read_text())
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == ["pretrain", "anneal", "sft", "dpo", "release"]
    assert [s["status"] for s in stages.values()] == ["trained"] * 4 + ["evaluated"]
    assert stages["pretrain"]["train_loss_end"] < stages["pretrain"]["train_loss_start"] - 3.0
    assert stages["anneal"]["last_lr"] == 0.0
    held_out = stages["sft"]["held_out"]["val/loss"]
    assert (held_out["first"], held_out["last"]) == (sft[0][1], sft[-1][1])
    held_out = stages["dpo"]["held_out"]
    assert held_out["val/rewards/accuracy"]["last"] == accuracy[-1][1]
    assert held_out["val/rewards/margin"]["last"] > held_out["val/rewards/margin"]["first"]
    for name in ("loss.png", "lr.png", "throughput.png", "evaluation.png"):
        assert (out / "report" / name).read_bytes()[:4] == b"\x89PNG"

    # recipes-eval on the demo's output: the anneal's weights, as its stage evaluated them
    evaluated = tmp_path / "anneal_eval.json"
    code = eval_main(
        [f"checkpoint={out / 'anneal'}", "tasks=stdlib_bodies", "limit=100", f"output={evaluated}"]
    )
    assert code == 0
    again = json.loads(evaluated.read_text())["results"]
    assert again == manifests["anneal"]["evaluation"]["results"]

    _assert_sft_exports_its_chat_template(out / "sft", tmp_path / "sft-hf")


def _assert_sft_exports_its_chat_template(stage_dir: Path, export_dir: Path) -> None:
    """The SFT stage folder carries its tokenizer and chat template: exported to Hugging
    Face format, transformers renders held-out conversations to the ids SFT trained on."""
    transformers = pytest.importorskip("transformers")
    cfg = to_run_config(OmegaConf.load(stage_dir / "config.yaml"))
    saved = json.loads((stage_dir / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == PLAIN_TEMPLATE
    exported = export_hf_checkpoint(
        load_weights(stage_dir / "model.safetensors"), cfg.model, export_dir, stage_dir
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    data = ChatDataModule(cfg.data, cfg.model.vocab_size, cfg.model.max_seq_len)
    data.setup("fit")
    assert data.renderer is not None
    records = data._source_records("stdlib_sft")
    _, held_out = split_records(records, cfg.data.val_fraction, cfg.data.seed)
    for index in held_out[:40]:
        messages = record_messages(records[index], index, cfg.data.chat)
        ours = data.renderer.render(messages).input_ids
        theirs = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert list(theirs) == ours, records[index]["source"]
