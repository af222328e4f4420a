"""A package's public names imported on first use (PEP 562): the package's
``__getattr__`` and ``__dir__`` over a table of name -> module, so importing the
package does not import what its names live in (torch, Lightning) until one is used."""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any


def lazy_names(
    namespace: dict[str, Any], names: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``:
    a name of ``names`` is imported from its module on first use and kept in
    ``namespace``, so later lookups skip the function."""

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
