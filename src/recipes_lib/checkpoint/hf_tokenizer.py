"""The tokenizer of a Hugging Face folder: ``tokenizer.json``, its chat template (in
``tokenizer_config.json``, ``chat_template.jinja`` or ``chat_template.json``) and the
end-of-sequence ids generation stops at."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from recipes_lib.checkpoint.hf_files import HF_CONFIG_NAME
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.errors import CheckpointError

HF_TOKENIZER_CONFIG_NAME = "tokenizer_config.json"


def read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"'{file}' is not readable JSON: {err}") from err
    return data if isinstance(data, dict) else {}


def token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: text, or ``{"content": ...}``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _template_text(template: Any) -> str | None:
    """A chat template as stored: a string, or a list of named ones (``default`` wins)."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def load_hf_tokenizer(path: str | os.PathLike) -> tuple[Tokenizer, str | None]:
    """The tokenizer of a Hugging Face folder and its chat template, if it has one.

    The template is read from ``tokenizer_config.json``, or from ``chat_template.jinja``
    or ``chat_template.json`` (where transformers 5 saves it).

    Raises:
        DataError: the folder holds no valid tokenizer.json.
    """
    folder = Path(path).expanduser()
    tokenizer = load_tokenizer(folder, key="tokenizer")
    return tokenizer, hf_chat_template(folder if folder.is_dir() else folder.parent)


def hf_chat_template(folder: str | os.PathLike) -> str | None:
    """The chat template saved in a tokenizer folder, if any: ``chat_template`` of
    ``tokenizer_config.json``, else ``chat_template.jinja`` or ``chat_template.json``
    (where transformers 5 saves it).

    Raises:
        CheckpointError: one of those files is not readable JSON.
    """
    folder = Path(folder).expanduser()
    template = _template_text(read_json(folder / HF_TOKENIZER_CONFIG_NAME).get("chat_template"))
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is None:
        template = _template_text(read_json(folder / "chat_template.json").get("chat_template"))
    return template


def hf_eos_token_ids(path: str | os.PathLike, tokenizer: Tokenizer) -> list[int]:
    """The end-of-sequence ids of a Hugging Face folder (possibly several, as Llama 3's).

    Looked up in ``generation_config.json``, then ``config.json``, then the
    ``eos_token`` of ``tokenizer_config.json``; empty when none names one.
    """
    folder = Path(path).expanduser()
    for file in ("generation_config.json", HF_CONFIG_NAME):
        ids = read_json(folder / file).get("eos_token_id")
        if ids is not None:
            return [int(i) for i in (ids if isinstance(ids, list) else [ids])]
    token = token_text(read_json(folder / HF_TOKENIZER_CONFIG_NAME).get("eos_token"))
    token_id = tokenizer.token_to_id(token) if token is not None else None
    return [] if token_id is None else [token_id]


def first_special_token(tokenizer: Tokenizer) -> str | None:
    specials = [
        (i, t.content) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
    ]
    return min(specials)[1] if specials else None
