"""Which tasks an evaluation names, resolved and checked before any model is loaded.

A task is named as one of:

- a built-in task (:data:`~recipes_lib.evaluation.builtin.BUILTIN_TASKS`), scored
  natively;
- a ``.jsonl`` file of multiple-choice records (:mod:`recipes_lib.evaluation.choice`),
  scored natively, named after the file;
- a folder of lm-eval task YAMLs with their data (every task in it), or the name of a
  task in a folder given as ``task_dirs``;
- any other name: a task of lm-eval's own registry (needs ``recipes-lib[eval]``).

Every problem is one line naming the task: an unknown name (with the closest known
ones), a folder whose YAML does not parse or names no task, a data file it names that
is missing, or a record that is not JSON (as ``file:line``).
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from recipes_lib.errors import ConfigError, DataError
from recipes_lib.evaluation.builtin import BUILTIN_TASKS, builtin_task
from recipes_lib.evaluation.choice import ChoiceTask, read_choice_file

EVAL_EXTRA = "pip install 'recipes-lib[eval]'"


@dataclass(frozen=True)
class TaskRef:
    """A resolved task: ``kind`` is ``choice`` (native; ``task`` holds it) or
    ``lm_eval`` (``name`` in lm-eval's registry, or in ``folder``)."""

    name: str
    kind: str
    task: ChoiceTask | None = None
    folder: Path | None = None


class _AnyTagLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs for checking: tags such as ``!function`` are kept as text
    (lm-eval resolves them itself when it builds the task)."""


_AnyTagLoader.add_multi_constructor(
    "!",
    lambda loader, suffix, node: (
        loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else None
    ),
)


def _data_files(config: dict[str, Any]) -> list[str]:
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, str):
        return [files]
    if isinstance(files, list):
        return [f for f in files if isinstance(f, str)]
    if isinstance(files, dict):
        found = []
        for value in files.values():
            if isinstance(value, str):
                found.append(value)
            elif isinstance(value, list):
                found += [v for v in value if isinstance(v, str)]
        return found
    return []


def _check_json_lines(file: Path) -> None:
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{file}:{number}: not a JSON record ({err.msg})") from err


def read_task_folder(folder: Path) -> list[str]:
    """The task names a folder of lm-eval YAMLs declares, after checking each YAML and
    the local data files it names.

    Raises:
        ConfigError / DataError: one line naming the folder's file at fault.
    """
    names: list[str] = []
    files = sorted(folder.glob("*.yaml")) + sorted(folder.glob("*.yml"))
    if not files:
        raise ConfigError(f"task folder '{folder}': no task YAML in it")
    for file in files:
        try:
            config = yaml.load(file.read_text(encoding="utf-8"), Loader=_AnyTagLoader)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"task folder '{folder}': '{file.name}' is not valid YAML: "
                f"{' '.join(str(err).split())}"
            ) from err
        if not isinstance(config, dict):
            raise ConfigError(f"task folder '{folder}': '{file.name}' is not a mapping")
        # a group names its tasks in `task`; its own name is `group`
        name = config.get("group") if isinstance(config.get("group"), str) else config.get("task")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"task folder '{folder}': '{file.name}' names no task (key 'task')")
        for data in _data_files(config):
            path = folder / data
            if "://" in data or any(c in data for c in "*?["):
                continue  # remote or a glob: datasets resolves it
            if not path.is_file():
                raise DataError(
                    f"task folder '{folder}': '{file.name}' names data file '{data}', which "
                    "is not there"
                )
            if path.suffix == ".jsonl":
                _check_json_lines(path)
        names.append(name)
    return names


@functools.cache
def _lm_eval_names(folder: Path | None) -> list[str]:
    try:
        from recipes_lib.evaluation.harness import lm_eval_task_names
    except ImportError as err:
        where = f"the tasks of '{folder}'" if folder else "lm-eval's tasks"
        raise ConfigError(f"{where} need lm-evaluation-harness: {EVAL_EXTRA}") from err
    return lm_eval_task_names(folder)


def resolve_tasks(tasks: Sequence[str], task_dirs: Sequence[str | Path] = ()) -> list[TaskRef]:
    """Resolve task names, files and folders (see the module docstring).

    Raises:
        ConfigError / DataError: one line naming the first task that cannot be used.
    """
    if not tasks:
        raise ConfigError("tasks: name at least one task to evaluate")
    folders: dict[str, Path] = {}
    for entry in task_dirs:
        folder = Path(entry).expanduser().resolve()
        if not folder.is_dir():
            raise ConfigError(f"task_dirs: '{entry}' is not a folder")
        for name in read_task_folder(folder):
            folders[name] = folder
    refs: list[TaskRef] = []
    registry: list[str] | None = None
    for entry in tasks:
        path = Path(str(entry)).expanduser()
        if entry in BUILTIN_TASKS:
            refs.append(TaskRef(entry, "choice", builtin_task(entry)))
        elif str(entry).endswith(".jsonl"):
            task = read_choice_file(path)
            refs.append(TaskRef(task.name, "choice", task))
        elif path.is_dir():
            folder = path.resolve()
            declared = read_task_folder(folder)
            known = set(_lm_eval_names(folder))
            for name in declared:
                if name not in known:
                    raise ConfigError(
                        f"task folder '{folder}': lm-eval does not load task {name!r}"
                    )
                refs.append(TaskRef(name, "lm_eval", folder=folder))
        elif entry in folders:
            refs.append(TaskRef(entry, "lm_eval", folder=folders[entry]))
        else:
            absent = None  # without lm-eval, a name close to a task here is still named
            try:
                registry = registry if registry is not None else _lm_eval_names(None)
            except ConfigError as err:
                registry, absent = [], err
            if entry not in registry:
                close = difflib.get_close_matches(str(entry), [*BUILTIN_TASKS, *folders, *registry])
                if absent is not None and not close:
                    raise absent
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(
                    f"task {entry!r} is not a built-in task ({', '.join(BUILTIN_TASKS)}), a "
                    f".jsonl file, a task folder or an lm-eval task{hint}"
                    + (f"; {absent}" if absent is not None else "")
                )
            refs.append(TaskRef(entry, "lm_eval"))
    names = [r.name for r in refs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"task {duplicates[0]!r} is named twice")
    return refs
