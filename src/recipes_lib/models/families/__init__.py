"""Model families: each one module holding the options its architecture turns on and its
Hugging Face adapter (``model_type`` values, ``config.json`` mapping, tensor names).

``model.family`` names the family; it is never guessed from a flag. Adding a family is
one module here, one entry in :data:`FAMILIES`, presets in ``conf/model/`` and a parity
test against transformers (see "Adding a model family" in the README).
"""

from __future__ import annotations

from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.models.families.base import Family, TensorNames
from recipes_lib.models.families.llama import LLAMA
from recipes_lib.models.families.olmo2 import OLMO2
from recipes_lib.models.families.phi3 import PHI3
from recipes_lib.models.families.qwen2 import QWEN2
from recipes_lib.models.families.qwen3 import QWEN3
from recipes_lib.models.families.smollm3 import SMOLLM3

FAMILIES: dict[str, Family] = {
    family.name: family for family in (LLAMA, QWEN2, QWEN3, OLMO2, SMOLLM3, PHI3)
}
GUIDE = "README.md, 'Adding a model family'"


def get_family(name: str) -> Family:
    """The family ``model.family`` names.

    Raises:
        ConfigError: an unknown family.
    """
    if name not in FAMILIES:
        raise ConfigError(f"model.family={name!r} is not one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_hf(model_type: object) -> Family:
    """The family that reads a ``config.json`` of ``model_type``.

    Raises:
        CheckpointError: no family reads it (the supported ones are listed).
    """
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    supported = ", ".join(f"{t} ({f.name})" for f in FAMILIES.values() for t in f.hf_model_types)
    raise CheckpointError(
        f"model_type={model_type!r} is not supported; supported: {supported}; to add a "
        f"family see {GUIDE}"
    )


__all__ = ["FAMILIES", "Family", "TensorNames", "family_of_hf", "get_family"]
