"""The machinery every objective shares: the base LightningModule and its step, the one
build order, the training guard, rollbacks, the stage's output weights, a mixture's
expert load and the frozen reference."""

from recipes_lib.training.module import CausalLMModule

__all__ = ["CausalLMModule"]
