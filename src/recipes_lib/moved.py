"""Old import paths of functions that moved to another module, kept working.

A module whose functions moved sets ``__getattr__ = moved_from(__name__, {...})``; an
import from the old path then gets the function from its new module, with a
``DeprecationWarning`` naming the new path (shown where the user's code imports it).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved_from(old: str, new_homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for module ``old``: each name of ``new_homes`` is
    looked up in the module it maps to, with a DeprecationWarning; any other name is an
    AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        home = new_homes.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} has moved to {home}.{name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__
