"""DownstreamEval: what it refuses when built, and how it splits examples over ranks."""

from types import SimpleNamespace

import pytest

from recipes_lib.callbacks import DownstreamEval
from recipes_lib.errors import ConfigError
from recipes_lib.evaluation.builtin import stdlib_bodies


def test_it_keeps_the_first_examples_of_each_task():
    callback = DownstreamEval(["stdlib_bodies"], every_n_steps=10, limit=7)
    [task] = callback.tasks
    assert task.examples == stdlib_bodies().examples[:7]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tasks": ["stdlib_bodys"]}, "is not a built-in task"),
        ({"tasks": ["stdlib_bodies"], "every_n_steps": 0}, "every_n_steps=0"),
        ({"tasks": ["stdlib_bodies"], "limit": 0}, "limit must be >= 1"),
        ({"tasks": []}, "name at least one task"),
    ],
)
def test_bad_settings_are_refused_when_built(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DownstreamEval(**kwargs)


def test_lm_eval_tasks_are_left_to_recipes_eval(tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "t.yaml").write_text("task: mine\ndataset_path: json\noutput_type: multiple_choice\n")
    with pytest.raises(ConfigError, match="'mine' is an lm-eval task"):
        DownstreamEval([str(folder)])


def test_every_rank_scores_as_many_rows_and_each_example_counts_once():
    callback = DownstreamEval(["stdlib_bodies"], limit=7)
    [task] = callback.tasks
    seen, shares = [], []
    for rank in range(3):
        trainer = SimpleNamespace(global_rank=rank, world_size=3)
        share, counted = callback._rank_share(trainer, task)
        shares.append(len(share.examples))
        seen += share.examples[:counted]
    assert shares == [3, 3, 3]  # the same batches on every rank
    assert sorted(seen, key=task.examples.index) == list(task.examples)
