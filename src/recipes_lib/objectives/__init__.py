"""One module per training objective, each ending in its :class:`ObjectiveSpec`, and the
registry that looks them up by name (:mod:`recipes_lib.objectives.registry`).

The registry imports the built-in objectives when one is first asked for; importing this
package imports none of them, so the run schema reads their settings
(:mod:`.settings`, free of torch) without them. Shared parts live beside them
(:mod:`.pairs`: two sequences per example against a frozen reference; :mod:`.preference`:
the module of the pair objectives; :mod:`.sft`'s chat helpers); an objective composes
them, never subclassing another objective.
"""

from recipes_lib.objectives.registry import (
    FrozenModel,
    ObjectiveSpec,
    build_data,
    build_module,
    get_objective,
    objective_names,
    objective_of,
    register_objective,
)

__all__ = [
    "FrozenModel",
    "ObjectiveSpec",
    "build_data",
    "build_module",
    "get_objective",
    "objective_names",
    "objective_of",
    "register_objective",
]
