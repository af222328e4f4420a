"""Decoder models as plain ``nn.Module``s (this package never imports lightning)."""

from recipes_lib.models.llama import Transformer, TransformerBlock

__all__ = ["Transformer", "TransformerBlock"]
