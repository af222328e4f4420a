"""The public API (``recipes_lib.__all__``) changes only with a line in CHANGELOG.md.

``public_api.txt`` beside this file records the API of the last release: ``name: what it is``
per line, with its signature (a class with its bases and constructor). At each release the
``Unreleased`` section of CHANGELOG.md gets the release's number and the record is
written again (``python tests/unit/test_public_api.py``).

Between releases, every name that was added, removed, or whose line differs from the
record must appear in backticks in the ``Unreleased`` section. The check is by name
only: it does not judge what the line says, but no change to the API can pass without
the changelog naming what changed.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest

import recipes_lib

RECORD = Path(__file__).with_name("public_api.txt")
CHANGELOG = Path(__file__).parents[2] / "CHANGELOG.md"


def describe(value: object) -> str:
    """What a public name is: ``def (signature)``, ``class (bases) (signature)``, or the
    type of a constant (its value may change: ``__version__``)."""
    if inspect.isclass(value):
        bases = ", ".join(b.__name__ for b in value.__bases__)
        try:
            init = f" {inspect.signature(value)}"
        except ValueError:  # an exception class without an __init__ of its own
            init = ""
        return f"class ({bases}){init}"
    if callable(value):
        return f"def {inspect.signature(value)}"
    return type(value).__name__


def current_api() -> dict[str, str]:
    return {name: describe(getattr(recipes_lib, name)) for name in recipes_lib.__all__}


def recorded_api() -> dict[str, str]:
    """``name: description`` lines, one per name."""
    lines = [line for line in RECORD.read_text().splitlines() if line.strip()]
    return dict(line.split(": ", 1) for line in lines)


def unreleased_section() -> str:
    text = CHANGELOG.read_text()
    match = re.search(r"^## Unreleased\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"{CHANGELOG} has no '## Unreleased' section"
    return match.group(1)


def test_every_public_name_resolves():
    for name in recipes_lib.__all__:
        assert hasattr(recipes_lib, name), f"recipes_lib.__all__ names {name}, which is missing"
    assert sorted(recipes_lib.__all__) == recipes_lib.__all__, "keep __all__ sorted"


def test_api_changes_since_the_record_are_in_the_changelog():
    now, then = current_api(), recorded_api()
    changed = sorted(n for n in now.keys() | then.keys() if now.get(n) != then.get(n))
    unreleased = unreleased_section()
    missing = [n for n in changed if f"`{n}`" not in unreleased]
    assert not missing, (
        f"the public API changed ({', '.join(missing)}) and CHANGELOG.md's Unreleased section "
        "does not name it: add a line naming each in backticks. At a release, write the "
        "record again: python tests/unit/test_public_api.py"
    )


def test_the_check_fails_on_an_unlisted_change(monkeypatch):
    """The check above can fail: a new public name unknown to the changelog is caught."""
    monkeypatch.setattr(recipes_lib, "__all__", [*recipes_lib.__all__, "no_such_entry"])
    monkeypatch.setattr(recipes_lib, "no_such_entry", lambda x: x, raising=False)
    with pytest.raises(AssertionError, match="no_such_entry"):
        test_api_changes_since_the_record_are_in_the_changelog()


if __name__ == "__main__":  # write the record of the API as it is now (at a release)
    api = sorted(current_api().items())
    RECORD.write_text("".join(f"{name}: {line}\n" for name, line in api))
    print(f"wrote {RECORD} ({len(recipes_lib.__all__)} names)", file=sys.stderr)
