"""DownstreamEval: what it refuses when built, and how it splits examples over ranks."""

import json
from types import SimpleNamespace

import pytest

from recipes_lib.callbacks import DownstreamEval
from recipes_lib.errors import ConfigError, RecipesError
from recipes_lib.evaluation.builtin import stdlib_bodies


def test_it_keeps_the_first_examples_of_each_task():
    callback = DownstreamEval(["stdlib_bodies"], every_n_steps=10, limit=7)
    [task] = callback.tasks
    assert task.examples == stdlib_bodies().examples[:7]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tasks": ["gone.jsonl"]}, "choice task 'gone.jsonl': no such file"),
        ({"tasks": ["stdlib_bodies"], "every_n_steps": 0}, "every_n_steps=0"),
        ({"tasks": ["stdlib_bodies"], "limit": 0}, "limit must be >= 1"),
        ({"tasks": []}, "name at least one task"),
    ],
)
def test_bad_settings_are_refused_when_built(kwargs, match):
    with pytest.raises(RecipesError, match=match):
        DownstreamEval(**kwargs)


def test_lm_eval_tasks_are_left_to_recipes_eval(tmp_path):
    pytest.importorskip("lm_eval")  # without it the folder's tasks are refused as unreadable
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "t.yaml").write_text("task: mine\ndataset_path: json\noutput_type: multiple_choice\n")
    with pytest.raises(ConfigError, match="'mine' is an lm-eval task"):
        DownstreamEval([str(folder)])


def test_every_rank_scores_as_many_requests_and_each_example_counts_once(tmp_path):
    # examples of 5, 2 and 3 choices: the ranks' own requests differ in number
    records = [
        {"context": f"q{i}", "choices": [f" {c}" for c in "abcde"[:n]], "answer": 0}
        for i, n in enumerate([5, 2, 3, 2, 2])
    ]
    file = tmp_path / "mixed.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in records))
    callback = DownstreamEval([str(file)])
    [task] = callback.tasks
    seen, rows = [], []
    for rank in range(2):
        trainer = SimpleNamespace(global_rank=rank, world_size=2)
        share, counted, most = callback._rank_share(trainer, task)
        assert counted == sum(len(e.choices) for e in share.examples)
        rows.append(most)
        seen += share.examples
    assert rows == [10, 10]  # rank 0: 5 + 3 + 2, rank 1: 2 + 2 (padded to 10)
    assert sorted(seen, key=task.examples.index) == list(task.examples)
