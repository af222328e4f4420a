"""Values refused by check_run_config before anything is built, naming the key."""

from __future__ import annotations

import pytest

from recipes_lib.config import compose_config
from recipes_lib.errors import ConfigError
from recipes_lib.train import run

FLOAT_KEYS = [
    "optim.lr",
    "optim.eps",
    "optim.weight_decay",
    "scheduler.min_lr_ratio",
    "trainer.gradient_clip_val",
    "model.norm_eps",
    "model.rope_theta",
    "stage.dpo.beta",
    "data.val_fraction",
]


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_non_finite_floats_are_refused_naming_the_key(tmp_path, key, value):
    cfg = compose_config(
        [
            "recipe=pretrain/tiny",
            f"run.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"{key}={value}",
        ]
    )
    # a nan passes every `<= 0` check, so optim.lr=nan used to train on
    with pytest.raises(ConfigError, match=rf"^{key}={value} must be a finite number$"):
        run(cfg)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_non_finite_beta_is_refused_naming_the_list(tmp_path):
    cfg = compose_config(["recipe=pretrain/tiny", f"run.dir={tmp_path}", "optim.betas=[0.9,nan]"])
    with pytest.raises(ConfigError, match=r"^optim\.betas=\[0\.9, nan\] must hold finite numbers$"):
        run(cfg)
