"""Image-text folders whose text tower is one of a family's models.

Some published causal LMs come only inside an image-text checkpoint: the official
Gemma 3 4B, 12B and 27B folders are ``Gemma3ForConditionalGeneration`` (``model_type``
``gemma3``), a text decoder of ``model_type`` ``gemma3_text`` beside a vision tower and
a projector. A family declares such a folder once (:attr:`Family.image_text`): the
``model_type`` and architecture of the folder, the key of its text config and the
prefixes its text tensors carry. The library trains the text tower as the family's own
model; everything else in the folder is copied through when it is written back
(``recipes_lib.checkpoint.hf_image_text``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ImageText:
    """How an image-text folder holds a family's text model.

    Attributes:
        model_type: the folder's ``config.json`` ``model_type`` (``gemma3``).
        architecture: its ``architectures`` entry (``Gemma3ForConditionalGeneration``).
        text_model_type: the text tower's ``model_type``, which the family reads
            (``gemma3_text``); a text config that names none is of this type.
        text_key: the key of the text tower's config inside ``config.json``.
        text_defaults: the values a text config may leave out (published folders
            write only what differs from transformers' defaults).
        text_prefixes: ``(folder prefix, text model prefix)`` pairs: a folder tensor
            whose name starts with the first is the text model's tensor with the
            second instead (``language_model.model.layers.0...`` is
            ``model.layers.0...``). Tensors that match none belong to the rest of the
            folder (the vision tower, the projector).
    """

    model_type: str
    architecture: str
    text_model_type: str
    text_key: str = "text_config"
    text_defaults: Mapping[str, Any] = field(default_factory=dict)
    text_prefixes: tuple[tuple[str, str], ...] = ()

    def text_config(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """The text tower's ``config.json`` entries with the defaults filled in, or
        None when the folder declares no text tower."""
        text = config.get(self.text_key)
        if not isinstance(text, Mapping) or not text:
            return None
        return {**self.text_defaults, "model_type": self.text_model_type, **text}

    def text_name(self, name: str) -> str | None:
        """The text model's name of a folder tensor, or None for the rest of the folder."""
        for folder_prefix, text_prefix in self.text_prefixes:
            if name.startswith(folder_prefix):
                return text_prefix + name.removeprefix(folder_prefix)
        return None
