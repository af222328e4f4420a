"""The config reference page, generated from the typed schema and the shipped YAML.

Two sources, both read as they are at build time, so the page cannot drift from the code:

- every group folder under ``conf/`` (``recipe`` is ``recipes/``), each option with the
  first sentence of the comment its YAML opens with, and the root default of the group;
- the dataclasses under :class:`recipes_lib.config.schema.RunConfig`, walked field by
  field: each key with its type, its default and the comment written beside or above it
  in the source.

Run ``python docs/gen/config_reference.py`` to print the page.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
SKIPPED_GROUPS = {"hydra"}  # Hydra's own logging and launchers: not a run's config
FIELD_LINE = re.compile(r"^    (\w+): ")
# groups whose files live or act elsewhere, said in their heading
GROUP_TITLES = {"recipe": "`recipe` (`recipes/`)", "pipeline": "`pipeline` (`recipes-pipeline`)"}


def render() -> str:
    from recipes_lib.config.schema import RunConfig

    lines = [
        "# Config reference",
        "",
        "Generated from `conf/` and the schema (`src/recipes_lib/config/`) each time the site",
        "is built. A group option is chosen with `group=option` (`optim=muon`); a key is set",
        "with `group.key=value` (`optim.lr=1e-3`). A key's default here is the schema's; the",
        "option a group defaults to (in `conf/config.yaml`) and the recipe usually set others,",
        "and `recipes-train recipe=... --cfg job` prints the composed result.",
        "",
        "## Groups and their options",
        "",
    ]
    defaults = _root_defaults()
    groups = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_"))
    for group in groups:
        if group in SKIPPED_GROUPS:
            continue
        default = defaults.get(group)
        lines += [f"### {GROUP_TITLES.get(group, f'`{group}`')}", ""]
        if default:
            lines += [f"Default: `{default}`.", ""]
        lines += ["| option | what it is |", "|---|---|"]
        for name, summary in _options(CONF / group):
            lines.append(f"| `{name}` | {_cell(summary)} |")
        lines.append("")

    lines += ["## Keys", ""]
    for group in dataclasses.fields(RunConfig):
        lines += [f"### `{group.name}.*`", ""]
        kind = _resolve(RunConfig, group)
        if dataclasses.is_dataclass(kind):
            doc = inspect.getdoc(kind)
            if doc:
                lines += [_markdown(doc), ""]
            lines += ["| key | type | default | note |", "|---|---|---|---|"]
            lines += _rows(kind, group.name)
        else:
            lines += [
                f"Named `_target_` nodes: `+{group.name}.NAME={{_target_: ...}}` adds one,",
                f"`~{group.name}.NAME` removes one; see",
                "[Recipes and config groups](../recipes-and-config.md).",
            ]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _root_defaults() -> dict[str, str]:
    """The option each group takes in ``conf/config.yaml``'s defaults list."""
    text = (CONF / "config.yaml").read_text()
    found = {}
    for match in re.finditer(r"^\s*-\s*(\w+):\s*([\w./-]+)", text, re.M):
        if match[2] != "null":
            found[match[1]] = match[2]
    return found


def _options(folder: Path) -> list[tuple[str, str]]:
    options = []
    for path in sorted(folder.rglob("*.yaml")):
        name = path.relative_to(folder).with_suffix("").as_posix()
        options.append((name, _first_sentence(_leading_comment(path))))
    return options


def _leading_comment(path: Path) -> str:
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("@package"):
            continue
        words.append(text)
    return " ".join(words)


def _first_sentence(text: str) -> str:
    match = re.match(r"(.+?\.)(\s|$)", text)
    return match[1] if match else text


def _rows(kind: type, prefix: str) -> list[str]:
    rows = []
    notes = _field_notes(kind)
    for item in dataclasses.fields(kind):
        key = f"{prefix}.{item.name}"
        resolved = _resolve(kind, item)
        if dataclasses.is_dataclass(resolved):
            rows += _rows(resolved, key)
            continue
        note = _cell(notes.get(item.name, ""))
        rows.append(f"| `{key}` | `{item.type}` | {_default(item)} | {note} |")
    return rows


def _resolve(owner: type, item: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(owner)
    return hints.get(item.name, item.type)


def _default(item: dataclasses.Field) -> str:
    if item.default is not dataclasses.MISSING:
        value = item.default
    elif item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
    else:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    # a table cell's code span keeps its pipes as they are (the table does not split it)
    return f"`{repr(value) if isinstance(value, str) and not value else value}`"


def _field_notes(kind: type) -> dict[str, str]:
    """Each field's comment in the class source: the one on its line, after those above it."""
    notes: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(kind).splitlines():
        stripped = line.strip()
        if line.startswith("    #") and not line.startswith("     "):
            above.append(stripped.lstrip("#").strip())
            continue
        match = FIELD_LINE.match(line)
        if match:
            beside = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            notes[match[1]] = " ".join([*above, beside]).strip()
        if stripped:
            above = []
    return notes


def _markdown(text: str) -> str:
    """A docstring as Markdown: reST's double backquotes as code, roles dropped."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    text = re.sub(r"(?<![\w`])(_\w+_)(?![\w`])", r"`\1`", _markdown(text))
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


if __name__ == "__main__":
    print(render(), end="")
