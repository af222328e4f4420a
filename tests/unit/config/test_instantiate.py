"""The instantiate wrapper builds the targets of a kind and names the key of a bad argument."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from recipes_lib.config import instantiate, instantiate_dict
from recipes_lib.config.instantiate import CALLBACKS, LOGGERS
from recipes_lib.errors import ConfigError


def test_builds_an_allowlisted_target():
    node = OmegaConf.create(
        {"_target_": "lightning.pytorch.callbacks.ModelCheckpoint", "save_last": True}
    )
    cb = instantiate(node, "callbacks.checkpoint", CALLBACKS)
    assert isinstance(cb, ModelCheckpoint)
    assert cb.save_last is True


def test_refuses_a_target_outside_the_allowlist():
    with pytest.raises(
        ConfigError, match=r"callbacks.evil._target_: 'os.system' is not a callback"
    ):
        instantiate({"_target_": "os.system", "command": "true"}, "callbacks.evil", CALLBACKS)


def test_unknown_argument_is_named_with_its_key():
    node = {"_target_": "lightning.pytorch.callbacks.ModelCheckpoint", "save_lst": True}
    with pytest.raises(ConfigError, match=r"callbacks.checkpoint.save_lst: not an argument"):
        instantiate(node, "callbacks.checkpoint", CALLBACKS)


def test_unimportable_target_is_named():
    with pytest.raises(ConfigError, match=r"logger.x._target_: cannot import"):
        instantiate({"_target_": "lightning.pytorch.loggers.NoSuchLogger"}, "logger.x", LOGGERS)


def test_named_dict_skips_null_entries():
    nodes = {
        "a": {"_target_": "lightning.pytorch.callbacks.ModelCheckpoint"},
        "removed": None,
    }
    built = instantiate_dict(nodes, "callbacks", CALLBACKS)
    assert len(built) == 1 and isinstance(built[0], ModelCheckpoint)
