"""The last learning rate a Lightning checkpoint records for the next stage."""

import pytest

from recipes_lib.pipeline.handoff import checkpoint_last_lr


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [
        ({"last_lr": 1.5e-4, "lr_schedulers": [{"_last_lr": [9.0]}]}, 1.5e-4),
        # only what the training module records counts, not the scheduler's internals
        ({"lr_schedulers": [{"_last_lr": [2e-4, 2e-4]}]}, None),
        ({"last_lr": None}, None),
        ({}, None),
    ],
)
def test_last_lr_is_what_the_module_recorded(checkpoint, expected):
    assert checkpoint_last_lr(checkpoint) == expected
