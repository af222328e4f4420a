"""LightningModules, one per training objective."""

from recipes_lib.stages.causal_lm import CausalLMModule
from recipes_lib.stages.dpo import DPOModule
from recipes_lib.stages.sft import SFTModule

__all__ = ["CausalLMModule", "DPOModule", "SFTModule"]
