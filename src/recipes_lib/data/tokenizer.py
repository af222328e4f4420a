"""Byte-level BPE tokenizers: train one with ``tokenizers``, save it, load it, check it fits.

A trained tokenizer is GPT-2 style: text is split by the byte-level pre-tokenizer (so
every string round-trips, whatever its characters), merges are learned by
``BpeTrainer``, and the end-of-document token is the first special token, id 0.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from recipes_lib.config.schema import DataConfig
from recipes_lib.errors import ConfigError, DataError
from recipes_lib.files import write_text_atomic

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # transformers' tokenizer settings
# The turn delimiters of the built-in ``chatml`` template: a tokenizer trained for a chat
# run gets them as special tokens, so each is one token that masks cleanly.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TOKENS = (IM_START, IM_END)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    eos_token: str = "<|endoftext|>",
    max_bytes: int | None = None,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer.

    Args:
        texts: training documents.
        vocab_size: the largest vocabulary to learn (fewer when the text runs out of
            merges); the 256 byte symbols and ``eos_token`` count towards it.
        eos_token: the end-of-document token, given id 0.
        max_bytes: stop reading ``texts`` once this many UTF-8 bytes were taken
            (``None``: all of them).
        min_frequency: pairs seen fewer times are never merged.

    Raises:
        ConfigError: ``vocab_size`` cannot hold the byte alphabet and the EOS token.
        DataError: ``texts`` is empty.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError(
            f"data.tokenizer.vocab_size={vocab_size} is too small for a byte-level BPE "
            f"(needs at least {len(alphabet) + 1}: 256 bytes and the EOS token)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    counted = _CountingIterator(texts, max_bytes)
    tokenizer.train_from_iterator(counted, trainer=trainer)
    if counted.documents == 0:
        raise DataError("cannot train a tokenizer: the training text is empty")
    return tokenizer


class _CountingIterator(Iterator[str]):
    """Yields texts until ``max_bytes`` UTF-8 bytes were taken, counting what it gave."""

    def __init__(self, texts: Iterable[str], max_bytes: int | None) -> None:
        self._texts = iter(texts)
        self._max_bytes = max_bytes
        self.documents = 0
        self.bytes = 0

    def __next__(self) -> str:
        if self._max_bytes is not None and self.bytes >= self._max_bytes:
            raise StopIteration
        text = next(self._texts)
        encoded = text.encode("utf-8")
        if self._max_bytes is not None and self.bytes + len(encoded) > self._max_bytes:
            # Take the head of an oversized document rather than skipping it.
            encoded = encoded[: self._max_bytes - self.bytes]
            text = encoded.decode("utf-8", errors="ignore")
        self.documents += 1
        self.bytes += len(encoded)
        return text


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> Path:
    """Write ``tokenizer`` to ``path`` (a file name, or a directory to hold tokenizer.json).

    The file is written under a temporary name and renamed into place, so a reader never
    sees a partial file.
    """
    path = Path(path)
    if path.suffix != ".json":
        path = path / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, tokenizer.to_str())
    return path


def save_tokenizer_folder(
    folder: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    *,
    eos_token: str | None,
    pad_token: str | None = None,
    chat_template: str | None = None,
    model_max_length: int | None = None,
) -> Path:
    """Write a tokenizer as ``transformers`` reads one: ``tokenizer.json`` (a copy of
    ``tokenizer_path``) and ``tokenizer_config.json`` naming the fast tokenizer class,
    the EOS and padding tokens and the chat template. ``AutoTokenizer.from_pretrained(folder)``
    then renders conversations with ``apply_chat_template`` as training did. Each file is
    written under a temporary name and renamed into place.

    Args:
        folder: where to write (created if needed).
        tokenizer_path: a tokenizer.json, or a folder holding one.
        eos_token: the end-of-sequence token (``eos_token`` inside the template).
        pad_token: the padding token; default the ``pad_token`` of the
            tokenizer_config.json beside ``tokenizer_path``, else ``eos_token``: what the
            chat and preference data pad with.
        chat_template: the Jinja chat template; None writes none.
        model_max_length: the longest sequence the model takes.

    Returns:
        ``folder`` as a path.

    Raises:
        DataError: ``tokenizer_path`` holds no tokenizer, ``eos_token`` or ``pad_token``
            is not a token of it, or the tokenizer_config.json beside it is not JSON.
    """
    source = resolve_tokenizer_file(tokenizer_path, key="tokenizer")
    tokenizer = load_tokenizer(source, key="tokenizer")
    # read before writing: the folder written may be the one the tokenizer comes from
    pad_token = pad_token or _configured_token(source.parent / TOKENIZER_CONFIG_FILE, "pad_token")
    pad_token = pad_token or eos_token
    for name, token in (("eos_token", eos_token), ("pad_token", pad_token)):
        if token is not None and tokenizer.token_to_id(token) is None:
            raise DataError(f"{name}={token!r} is not a token of '{source}'")
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    target = out / TOKENIZER_FILE
    if not (target.exists() and target.resolve() == source.resolve()):
        write_text_atomic(target, source.read_text(encoding="utf-8"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
    }
    if pad_token is not None:
        config["pad_token"] = pad_token
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    config["clean_up_tokenization_spaces"] = False
    if chat_template is not None:
        config["chat_template"] = chat_template
    write_text_atomic(out / TOKENIZER_CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return out


def _configured_token(config_file: Path, name: str) -> str | None:
    """A special token a tokenizer_config.json names: text, or ``{"content": ...}``."""
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{config_file} is not readable JSON: {err}") from err
    token = config.get(name) if isinstance(config, dict) else None
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def resolve_tokenizer_file(path: str | os.PathLike, key: str = "data.tokenizer.path") -> Path:
    """The tokenizer.json that ``path`` names (the file itself, or one inside a directory).

    Raises:
        DataError: neither exists.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{key}: no tokenizer file at {path}")
    return path


def load_tokenizer(path: str | os.PathLike, key: str = "data.tokenizer.path") -> Tokenizer:
    """Load a tokenizer from a tokenizer.json file or a directory holding one.

    Raises:
        DataError: the file is missing or is not a valid tokenizer.json.
    """
    file = resolve_tokenizer_file(path, key)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises plain Exception on a malformed file
        raise DataError(f"{key}: {file} is not a valid tokenizer.json: {err}") from err


def eos_token_id(tokenizer: Tokenizer, eos_token: str, key: str = "data.tokenizer") -> int:
    """The id of ``eos_token``.

    Raises:
        DataError: the tokenizer has no such token.
    """
    token_id = tokenizer.token_to_id(eos_token)
    if token_id is None:
        raise DataError(
            f"{key}: tokenizer has no end-of-document token {eos_token!r}; "
            f"set {key}.eos_token to one of its special tokens"
        )
    return token_id


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """The embedding rows the tokenizer needs: its largest token id plus one."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def check_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Fail when the tokenizer can emit ids that the model's embedding has no row for.

    Raises:
        ConfigError: naming both sizes and both keys.
    """
    needed = tokenizer_vocab_size(tokenizer)
    if needed > model_vocab_size:
        raise ConfigError(
            f"data.tokenizer has a vocabulary of {needed} tokens, more than "
            f"model.vocab_size={model_vocab_size}; raise model.vocab_size to at least "
            f"{needed} or use a smaller tokenizer (data.tokenizer.vocab_size)"
        )


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """A content hash of the tokenizer (its canonical JSON serialisation)."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def tokenizer_beside(weights: str | None) -> Path | None:
    """The ``tokenizer.json`` in the folder of ``weights`` (a file or a folder), if any:
    where a pipeline stage leaves the tokenizer its output weights use."""
    if weights is None:
        return None
    path = Path(weights).expanduser()
    candidate = (path if path.is_dir() else path.parent) / TOKENIZER_FILE
    return candidate if candidate.is_file() else None


def init_tokenizer_path(
    config: DataConfig, init_from: str | None, key: str = "stage.init_from"
) -> str | None:
    """The tokenizer of a run: ``data.tokenizer.path`` when set; else, for a stage that
    starts from weights (``stage.init_from``, or the weights ``key`` names), the
    ``tokenizer.json`` beside them (a Hugging Face folder's, a stage's); else None (a
    tokenizer is trained on the data).

    Raises:
        ConfigError: ``init_from`` is set but has no tokenizer beside it.
    """
    if config.tokenizer.path is not None or init_from is None:
        return config.tokenizer.path
    found = tokenizer_beside(init_from)
    if found is None:
        raise ConfigError(
            f"{key}={init_from!r} has no tokenizer.json beside it; set "
            "data.tokenizer.path to the tokenizer its weights were trained with"
        )
    return str(found)
