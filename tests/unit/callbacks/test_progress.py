"""TokenProgressBar: one line of step/total, loss, tok/s and eta that fits the console."""

import io
import re

import lightning as L
import pytest
from callback_helpers import random_batches, tiny_causal_lm
from lightning.pytorch.loggers import CSVLogger
from tiny import quiet_trainer
from torch.utils.data import DataLoader

from recipes_lib.callbacks import ThroughputMonitor, TokenProgressBar
from recipes_lib.callbacks.progress import fit_fields
from recipes_lib.config.schema import SchedulerConfig

STEPS = 8
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def fit(bar: TokenProgressBar, **kwargs) -> L.Trainer:
    L.seed_everything(0)
    module = tiny_causal_lm(STEPS, SchedulerConfig(name="constant", warmup=0))
    loader = DataLoader(random_batches(4), batch_size=None)
    trainer = quiet_trainer(
        STEPS,
        [ThroughputMonitor(window=2), bar],
        log_every_n_steps=1,
        val_check_interval=4,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        **kwargs,
    )
    trainer.fit(module, loader, loader)
    return trainer


def test_fields_are_left_out_least_needed_first_until_the_line_fits():
    fields = [("step 120/1000", 0), ("loss 3.412", 2), ("val/loss 3.5", 5), ("52.1k tok/s", 4)]
    fields.append(("eta 0:04:10", 3))
    full = "step 120/1000 | loss 3.412 | val/loss 3.5 | 52.1k tok/s | eta 0:04:10"
    assert fit_fields(fields, 200) == full
    assert fit_fields(fields, len(full)) == full
    assert fit_fields(fields, 60) == "step 120/1000 | loss 3.412 | 52.1k tok/s | eta 0:04:10"
    assert fit_fields(fields, 45) == "step 120/1000 | loss 3.412 | eta 0:04:10"
    assert fit_fields(fields, 30) == "step 120/1000 | loss 3.412"
    assert fit_fields(fields, 13) == "step 120/1000"
    assert fit_fields(fields, 8) == "step 12…"  # the step alone, cut short
    for width in range(0, 90):
        assert len(fit_fields(fields, width)) <= width


@pytest.mark.parametrize("width", [40, 80])
def test_plain_lines_fit_the_console_and_name_no_epoch(tmp_path, capsys, width):
    fit(TokenProgressBar(plain=True, console_kwargs={"width": width}), default_root_dir=tmp_path)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == [f"step {s}/8" for s in range(1, 9)]
    assert all(len(line) <= width for line in lines), lines
    assert all("loss " in line for line in lines)
    assert not any("Epoch" in line or "v_num" in line for line in lines)


def test_live_line_is_one_line_that_fits_the_terminal(tmp_path):
    out = io.StringIO()
    console = {"file": out, "force_terminal": True, "width": 60, "color_system": None}
    bar = TokenProgressBar(refresh_rate=1000, leave=True, console_kwargs=console)
    trainer = fit(bar, default_root_dir=tmp_path)
    assert bar.is_enabled
    # each redraw is the line alone, rewritten in place: cursor moves aside, text lines
    lines = [line for line in re.split(r"[\r\n]", ANSI.sub("", out.getvalue())) if line.strip()]
    assert lines and all(len(line) <= 60 for line in lines), lines
    assert any("sanity check 1/1" in line for line in lines)
    assert any("validating 2/2" in line for line in lines)
    assert "step 8/8" in lines[-1] and "loss " in lines[-1]
    assert not any("Epoch" in line or "v_num" in line for line in lines)
    # with room, a bar leads the line; without, the line alone, still within the width
    module = trainer.lightning_module
    assert bar.live_text(trainer, module, 120).plain.startswith("━" * 20)
    for width in (20, 45, 80):
        assert bar.live_text(trainer, module, width).cell_len <= width


def test_metrics_leave_out_the_logger_version(tmp_path):
    bar = TokenProgressBar(plain=True)
    trainer = fit(bar, default_root_dir=tmp_path, logger=CSVLogger(tmp_path, name="run"))
    items = bar.get_metrics(trainer, trainer.lightning_module)
    assert "v_num" not in items and "train/loss" in items and "tok/s" in items
