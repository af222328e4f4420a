"""GPU tests write multi-GB checkpoints of 0.5-1B models: free each test's folder after it."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(autouse=True)
def _remove_large_outputs(tmp_path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)
