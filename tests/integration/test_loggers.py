"""Loggers chosen by config receive the training metrics: CSV and TensorBoard; W&B
(offline) and MLflow (a file store) with the run's config, a pipeline stage's manifest
and the pipeline's report attached."""

from __future__ import annotations

import pytest
from integration_helpers import metric_series, read_metrics, tiny_overrides

from recipes_lib.pipeline import parse_pipeline, run_pipeline
from recipes_lib.trackers import finish
from recipes_lib.train import run


def test_csv_and_tensorboard_loggers_record_the_run(tiny_cfg, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run(tiny_cfg("logger=csv_tensorboard", "trainer.max_steps=8"))
    rows = read_metrics(result.output_dir)
    assert len(metric_series(rows, "train/loss")) == 8
    assert metric_series(rows, "val/ppl")

    (events,) = (result.output_dir / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "val/loss", "val/ppl"} <= tags
    assert len(acc.Scalars("train/loss")) == 8


def test_no_logger(tiny_cfg):
    result = run(tiny_cfg("logger=none", "trainer.max_steps=4"))
    assert result.global_step == 4
    assert not (result.output_dir / "logs").exists()


def _mlflow_runs(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("recipes-lib")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return client, runs


def test_wandb_offline_and_mlflow_record_the_run_with_its_config(tiny_cfg, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store
    result = run(
        tiny_cfg("logger=[csv,wandb,mlflow]", "logger.wandb.offline=true", "trainer.max_steps=6")
    )
    assert [type(t).__name__ for t in result.trackers] == ["WandbLogger", "MLFlowLogger"]
    wandb_run = result.trackers[0].experiment
    run_id = wandb_run.id
    finish(result.trackers)  # as the process's end would

    # MLflow: the metrics and the resolved config, in the run folder's file store
    client, (mlflow_run,) = _mlflow_runs(f"file:{result.output_dir}/mlruns")
    history = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert len(history) == 6
    attached = [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "config")]
    assert attached == ["config/config.yaml"]
    # W&B, offline: the run's log on disk (what `wandb sync` uploads) holds the metrics
    # and the config artifact
    (folder,) = (result.output_dir / "wandb").glob(f"offline-run-*-{run_id}")
    (log,) = folder.glob(f"run-{run_id}.wandb")
    records = log.read_bytes()
    assert records.count(b"train/loss") >= 6 and b"val/loss" in records
    assert f"config-{run_id}".encode() in records and b"config.yaml" in records


def test_a_pipeline_attaches_manifests_and_its_report(tmp_path, shared_cache, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("RECIPES_CACHE", str(shared_cache))
    shared = tiny_overrides(tmp_path, shared_cache, "logger=[csv,mlflow]", "trainer.max_steps=4")
    spec = parse_pipeline(
        {
            "name": "tracked",
            "dir": str(tmp_path / "pipeline"),
            "overrides": [o for o in shared[1:] if not o.startswith("run.dir=")],
            "stages": {"first": {"recipe": "pretrain/tiny"}, "second": {"recipe": "pretrain/tiny"}},
        }
    )
    result = run_pipeline(spec)
    files = {}
    for stage in result.stages:
        client, (mlflow_run,) = _mlflow_runs(f"file:{stage.manifest.directory}/mlruns")
        files[stage.name] = {
            a.path
            for folder in ("config", "manifest", "report")
            for a in client.list_artifacts(mlflow_run.info.run_id, folder)
        }
    assert files["first"] == {"config/config.yaml", "manifest/manifest.json"}
    assert {"manifest/manifest.json", "report/loss.png", "report/summary.json"} <= files["second"]


def test_the_throughput_figures_of_a_run_the_module_steps_itself(tiny_cfg):
    # the module runs each step's micro-batches: the callback sees them as a list, and
    # still knows the rows' length, so TFLOP/s and MFU (with a peak given) are logged
    result = run(
        tiny_cfg(
            "callbacks=default",
            "trainer.max_steps=6",
            "trainer.accumulate_grad_batches=2",
            "trainer.log_every_n_steps=1",
            "callbacks.throughput.window=2",
            "+callbacks.throughput.peak_tflops=1e-3",
        )
    )
    rows = read_metrics(result.output_dir)
    assert metric_series(rows, "perf/tflops")
    assert all(v > 0 for _, v in metric_series(rows, "perf/tflops"))
    assert metric_series(rows, "perf/mfu")
    assert all(v > 0 for _, v in metric_series(rows, "perf/mfu"))
