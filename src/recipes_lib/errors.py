"""Errors raised for bad input. Each message names the key, path, value or record at fault."""


class RecipesError(Exception):
    """Base class of every error recipes-lib raises for bad input."""


class ConfigError(RecipesError):
    """A config value, or a combination of values, that cannot run."""


class DataError(RecipesError):
    """A missing path, an empty dataset, a malformed record or a corrupt shard."""


class CheckpointError(RecipesError):
    """A checkpoint that is missing, corrupt or does not fit the configured model."""


class UnsupportedKernelError(ConfigError):
    """A kernel backend asked to do what it does not support, or that is not installed."""
