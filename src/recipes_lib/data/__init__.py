"""Data, by pipeline: pretraining text (``text/``), chat for SFT (``chat/``) and
preference pairs for DPO (``preference/``).

What they share sits here: ``sources`` (which sources a run reads, their fingerprints,
the seeded hold-out, the cache), ``records`` (loading chat and preference records),
``chat_records`` (the base of both chat pipelines), ``tokenizer``, ``corpus`` (the
standard library every built-in source reads), ``module`` (the resumable data-module
base), ``sampler`` and ``mixture``. A pipeline imports only these and, for preference
pairs rendered as chats, ``chat/``. A leaf package: it never imports models, training or objectives.

The names below are imported on first use, so that importing one module of the package
(the tokenizer's file name, as the run folder's layout does) does not bring in the data
modules and, through them, Lightning.
"""

from __future__ import annotations

from recipes_lib.lazy import lazy_names

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing

# name -> the module it lives in, imported when the name is first used
_LAZY = {
    "stdlib_instruction_records": "recipes_lib.data.chat.instructions",
    "record_messages": "recipes_lib.data.chat.messages",
    "validate_messages": "recipes_lib.data.chat.messages",
    "ChatDataModule": "recipes_lib.data.chat.module",
    "ChatRenderer": "recipes_lib.data.chat.template",
    "render_chat": "recipes_lib.data.chat.template",
    "iter_stdlib_documents": "recipes_lib.data.corpus",
    "MixtureDataset": "recipes_lib.data.mixture",
    "PreferenceDataModule": "recipes_lib.data.preference.module",
    "stdlib_preference_records": "recipes_lib.data.preference.stdlib_pairs",
    "load_records": "recipes_lib.data.records",
    "ResumableSampler": "recipes_lib.data.sampler",
    "PretrainDataModule": "recipes_lib.data.text.module",
    "PackedSequenceDataset": "recipes_lib.data.text.packing",
    "PreparedData": "recipes_lib.data.text.prepare",
    "prepare": "recipes_lib.data.text.prepare",
    "RawSource": "recipes_lib.data.text.raw",
    "iter_texts": "recipes_lib.data.text.raw",
    "load_source": "recipes_lib.data.text.raw",
    "write_split_shards": "recipes_lib.data.text.shard_writer",
    "TokenShard": "recipes_lib.data.text.shards",
    "load_tokenizer": "recipes_lib.data.tokenizer",
    "save_tokenizer": "recipes_lib.data.tokenizer",
    "train_bpe_tokenizer": "recipes_lib.data.tokenizer",
}

__all__ = [
    "ChatDataModule",
    "ChatRenderer",
    "MixtureDataset",
    "PackedSequenceDataset",
    "PreferenceDataModule",
    "PreparedData",
    "PretrainDataModule",
    "RawSource",
    "ResumableSampler",
    "TokenShard",
    "iter_stdlib_documents",
    "iter_texts",
    "load_source",
    "load_records",
    "load_tokenizer",
    "prepare",
    "record_messages",
    "render_chat",
    "save_tokenizer",
    "stdlib_instruction_records",
    "stdlib_preference_records",
    "train_bpe_tokenizer",
    "validate_messages",
    "write_split_shards",
]


_getattr, _dir = lazy_names(globals(), _LAZY)


def __getattr__(name: str) -> object:
    return _getattr(name)


def __dir__() -> list[str]:
    return _dir()


if TYPE_CHECKING:  # what type checkers see; nothing is imported at run time
    from recipes_lib.data.chat.instructions import stdlib_instruction_records
    from recipes_lib.data.chat.messages import record_messages, validate_messages
    from recipes_lib.data.chat.module import ChatDataModule
    from recipes_lib.data.chat.template import ChatRenderer, render_chat
    from recipes_lib.data.corpus import iter_stdlib_documents
    from recipes_lib.data.mixture import MixtureDataset
    from recipes_lib.data.preference.module import PreferenceDataModule
    from recipes_lib.data.preference.stdlib_pairs import stdlib_preference_records
    from recipes_lib.data.records import load_records
    from recipes_lib.data.sampler import ResumableSampler
    from recipes_lib.data.text.module import PretrainDataModule
    from recipes_lib.data.text.packing import PackedSequenceDataset
    from recipes_lib.data.text.prepare import PreparedData, prepare
    from recipes_lib.data.text.raw import RawSource, iter_texts, load_source
    from recipes_lib.data.text.shard_writer import write_split_shards
    from recipes_lib.data.text.shards import TokenShard
    from recipes_lib.data.tokenizer import load_tokenizer, save_tokenizer, train_bpe_tokenizer
