"""Model families: each one module holding the options its architecture turns on and its
Hugging Face adapter (``model_type`` values, ``config.json`` mapping, tensor names).

``model.family`` names the family; it is never guessed from a flag. Adding a family is
one module here, one entry in :data:`FAMILIES`, presets in ``conf/model/`` and a parity
test against transformers (see "Adding a model family" in docs/models.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recipes_lib.config.model import BLOCK_OPTIONS, block_option_defaults
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.models.families.base import Family, TensorNames, refuse
from recipes_lib.models.families.deepseek_v3 import DEEPSEEK_V3
from recipes_lib.models.families.gemma3 import GEMMA3
from recipes_lib.models.families.glm4_moe import GLM4_MOE
from recipes_lib.models.families.gpt_oss import GPT_OSS
from recipes_lib.models.families.llama import LLAMA
from recipes_lib.models.families.mixtral import MIXTRAL
from recipes_lib.models.families.olmo2 import OLMO2
from recipes_lib.models.families.olmo3 import OLMO3
from recipes_lib.models.families.olmoe import OLMOE
from recipes_lib.models.families.phi3 import PHI3
from recipes_lib.models.families.qwen2 import QWEN2
from recipes_lib.models.families.qwen3 import QWEN3
from recipes_lib.models.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from recipes_lib.models.families.qwen3_moe import QWEN3_MOE
from recipes_lib.models.families.smollm3 import SMOLLM3

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        LLAMA,
        QWEN2,
        QWEN3,
        OLMO2,
        OLMO3,
        SMOLLM3,
        PHI3,
        GEMMA3,
        QWEN3_MOE,
        QWEN3_5,
        QWEN3_5_MOE,
        OLMOE,
        MIXTRAL,
        GPT_OSS,
        DEEPSEEK_V3,
        GLM4_MOE,
    )
}
GUIDE = "docs/models.md, 'Adding a model family'"


def get_family(name: str) -> Family:
    """The family ``model.family`` names.

    Raises:
        ConfigError: an unknown family.
    """
    if name not in FAMILIES:
        raise ConfigError(f"model.family={name!r} is not one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def check_family(config: ModelConfig) -> Family:
    """The family ``model.family`` names, after checking that ``config`` is one of its
    models: each block option at the family's value (its fixed one, or the default) or
    one it reads, and the family's own rules.

    Raises:
        ConfigError: an unknown family, or an option it cannot have, in one line naming
            the key, the family's value and the families that have the one given.
    """
    family = get_family(config.family)
    defaults = block_option_defaults()
    for option in BLOCK_OPTIONS:
        value = getattr(config, option)
        want = family.fixed.get(option, defaults[option])
        if option in family.reads or value == want:
            continue
        others = [
            f.name
            for f in FAMILIES.values()
            if option in f.reads or f.fixed.get(option, defaults[option]) == value
        ]
        elsewhere = f"; model.family={' | '.join(others)} can have it" if others else ""
        raise refuse(family.name, option, value, f"{family.name} has {want!r}{elsewhere}")
    family.check(config)
    return family


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


__all__ = ["FAMILIES", "Family", "TensorNames", "check_family", "family_of_hf", "get_family"]
