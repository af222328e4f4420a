"""Functions that moved keep their old import path, with a warning naming the new one."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("recipes_lib.checkpoint.hf", "export_hf_checkpoint", "recipes_lib.checkpoint.hf_export"),
        ("recipes_lib.checkpoint.hf", "hf_config_from_model", "recipes_lib.checkpoint.hf_export"),
        ("recipes_lib.checkpoint.hf", "hf_weight_files", "recipes_lib.checkpoint.hf_files"),
        ("recipes_lib.checkpoint.hf", "load_hf_tokenizer", "recipes_lib.checkpoint.hf_tokenizer"),
        ("recipes_lib.checkpoint.hf", "hf_chat_template", "recipes_lib.checkpoint.hf_tokenizer"),
        ("recipes_lib.checkpoint.hf", "hf_eos_token_ids", "recipes_lib.checkpoint.hf_tokenizer"),
        ("recipes_lib.checkpoint.weights", "chmod_as_umask", "recipes_lib.files"),
        ("recipes_lib.train", "check_init_source", "recipes_lib.preflight.stage"),
    ],
)
def test_old_import_path_works_and_warns(old, name, new):
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} has moved to {new}\.{name}"):
        found = getattr(importlib.import_module(old), name)
    assert found is getattr(importlib.import_module(new), name)


def test_from_import_of_the_old_path_warns_at_the_importing_line():
    with pytest.warns(DeprecationWarning) as caught:
        from recipes_lib.checkpoint.hf import export_hf_checkpoint  # noqa: F401
    assert caught[0].filename == __file__


def test_other_missing_names_are_attribute_errors():
    hf = importlib.import_module("recipes_lib.checkpoint.hf")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_function'"):
        hf.no_such_function  # noqa: B018
    with pytest.raises(ImportError):
        from recipes_lib.checkpoint.hf import no_such_function  # noqa: F401
