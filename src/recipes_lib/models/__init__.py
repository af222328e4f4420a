"""Decoder models as plain ``nn.Module``s (this package never imports lightning): the
decoder (``transformer``), RoPE (``rope``), decoding state (``kv_cache``) and the model
families with their Hugging Face adapters (``families``)."""

from recipes_lib.models.blocks import TransformerBlock
from recipes_lib.models.kv_cache import KVCache
from recipes_lib.models.transformer import Transformer

__all__ = ["KVCache", "Transformer", "TransformerBlock"]
