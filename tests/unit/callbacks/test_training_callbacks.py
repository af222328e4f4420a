import csv
import math

import lightning as L
import pytest
import torch
from callback_helpers import BATCH, SEQ_LEN, random_batches, tiny_causal_lm
from lightning.pytorch.loggers import CSVLogger
from tiny import quiet_trainer
from torch.utils.data import DataLoader

import recipes_lib.callbacks.throughput as throughput_module
from recipes_lib.callbacks import (
    GradNormMonitor,
    ThroughputMonitor,
    TokenProgressBar,
    peak_tflops_for,
    precision_arithmetic,
)
from recipes_lib.callbacks.progress import format_count, format_duration
from recipes_lib.config.schema import SchedulerConfig
from recipes_lib.optim import build_lr_lambda
from recipes_lib.training import CausalLMModule

STEPS = 8
SCHEDULE = SchedulerConfig(name="linear", warmup=2, min_lr_ratio=0.0)


def fit(tmp_path, callbacks, **module_kwargs) -> tuple[CausalLMModule, list[dict[str, str]]]:
    L.seed_everything(0)
    module = tiny_causal_lm(STEPS, SCHEDULE, **module_kwargs)
    trainer = quiet_trainer(
        STEPS,
        callbacks,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="run", version=0),
    )
    trainer.fit(module, DataLoader(random_batches(4), batch_size=None))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return module, rows


def column(rows, name):
    return {int(r["step"]): float(r[name]) for r in rows if r.get(name) not in (None, "")}


class FakeClock:
    """``perf_counter`` advancing half a second per call."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        self.now += 0.5
        return self.now


def test_throughput_logs_tokens_per_second_tflops_and_mfu(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput_module, "time", FakeClock())
    module, rows = fit(tmp_path, [ThroughputMonitor(window=2, peak_tflops=1e-3)])
    tokens_per_sec = column(rows, "perf/tokens_per_sec")
    # a window is 2 steps of BATCH * SEQ_LEN tokens between two clock reads 0.5 s apart
    assert sorted(tokens_per_sec) == list(range(1, STEPS))
    assert set(tokens_per_sec.values()) == {2 * BATCH * SEQ_LEN / 0.5}
    expected_tflops = 2 * BATCH * SEQ_LEN / 0.5 * module.flops_per_token(SEQ_LEN) / 1e12
    assert list(column(rows, "perf/tflops").values()) == pytest.approx([expected_tflops] * 7)
    assert list(column(rows, "perf/mfu").values()) == pytest.approx([expected_tflops / 1e-3] * 7)


def test_throughput_without_known_peak_logs_no_mfu(tmp_path):
    _, rows = fit(tmp_path, [ThroughputMonitor(window=3)])
    assert all(v > 0 for v in column(rows, "perf/tokens_per_sec").values())
    assert column(rows, "perf/tflops")
    assert "perf/mfu" not in rows[0]


def test_grad_norm_is_logged_before_clipping_with_each_group_lr(tmp_path):
    _, rows = fit(tmp_path, [GradNormMonitor()], gradient_clip_val=1e-4)
    norms = column(rows, "train/grad_norm")
    assert len(norms) == STEPS
    assert all(n > 1e-3 for n in norms.values())  # far above the clip value: unclipped
    lr = build_lr_lambda(SCHEDULE, STEPS, BATCH * SEQ_LEN)
    for group in ("decay", "no_decay"):
        logged = column(rows, f"train/lr/{group}")
        assert [logged[s] for s in range(STEPS)] == pytest.approx(
            [1e-2 * lr(s) for s in range(STEPS)]
        )


def test_grad_norm_matches_a_direct_computation():
    from recipes_lib.callbacks import total_grad_norm

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    assert total_grad_norm(params).item() == pytest.approx(5.0)
    assert total_grad_norm(params, math.inf).item() == pytest.approx(4.0)
    assert total_grad_norm([torch.nn.Parameter(torch.zeros(1))]) is None


def test_progress_bar_prints_plain_lines_off_terminal(tmp_path, capsys):
    bar = TokenProgressBar(print_every_n_steps=4)  # stdout is captured: not a terminal
    fit(tmp_path, [ThroughputMonitor(window=2), bar])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 4/8", "step 8/8"]
    assert "loss " in lines[0] and "tok/s" in lines[0] and "eta " in lines[0]
    assert bar.is_disabled  # the live bar stays off


def test_progress_metrics_include_tokens_per_second(tmp_path):
    bar = TokenProgressBar(plain=False)  # the live rich bar, even off a terminal
    fit(tmp_path, [ThroughputMonitor(window=2), bar])
    items = bar.get_metrics(bar.trainer, bar.trainer.lightning_module)
    assert items["tok/s"] == format_count(
        bar.trainer.callback_metrics["perf/tokens_per_sec"].item()
    )
    assert "train/loss" in items
    assert bar.is_enabled


def test_count_and_duration_formats():
    assert format_count(950) == "950"
    assert format_count(12_345.6) == "12.3k"
    assert format_count(250_000) == "250k"
    assert format_count(2.5e9) == "2.5G"
    assert format_duration(3725.4) == "1:02:05"


@pytest.mark.parametrize(
    ("name", "arithmetic", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H200", "fp16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 tensor cores
        ("Some Future GPU", "bf16", None),
        ("NVIDIA H100 80GB HBM3", None, None),
    ],
)
def test_peak_lookup(name, arithmetic, expected):
    assert peak_tflops_for(name, arithmetic) == expected


def test_precision_arithmetic():
    assert precision_arithmetic("bf16-mixed") == "bf16"
    assert precision_arithmetic("bf16-true") == "bf16"
    assert precision_arithmetic("16-mixed") == "fp16"
    assert precision_arithmetic("64-true") is None
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert precision_arithmetic("32-true") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert precision_arithmetic("32-true") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
