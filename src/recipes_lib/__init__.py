"""recipes-lib: Lightning-based, Hydra-composed recipes for training language models."""

__version__ = "0.1.0"
