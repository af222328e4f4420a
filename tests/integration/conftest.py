"""Fixtures for end-to-end runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from integration_helpers import tiny_overrides

from recipes_lib.config import compose_config


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One tokenizer/shard cache for the whole session (prepared once, then reused)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny_cfg(tmp_path, shared_cache):
    def make(*extra: str):
        return compose_config(tiny_overrides(tmp_path, shared_cache, *extra))

    return make
