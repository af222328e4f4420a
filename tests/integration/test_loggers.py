"""CSV and TensorBoard loggers are chosen by config and receive the training metrics."""

from __future__ import annotations

from integration_helpers import metric_series, read_metrics

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
