"""LightningModules, one per training objective."""

from recipes_lib.stages.causal_lm import CausalLMModule

__all__ = ["CausalLMModule"]
