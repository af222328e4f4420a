"""Native multiple-choice tasks: records, the pair encoding, the metrics, the built-in task."""

import json

import pytest

from recipes_lib.data.tokenizer import train_bpe_tokenizer
from recipes_lib.errors import ConfigError, DataError
from recipes_lib.evaluation.builtin import N_CHOICES, stdlib_bodies
from recipes_lib.evaluation.choice import (
    ChoiceExample,
    ChoiceTask,
    choice_metrics,
    choice_outcomes,
    encode_pair,
    read_choice_file,
)
from recipes_lib.evaluation.tasks import read_task_folder, resolve_tasks


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_choice_file_reads_into_examples(tmp_path):
    record = {"context": "2 + 2 =", "choices": [" 4", " 5"], "answer": 0}
    task = read_choice_file(write_lines(tmp_path / "sums.jsonl", [json.dumps(record), ""]))
    assert task.name == "sums"
    assert task.examples == (ChoiceExample("2 + 2 =", (" 4", " 5"), 0),)


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", "not a JSON record"),
        ('["a"]', "is a JSON object"),
        ('{"context": "x", "choices": [" a", " b"]}', "no field 'answer'"),
        ('{"context": "x", "choices": [" a"], "answer": 0}', "at least two texts"),
        ('{"context": "x", "choices": [" a", " b"], "answer": 2}', "index of a choice"),
        ('{"context": "x", "choices": [" a", " b"], "answer": true}', "index of a choice"),
        ('{"context": "", "choices": [" a", " b"], "answer": 0}', "'context'"),
    ],
)
def test_a_malformed_record_is_named_by_file_and_line(tmp_path, line, match):
    good = json.dumps({"context": "x", "choices": [" a", " b"], "answer": 1})
    file = write_lines(tmp_path / "t.jsonl", [good, line])
    with pytest.raises(DataError, match=match) as err:
        read_choice_file(file)
    assert f"{file}:2:" in str(err.value)


def test_pairs_split_as_lm_eval_splits_them():
    tokenizer = train_bpe_tokenizer(["the cat sat on the mat " * 20], 300, "<|endoftext|>")
    request = encode_pair(tokenizer, "the cat ", "sat")
    # the trailing space moves to the continuation
    assert tokenizer.decode(list(request.context)) == "the cat"
    assert tokenizer.decode(list(request.continuation)) == " sat"


def test_acc_and_acc_norm_pick_by_raw_and_per_character_log_likelihood():
    task = ChoiceTask(
        "t",
        (ChoiceExample("q", ("a", "bbbbbbbbbb"), 1), ChoiceExample("q", ("a", "b"), 0)),
        "test",
    )
    # example 1: the short choice wins raw (-2 > -5), the long one per character
    scores = [(-2.0, False), (-5.0, False), (-1.0, False), (-3.0, False)]
    outcomes = choice_outcomes(task, scores)
    assert outcomes == [(False, True), (True, True)]
    assert choice_metrics(outcomes) == {"acc": 0.5, "acc_norm": 1.0}


def test_the_builtin_task_hides_the_real_body_among_reorderings_and_another():
    task = stdlib_bodies()
    assert len(task.examples) == 200
    assert task == stdlib_bodies()  # the same task every time
    answers = [e.answer for e in task.examples]
    assert set(answers) == set(range(N_CHOICES))  # the answer is not always in one place
    for example in task.examples:
        assert example.context.lstrip().startswith(("def ", "async def "))
        assert len(set(example.choices)) == N_CHOICES
        real = example.choices[example.answer]
        compile(example.context + real, "<body>", "exec")
        others = [c for i, c in enumerate(example.choices) if i != example.answer]
        same_lines = [c for c in others if sorted(c.splitlines()) == sorted(real.splitlines())]
        assert len(same_lines) == 2  # its own lines in two other orders, and one other body


def test_tasks_resolve_before_any_model_is_loaded(tmp_path):
    record = json.dumps({"context": "x", "choices": [" a", " b"], "answer": 1})
    jsonl = write_lines(tmp_path / "mine.jsonl", [record])
    refs = resolve_tasks(["stdlib_bodies", str(jsonl)])
    assert [(r.name, r.kind) for r in refs] == [("stdlib_bodies", "choice"), ("mine", "choice")]
    with pytest.raises(ConfigError, match="named twice"):
        resolve_tasks(["stdlib_bodies", "stdlib_bodies"])
    with pytest.raises(ConfigError, match="name at least one task"):
        resolve_tasks([])


def test_a_task_folder_with_a_bad_yaml_or_record_is_refused(tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "mc.yaml").write_text("task: mc\ndataset_path: json\n  bad: [indent\n")
    with pytest.raises(ConfigError, match="'mc.yaml' is not valid YAML"):
        read_task_folder(folder)
    (folder / "mc.yaml").write_text(
        "task: mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data.jsonl\n"
        "doc_to_text: '{{q}}'\n"
    )
    with pytest.raises(DataError, match="names data file 'data.jsonl', which is not there"):
        read_task_folder(folder)
    write_lines(folder / "data.jsonl", ['{"q": "a"}', '{"q": '])
    with pytest.raises(DataError, match=r"data.jsonl:2: not a JSON record"):
        read_task_folder(folder)
    write_lines(folder / "data.jsonl", ['{"q": "a"}'])
    assert read_task_folder(folder) == ["mc"]
    (folder / "mc.yaml").write_text("dataset_path: json\n")
    with pytest.raises(ConfigError, match="names no task"):
        read_task_folder(folder)


def test_without_lm_eval_a_misspelt_task_is_still_named(monkeypatch):
    """Without lm-evaluation-harness a name close to a built-in task is named as the
    typo it likely is, beside the install hint; any other name gets the hint alone."""
    import recipes_lib.evaluation.tasks as tasks

    def absent(folder):
        raise ConfigError("lm-eval's tasks need lm-evaluation-harness: pip install it")

    monkeypatch.setattr(tasks, "_lm_eval_names", absent)
    with pytest.raises(ConfigError, match=r"'stdlib_bodys' is not a built-in task") as typo:
        resolve_tasks(["stdlib_bodys"])
    assert "did you mean stdlib_bodies?" in str(typo.value)
    assert str(typo.value).endswith("; lm-eval's tasks need lm-evaluation-harness: pip install it")
    with pytest.raises(ConfigError, match=r"^lm-eval's tasks need lm-evaluation-harness"):
        resolve_tasks(["hellaswag"])
