"""Decoder models as plain ``nn.Module``s (this package never imports lightning)."""

from recipes_lib.models.llama import KVCache, Transformer, TransformerBlock

__all__ = ["KVCache", "Transformer", "TransformerBlock"]
