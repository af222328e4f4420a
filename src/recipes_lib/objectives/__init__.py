"""One module per training objective, each ending in its :class:`ObjectiveSpec`, and the
registry that looks them up by name (:mod:`recipes_lib.objectives.registry`).

Importing this package registers the built-in objectives. Shared parts live beside them
(:mod:`.pairs`: two sequences per example against a frozen reference; :mod:`.preference`:
the module of the pair objectives; :mod:`.sft`'s chat helpers); an objective composes
them, never subclassing another objective.
"""

from recipes_lib.objectives import (  # noqa: F401 - each registers its spec
    distill,
    dpo,
    grpo,
    kto,
    orpo,
    pretrain,
    reward,
    sft,
    simpo,
)
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
