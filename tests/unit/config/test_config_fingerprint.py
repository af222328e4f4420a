"""What a rerun compares with the config a run recorded: everything but where it runs,
how it reports and how it is watched."""

from __future__ import annotations

from omegaconf import OmegaConf

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.fingerprint import recorded_config_changes


def _config(run_dir, *overrides):
    return to_run_config(compose_config(["recipe=pretrain/tiny", f"run.dir={run_dir}", *overrides]))


def _record(cfg, path):
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # as a run writes it
    return path


def test_changed_keys_are_listed_and_location_keys_ignored(tmp_path):
    recorded = _record(_config(tmp_path / "run"), tmp_path / "config.yaml")
    assert recorded_config_changes(_config(tmp_path / "run"), recorded) == []
    location = ("data.num_workers=3", "trainer.enable_progress_bar=false", "run.ckpt_path=last")
    watched = ("callbacks.watchdog.minutes=90",)
    assert recorded_config_changes(_config(tmp_path / "run", *location, *watched), recorded) == []
    # the folder moved: its paths inside the config (checkpoint dirpath...) move with it
    assert recorded_config_changes(_config(tmp_path / "moved"), recorded) == []
    changed = _config(tmp_path / "run", "optim.lr=0.5", "trainer.max_steps=7")
    assert recorded_config_changes(changed, recorded) == [
        "optim.lr: 0.003 -> 0.5",
        "trainer.max_steps: 300 -> 7",
    ]


def test_the_watchdog_writes_the_stacks_file_the_layout_names(tmp_path):
    for group in ("default", "minimal"):
        cfg = _config(tmp_path, f"callbacks={group}")
        template = cfg.callbacks["watchdog"]["stacks_file"]
        assert template.format(rank=2) == str(RunDir(tmp_path).hang_stacks(2))
