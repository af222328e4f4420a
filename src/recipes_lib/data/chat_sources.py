"""Records of SFT and preference sources, and the tokenizer a chat run uses.

The SFT and the preference data modules share what is here: the texts a tokenizer is
trained on, the identity of their sources and examples, the tokenizer of a chat run and
saving it with its chat template beside a run's output weights. Loading and splitting
their records is :mod:`recipes_lib.data.records`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from recipes_lib.config.schema import DataConfig, SourceConfig
from recipes_lib.data.chat import CHATML_TOKENS
from recipes_lib.data.instructions import stdlib_instruction_records
from recipes_lib.data.prepare import resolve_cache_dir
from recipes_lib.data.raw import source_fingerprint, source_kind
from recipes_lib.data.records import RecordBuiltin
from recipes_lib.data.tokenizer import (
    TOKENIZER_FILE,
    load_tokenizer,
    resolve_tokenizer_file,
    save_tokenizer,
    save_tokenizer_folder,
    tokenizer_sha256,
    train_bpe_tokenizer,
)
from recipes_lib.errors import DataError

SFT_BUILTINS: dict[str, RecordBuiltin] = {"stdlib_sft": stdlib_instruction_records}


def records_fingerprint(name: str, source: SourceConfig) -> str:
    """A cheap identity of a record source (names cached tokenizers)."""
    if source_kind(name, source) != "builtin":
        return source_fingerprint(name, source)
    identity = {k: v for k, v in asdict(source).items() if k != "weight"}
    identity["python"] = sys.version
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def sources_fingerprint(sources: Mapping[str, SourceConfig]) -> str:
    """The identity of a mixture of record sources (see :func:`records_fingerprint`)."""
    fingerprints = {name: records_fingerprint(name, s) for name, s in sorted(sources.items())}
    return hashlib.sha256(json.dumps(fingerprints).encode()).hexdigest()


def chat_data_fingerprint(
    config: DataConfig, sources: str, tokenizer: Tokenizer, template: str
) -> str:
    """The identity of a chat run's examples: its sources (:func:`sources_fingerprint`),
    tokenizer, chat settings and template, sequence length, split and seed."""
    identity = {
        "sources": sources,
        "tokenizer": tokenizer_sha256(tokenizer),
        "chat": asdict(config.chat),
        "template": template,
        "seq_len": config.seq_len,
        "val_fraction": config.val_fraction,
        "seed": config.seed,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def record_texts(records: Iterable[Any], fields: Sequence[str] | None = None) -> Iterator[str]:
    """Every piece of text in the records' ``fields`` (default: all of them), plain or
    as the ``content`` of chat messages: what a tokenizer for them is trained on.
    Records that are not mappings are passed over (loading reports them)."""
    for record in records:
        if not isinstance(record, Mapping):
            continue
        values = record.values() if fields is None else (record.get(f) for f in fields)
        for value in values:
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):
                yield from (
                    m["content"]
                    for m in value
                    if isinstance(m, Mapping) and isinstance(m.get("content"), str)
                )


def load_chat_tokenizer(
    config: DataConfig,
    training_texts: Callable[[], Iterable[str]],
    fingerprint: str,
) -> tuple[Tokenizer, str | None, Path]:
    """The tokenizer of a chat run, its own chat template, and its file.

    ``data.tokenizer.path`` (a tokenizer.json or a Hugging Face folder, whose template
    comes along; a pipeline stage gets the previous stage's here), or else a byte-level
    BPE trained on ``training_texts`` and cached under ``data.cache_dir``, with the
    ChatML tokens (``<|im_start|>``, ``<|im_end|>``) added as special tokens within
    ``data.tokenizer.vocab_size``.

    Raises:
        DataError: a missing or invalid tokenizer file.
    """
    settings = config.tokenizer
    if settings.path is not None:
        file = resolve_tokenizer_file(settings.path).resolve()
        return load_tokenizer(file), tokenizer_chat_template(file.parent), file
    identity = json.dumps(
        {"tokenizer": asdict(settings), "sources": fingerprint, "chat_tokens": CHATML_TOKENS},
        sort_keys=True,
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    path = resolve_cache_dir(config.cache_dir) / "tokenizers" / f"chat-{digest}" / TOKENIZER_FILE
    if not path.is_file():
        tokenizer = train_bpe_tokenizer(
            _limited(training_texts(), settings.train_max_bytes),
            settings.vocab_size - len(CHATML_TOKENS),
            settings.eos_token,
        )
        tokenizer.add_special_tokens(list(CHATML_TOKENS))
        save_tokenizer(tokenizer, path)
    return load_tokenizer(path, key=f"tokenizer cache {path.parent}"), None, path


def save_chat_tokenizer(
    folder: str | Path,
    tokenizer_path: str | Path,
    tokenizer: Tokenizer,
    config: DataConfig,
    *,
    chat_template: str | None,
    model_max_length: int | None = None,
) -> Path:
    """Write a chat run's tokenizer and the chat template it rendered with into
    ``folder`` as transformers reads them (see
    :func:`recipes_lib.data.tokenizer.save_tokenizer_folder`), so that
    ``apply_chat_template`` there gives the token ids training used. The EOS token is
    ``data.tokenizer.eos_token``, left out when the tokenizer has no such token.
    """
    eos_token: str | None = config.tokenizer.eos_token
    if tokenizer.token_to_id(eos_token) is None:
        eos_token = None
    return save_tokenizer_folder(
        folder,
        tokenizer_path,
        eos_token=eos_token,
        chat_template=chat_template,
        model_max_length=model_max_length,
    )


class SavesChatTokenizer:
    """Mixin of the chat data modules (SFT, preference pairs): :meth:`save_tokenizer`.

    Uses the module's ``prepared`` (``tokenizer_path``, ``chat_template``, set in
    ``setup``), ``tokenizer``, ``config`` and ``model_max_seq_len``.
    """

    def save_tokenizer(self, folder: str | Path) -> Path:
        """Write the tokenizer and the chat template this run renders with into
        ``folder`` (``tokenizer.json`` and transformers' ``tokenizer_config.json``), so
        the run's output weights carry what their conversations looked like.

        Raises:
            RuntimeError: called before ``setup``.
        """
        prepared, tokenizer = getattr(self, "prepared", None), getattr(self, "tokenizer", None)
        if prepared is None or tokenizer is None:
            raise RuntimeError("call setup() before save_tokenizer()")
        return save_chat_tokenizer(
            folder,
            prepared.tokenizer_path,
            tokenizer,
            self.config,  # type: ignore[attr-defined]
            chat_template=prepared.chat_template,
            model_max_length=self.model_max_seq_len,  # type: ignore[attr-defined]
        )


def tokenizer_chat_template(folder: Path) -> str | None:
    """The chat template stored beside a tokenizer, as ``transformers`` saves it:
    ``chat_template`` of ``tokenizer_config.json``, else ``chat_template.jinja``.

    Raises:
        DataError: tokenizer_config.json is not readable JSON.
    """
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            template = json.loads(config_file.read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError) as err:
            raise DataError(
                f"data.tokenizer.path: {config_file} is not readable JSON: {err}"
            ) from err
        if isinstance(template, list):  # named templates: "default" wins
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str):
            return template
    jinja_file = folder / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


def _limited(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    taken = 0
    for text in texts:
        if taken >= max_bytes:
            return
        taken += len(text.encode("utf-8"))
        yield text
