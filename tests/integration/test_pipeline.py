"""End to end: the three-stage tiny pipeline (pretrain -> continued pretraining with
the optimizer's moments -> anneal from the last learning rate, averaging its last three
checkpoints) hands weights, steps and learning rates on as configured; a killed run
resumes to the same weights; changes are caught; a sweep keeps its runs apart."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from integration_helpers import metric_series, read_metrics
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf
from signal_helpers import ALLOWED, env_with_helpers, signal_at_step, slow_steps_override
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.callbacks import EXIT_PREEMPTED
from recipes_lib.checkpoint.manifest import read_manifest
from recipes_lib.checkpoint.weights import load_weights, read_checkpoint
from recipes_lib.errors import ConfigError
from recipes_lib.pipeline import compose_pipeline, parse_pipeline, plan_pipeline, run_pipeline

PIPELINE = str(Path(sys.executable).parent / "recipes-pipeline")


class RecordStart(Callback):
    """What a stage's first training batch starts from: step, LR, weights, moments."""

    def __init__(self):
        self.seen: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.seen is not None:
            return
        optimizer = trainer.optimizers[0]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.seen = {
            "step": trainer.global_step,
            "lr": optimizer.param_groups[0]["lr"],
            "tokens_seen": pl_module.tokens_seen,
            "weights": {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()},
            "exp_avg": [
                optimizer.state[p]["exp_avg"].clone() for p in params if optimizer.state[p]
            ],
        }


def _assert_same_weights(found: dict, expected: dict):
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name


def _ckpt_moments(path: Path) -> list[torch.Tensor]:
    saved = read_checkpoint(path, mmap=False)["optimizer_states"][0]
    order = [i for group in saved["param_groups"] for i in group["params"]]
    return [saved["state"][i]["exp_avg"] for i in order]


@pytest.fixture(scope="module")
def three_stage(tmp_path_factory, shared_cache):
    """The shipped ``three_stage`` pipeline, run once in this process."""
    directory = tmp_path_factory.mktemp("three_stage") / "pipe"
    starts = {name: RecordStart() for name in ("pretrain", "cpt", "anneal")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RECIPES_CACHE", str(shared_cache))
        cfg = compose_pipeline(["pipeline=three_stage", f"dir={directory}"])
        result = run_pipeline(cfg, stage_callbacks={k: [v] for k, v in starts.items()})
    return result, {k: v.seen for k, v in starts.items()}, cfg


def test_stages_hand_on_weights_moments_and_learning_rate(three_stage):
    result, starts, _ = three_stage
    assert [s.status for s in result.stages] == ["trained"] * 3
    pretrain, cpt, anneal = (result[name].manifest for name in ("pretrain", "cpt", "anneal"))
    for manifest in (pretrain, cpt, anneal):
        # what the next stage reads: complete and verified
        assert read_manifest(manifest.directory).config_sha256 == manifest.config_sha256
        assert manifest.global_step == 12 and manifest.start_step == 0
    assert pretrain.tokenizer.sha256 == cpt.tokenizer.sha256 == anneal.tokenizer.sha256
    assert cpt.upstream == {"stage": "pretrain", "weights_sha256": pretrain.weights.sha256}

    # cpt (init weights+optimizer): the pretrained weights and AdamW moments, its own
    # schedule (a re-warmup to its lower peak), a fresh step count; replayed data
    assert starts["cpt"]["step"] == 0
    _assert_same_weights(starts["cpt"]["weights"], load_weights(pretrain.weights_path))
    for found, saved in zip(
        starts["cpt"]["exp_avg"], _ckpt_moments(pretrain.checkpoint_path), strict=True
    ):
        assert torch.equal(found, saved)
    assert starts["cpt"]["lr"] == pytest.approx(1e-3 / 3)  # warmup 2: step 0 at 1/3 of peak
    config = cpt.config
    assert config["model"]["rope_theta"] == 40000.0 and config["data"]["seq_len"] == 128
    weights = {k: v["weight"] for k, v in cpt.data_sources.items()}
    assert weights["replay_stdlib"] / sum(weights.values()) == pytest.approx(0.25)

    # anneal (init weights, lr_from_previous): cpt's output weights, cpt's last LR,
    # linear to zero; its output is the mean of its last three checkpoints
    assert starts["anneal"]["step"] == 0
    _assert_same_weights(starts["anneal"]["weights"], load_weights(cpt.weights_path))
    assert starts["anneal"]["lr"] == pytest.approx(cpt.last_lr, rel=1e-6)
    lrs = metric_series(read_metrics(anneal.directory), "train/lr/decay")
    assert [s for s, _ in lrs] == list(range(12))
    for step, lr in lrs:
        assert lr == pytest.approx(cpt.last_lr * (1 - step / 12), rel=1e-5, abs=1e-12)
    assert anneal.last_lr == 0.0
    assert anneal.averaged_from == [f"checkpoints/step{s:06d}.ckpt" for s in (4, 8, 12)]
    chosen = [
        read_checkpoint(anneal.resolve(p), mmap=False)["state_dict"] for p in anneal.averaged_from
    ]
    output = load_weights(anneal.weights_path)
    for name, tensor in output.items():
        mean = sum(state[f"model.{name}"].float() for state in chosen) / len(chosen)
        torch.testing.assert_close(tensor, mean, rtol=0, atol=1e-7, msg=name)


def test_report_and_summary(three_stage):
    result, _, _ = three_stage
    report = result.dir / "report"
    assert result.report_dir == report
    for name in ("loss.png", "lr.png", "throughput.png"):
        assert (report / name).read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((report / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["pretrain", "cpt", "anneal"]
    first = summary["stages"][0]
    assert first["train_loss_end"] < first["train_loss_start"]
    assert first["tokens"] == 12 * 4 * 64 and first["seconds"] > 0
    assert all(s["val_ppl"] > 1 for s in summary["stages"])


def test_rerun_skips_completed_stages_and_detects_changes(three_stage):
    result, _, cfg = three_stage
    again = run_pipeline(cfg)
    assert [s.status for s in again.stages] == ["skipped"] * 3
    assert again.weights_path == result.weights_path

    changed = parse_pipeline(
        compose_pipeline(["pipeline=three_stage", f"dir={result.dir}", "stages.cpt.optim.lr=5e-4"])
    )
    with pytest.raises(ConfigError) as info:
        run_pipeline(changed)
    assert "stage cpt changed since it completed (optim.lr: 0.001 -> 0.0005)" in str(info.value)
    rerun = parse_pipeline(
        compose_pipeline(
            ["pipeline=three_stage", f"dir={result.dir}", "stages.cpt.optim.lr=5e-4"]
            + ["on_change=rerun"]
        )
    )
    assert [p.action for p in plan_pipeline(rerun)] == ["skip", "rerun", "rerun"]


def test_full_init_continues_the_step_count(tmp_path, shared_cache, monkeypatch):
    monkeypatch.setenv("RECIPES_CACHE", str(shared_cache))
    common = {"scheduler": {"warmup": 1}, "run": {"checkpoint_every_n_steps": 3}}
    spec = parse_pipeline(
        {
            "name": "full",
            "dir": str(tmp_path / "full"),
            "overrides": [
                *SMALL_VOCAB_OVERRIDES,
                "data.sources.stdlib.max_documents=120",
                "data.seq_len=64",
                "data.batch_size=4",
                "trainer.limit_val_batches=1",
                "trainer.log_every_n_steps=1",
                *QUIET_OVERRIDES,
                "callbacks=minimal",
            ],
            "stages": {
                "first": {"recipe": "pretrain/tiny", "trainer": {"max_steps": 4}, **common},
                "more": {
                    "recipe": "pretrain/tiny",
                    "init": "full",
                    "trainer": {"max_steps": 7},
                    **common,
                    # no step checkpoint in its 3 steps, as in sft/tiny and dpo/tiny
                    "run": {"checkpoint_every_n_steps": 10},
                },
            },
        }
    )
    start = RecordStart()
    result = run_pipeline(spec, stage_callbacks={"more": [start]})
    first, more = result["first"].manifest, result["more"].manifest
    # the checkpoint interval (3) does not divide 4: last.ckpt still holds the final step
    assert read_checkpoint(first.checkpoint_path)["global_step"] == 4
    assert start.seen["step"] == 4 and start.seen["tokens_seen"] == 4 * 4 * 64
    _assert_same_weights(start.seen["weights"], load_weights(first.weights_path))
    for found, saved in zip(
        start.seen["exp_avg"], _ckpt_moments(first.checkpoint_path), strict=True
    ):
        assert torch.equal(found, saved)
    assert (more.start_step, more.global_step, more.metrics.steps) == (4, 7, 3)
    # one last.ckpt per stage at its final step, no last-v1.ckpt beside it
    for manifest, step in ((first, 4), (more, 7)):
        folder = manifest.directory / "checkpoints"
        assert sorted(p.name for p in folder.glob("last*.ckpt")) == ["last.ckpt"]
        assert read_checkpoint(folder / "last.ckpt")["global_step"] == step
    assert more.tokens_seen == 7 * 4 * 64 and more.metrics.tokens == 3 * 4 * 64
    steps = [s for s, _ in metric_series(read_metrics(more.directory), "train/loss")]
    assert steps == [4, 5, 6]


def _env(shared_cache: Path) -> dict[str, str]:
    return {**os.environ, "RECIPES_CACHE": str(shared_cache), "HYDRA_FULL_ERROR": "0"}


@pytest.mark.slow
def test_killed_pipeline_resumes_to_identical_weights(three_stage, tmp_path, shared_cache):
    result, _, _ = three_stage
    out = tmp_path / "killed"
    command = [PIPELINE, "pipeline=three_stage", f"dir={out}"]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=_env(shared_cache), stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 300
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                # checkpoints appear whole (written aside, then renamed)
                if (out / "pretrain" / "manifest.json").is_file() and any(
                    (out / "cpt" / "checkpoints").glob("*.ckpt")
                ):
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    assert not (out / "cpt" / "manifest.json").exists()  # killed mid-stage

    rerun = subprocess.run(
        command, cwd=tmp_path, env=_env(shared_cache), capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["skipped", "resumed", "trained"]
    assert len(list((out / "cpt" / "logs").glob("version_*"))) == 2  # the resume logged anew
    for stage in ("cpt", "anneal"):
        _assert_same_weights(
            load_weights(out / stage / "model.safetensors"),
            load_weights(result[stage].manifest.weights_path),
        )


@pytest.mark.slow
def test_preempted_stage_resumes_to_identical_weights(three_stage, tmp_path, shared_cache):
    result, _, _ = three_stage
    out, marker = tmp_path / "preempted", tmp_path / "step.txt"
    command = [
        PIPELINE,
        "pipeline=three_stage",
        f"dir={out}",
        slow_steps_override(marker, "stages.cpt.callbacks"),  # cpt's steps, slowed down
        f"stages.cpt.{ALLOWED}",
    ]
    env = env_with_helpers(RECIPES_CACHE=str(shared_cache))
    log = tmp_path / "first.log"
    proc = signal_at_step(command, marker, random.Random().randint(2, 8), log, env=env)
    output = log.read_text()
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    stopped = [line for line in output.splitlines() if line.startswith("error: preempted")]
    assert len(stopped) == 1 and "run the same command again to resume" in stopped[0]
    assert (out / "pretrain" / "manifest.json").is_file()
    assert not (out / "cpt" / "manifest.json").exists()  # stopped mid-stage
    started = OmegaConf.load(out / "cpt" / "config.yaml").stage.init_from
    assert started is not None  # the pretraining stage's output

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["skipped", "resumed", "trained"]
    # the resumed attempt was given no stage.init_from; its record keeps where it started
    assert OmegaConf.load(out / "cpt" / "config.yaml").stage.init_from == started
    for stage in ("cpt", "anneal"):
        _assert_same_weights(
            load_weights(out / stage / "model.safetensors"),
            load_weights(result[stage].manifest.weights_path),
        )


def test_multirun_over_a_stage_parameter_keeps_runs_apart(tmp_path, shared_cache):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            PIPELINE,
            "-m",
            "pipeline=three_stage",
            f"dir={sweep}",
            "~stages.cpt",
            "~stages.anneal",
            "stages.pretrain.trainer.max_steps=4",
            "stages.pretrain.optim.lr=0.001,0.004",
        ],
        cwd=tmp_path,
        env=_env(shared_cache),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in (sweep / "multirun").iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1"]
    manifests = [read_manifest(job / "pretrain") for job in jobs]
    assert {m.config["optim"]["lr"] for m in manifests} == {0.001, 0.004}
    assert manifests[0].weights.sha256 != manifests[1].weights.sha256
    for job in jobs:
        assert (job / "report" / "summary.json").is_file()
    assert not (sweep / "pretrain").exists()


def test_bad_pipeline_exits_with_a_one_line_message(tmp_path):
    proc = subprocess.run(
        [PIPELINE, "pipeline=three_stage", f"dir={tmp_path / 'p'}", "stages.cpt.from=nowhere"],
        cwd=tmp_path,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "error: stages.cpt.from='nowhere' is neither an earlier stage" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "p" / "pretrain").exists()  # nothing trained


@pytest.mark.parametrize("dry_run", ["true", "false"])
def test_a_later_stage_bad_value_stops_the_pipeline_before_any_stage_trains(tmp_path, dry_run):
    # anneal starts from cpt's weights, which do not exist until cpt has trained: its
    # config is checked with the paths cpt will write
    proc = subprocess.run(
        [
            PIPELINE,
            "pipeline=three_stage",
            f"dir={tmp_path / 'p'}",
            f"dry_run={dry_run}",
            "stages.anneal.trainer.max_steps=-3",
        ],
        cwd=tmp_path,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: stage anneal: trainer.max_steps=-3 must be positive" in proc.stderr
    assert not [s for s in ("pretrain", "cpt", "anneal") if (tmp_path / "p" / s).exists()]
