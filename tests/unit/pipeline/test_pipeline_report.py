"""The report reads every CSV log version of a stage and draws the pipeline's plots."""

from __future__ import annotations

import csv
import io
import json

from rich.console import Console

from recipes_lib.pipeline.report import (
    PLOTS,
    PREFERENCE_PLOT,
    held_out_changes,
    preference_figure,
    read_stage_logs,
    write_plots,
    write_summary,
)
from recipes_lib.pipeline.tables import print_summary_table


def _write_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted({k for row in rows for k in row})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


def test_resumed_versions_override_the_steps_they_repeat(tmp_path):
    logs = tmp_path / "cpt" / "logs"
    _write_csv(
        logs / "version_0" / "metrics.csv",
        [{"step": s, "train/loss": 10 - s} for s in range(0, 6)] + [{"step": 4, "val/loss": 7}],
    )
    # killed after a checkpoint at step 3: the resumed run logs steps 3.. again
    _write_csv(
        logs / "version_1" / "metrics.csv",
        [{"step": s, "train/loss": 20 - s, "train/lr/decay": 0.1} for s in range(3, 8)],
    )
    _write_csv(logs / "version_10" / "metrics.csv", [{"step": 7, "train/loss": 1.0}])
    series = read_stage_logs(tmp_path / "cpt", "cpt")
    losses = dict(series.series["train/loss"])
    assert [s for s, _ in series.series["train/loss"]] == list(range(8))
    assert losses[2] == 8 and losses[3] == 17 and losses[6] == 14
    assert losses[7] == 1.0  # version_10 sorts after version_1, not before version_2
    assert series.first("train/loss") == 10 and series.last("train/loss") == 1.0
    assert series.last("val/loss") == 7 and series.first("missing") is None


def test_plots_and_summary_are_written_even_without_optional_metrics(tmp_path):
    _write_csv(
        tmp_path / "a" / "logs" / "version_0" / "metrics.csv",
        [{"step": s, "train/loss": 5 - s / 10, "perf/tokens_per_sec": 1000} for s in range(5)],
    )
    _write_csv(
        tmp_path / "b" / "logs" / "version_0" / "metrics.csv",
        [{"step": s, "train/loss": 4.0} for s in range(5, 9)],  # continued step count
    )
    series = [read_stage_logs(tmp_path / "a", "a"), read_stage_logs(tmp_path / "b", "b", 5)]
    plots = write_plots(series, tmp_path / "report")
    assert [p.name for p in plots] == list(PLOTS)
    for path in plots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # lr.png: nothing logged, still drawn
    stages = [
        {
            "stage": "a",
            "recipe": "pretrain/tiny",
            "status": "trained",
            "steps": 5,
            "train_loss_start": 5.0,
            "train_loss_end": 4.6,
            "val_loss": None,
            "val_ppl": None,
            "tokens": 12_345,
            "seconds": 3.25,
        }
    ]
    summary = write_summary(tmp_path / "report" / "summary.json", "p", tmp_path, stages, plots)
    assert json.loads(summary.read_text())["plots"] == list(PLOTS)
    out = io.StringIO()
    print_summary_table("p", stages, Console(file=out, width=150))
    text = out.getvalue()
    assert "5.000" in text and "4.600" in text and "12.35k" in text and "3.2s" in text


def test_held_out_changes_run_from_the_first_to_the_last_validation(tmp_path):
    _write_csv(
        tmp_path / "sft" / "logs" / "version_0" / "metrics.csv",
        [{"step": 0, "val/loss": 2.5, "val/ppl": 12.2}]
        + [{"step": s, "train/loss": 2.4 - s / 100} for s in range(0, 10)]
        + [{"step": 9, "val/loss": 1.9, "val/ppl": 6.7}],
    )
    _write_csv(
        tmp_path / "dpo" / "logs" / "version_0" / "metrics.csv",
        [
            {"step": 0, "val/loss": 0.693, "val/rewards/accuracy": 0.0, "val/rewards/margin": 0.0},
            {"step": 4, "val/loss": 0.61, "val/rewards/accuracy": 0.75, "val/rewards/margin": 0.2},
            {
                "step": 9,
                "val/loss": 0.52,
                "val/rewards/accuracy": 0.875,
                "val/rewards/margin": 0.45,
            },
        ],
    )
    sft = held_out_changes(read_stage_logs(tmp_path / "sft", "sft"))
    assert sft == {"val/loss": {"first": 2.5, "first_step": 0, "last": 1.9, "last_step": 9}}
    dpo = held_out_changes(read_stage_logs(tmp_path / "dpo", "dpo"))
    assert set(dpo) == {"val/loss", "val/rewards/accuracy", "val/rewards/margin"}
    assert dpo["val/rewards/accuracy"]["first"] == 0.0
    assert dpo["val/rewards/accuracy"]["last"] == 0.875
    assert dpo["val/rewards/margin"]["last_step"] == 9

    base = {"recipe": "r", "status": "trained", "steps": 10, "tokens": 100, "seconds": 1.0}
    rows = [
        {**base, "stage": "sft", "train_loss_start": 2.4, "train_loss_end": 2.31, "val_loss": 1.9}
        | {"val_ppl": 6.7, "held_out": sft},
        {**base, "stage": "dpo", "train_loss_start": 0.69, "train_loss_end": 0.5, "val_loss": 0.52}
        | {"val_ppl": None, "held_out": dpo},
        {**base, "stage": "grpo", "train_loss_start": 0.0, "train_loss_end": -0.01}
        | {"val_loss": None, "val_ppl": None}
        | {
            "held_out": {"val/reward": {"first": 0.1, "first_step": 0, "last": 0.2, "last_step": 9}}
        },
        # a summary written before held-out changes were recorded
        {**base, "stage": "old", "train_loss_start": 3.0, "train_loss_end": 2.0, "val_loss": 2.1}
        | {"val_ppl": 8.2},
    ]
    out = io.StringIO()
    print_summary_table("p", rows, Console(file=out, width=200))
    text = out.getvalue()
    assert "2.400 → 2.310" in text and "loss 2.500 → 1.900" in text
    assert "accuracy 0.00 → 0.88, margin 0.00 → 0.45" in text
    assert "reward 0.10 → 0.20" in text  # an RL stage's mean held-out reward
    assert "loss 2.100" in text


def test_preference_accuracy_and_margin_are_drawn_on_their_own_axes(tmp_path):
    _write_csv(
        tmp_path / "sft" / "logs" / "version_0" / "metrics.csv",
        [{"step": s, "train/loss": 2.0 - s / 10, "val/loss": 2.1} for s in range(4)],
    )
    _write_csv(
        tmp_path / "dpo" / "logs" / "version_0" / "metrics.csv",
        [
            {"step": s, "train/loss": 0.69, "train/rewards/accuracy": s / 4}
            | {"train/rewards/margin": 0.5 * s}
            for s in range(4)
        ]
        + [
            {"step": s, "val/rewards/accuracy": a, "val/rewards/margin": m}
            for s, a, m in ((0, 0.0, 0.0), (3, 0.75, 1.5))
        ],
    )
    sft, dpo = read_stage_logs(tmp_path / "sft", "sft"), read_stage_logs(tmp_path / "dpo", "dpo")
    assert preference_figure([sft]) is None  # no preference stage: no panels
    assert [p.name for p in write_plots([sft], tmp_path / "a")] == list(PLOTS)

    fig = preference_figure([sft, dpo])
    accuracy, margin = fig.axes
    assert accuracy.get_ylabel() == "preference accuracy" and margin.get_ylabel() == "reward margin"
    labels = {ax: {line.get_label() for line in ax.get_lines()} for ax in (accuracy, margin)}
    assert {"dpo train/rewards/accuracy", "dpo val/rewards/accuracy"} <= labels[accuracy]
    assert {"dpo train/rewards/margin", "dpo val/rewards/margin"} <= labels[margin]
    assert not any("margin" in label for label in labels[accuracy])
    assert not any("accuracy" in label for label in labels[margin])
    assert accuracy.get_ylim() == (-0.05, 1.05)  # a share, whatever the margin's scale
    # on the pipeline's step axis: the DPO stage starts after the SFT stage's 4 steps
    lines = {line.get_label(): line for line in accuracy.get_lines()}
    held_out = lines["dpo val/rewards/accuracy"]
    assert list(held_out.get_xdata()) == [4, 7]

    plots = write_plots([sft, dpo], tmp_path / "b")
    assert [p.name for p in plots] == [*PLOTS, PREFERENCE_PLOT]
    assert plots[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
