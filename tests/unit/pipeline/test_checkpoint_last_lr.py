"""The last learning rate a Lightning checkpoint records, new format and old."""

import pytest

from recipes_lib.pipeline.handoff import checkpoint_last_lr


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [
        ({"last_lr": 1.5e-4, "lr_schedulers": [{"_last_lr": [9.0]}]}, 1.5e-4),
        # written before the stage module recorded it: the scheduler's own state
        ({"lr_schedulers": [{"_last_lr": [2e-4, 2e-4]}]}, 2e-4),
        ({"lr_schedulers": []}, None),
        ({}, None),
    ],
)
def test_last_lr_from_the_module_else_from_the_scheduler_state(checkpoint, expected):
    assert checkpoint_last_lr(checkpoint) == expected
