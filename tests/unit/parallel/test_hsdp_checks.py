"""``strategy=hsdp``'s keys are refused, naming them, where they cannot work."""

from __future__ import annotations

import pytest

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.errors import ConfigError
from recipes_lib.preflight import check_strategy


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["strategy=hsdp", "strategy.replicas=3", "trainer.devices=4"],
            r"strategy.replicas=3 does not divide the 4 ranks",
        ),
        (["strategy=fsdp", "+strategy.replicas=2"], "strategy.replicas=2 is hsdp's"),
        (
            ["strategy=hsdp", "model=moe_tiny", "strategy.expert_parallel=true"],
            "strategy.expert_parallel=true needs strategy=fsdp",
        ),
    ],
)
def test_hsdp_settings_that_cannot_work_are_refused(overrides, match):
    cfg = to_run_config(compose_config(["recipe=pretrain/tiny", *overrides]))
    with pytest.raises(ConfigError, match=match):
        check_strategy(cfg)


def test_hsdp_on_four_devices_and_two_copies_passes():
    cfg = to_run_config(
        compose_config(
            ["recipe=pretrain/tiny", "strategy=hsdp", "strategy.replicas=2", "trainer.devices=4"]
        )
    )
    check_strategy(cfg)
