"""Data, by pipeline: pretraining text (``text/``), chat for SFT (``chat/``) and
preference pairs for DPO (``preference/``).

What they share sits here: ``sources`` (which sources a run reads, their fingerprints,
the seeded hold-out, the cache), ``records`` (loading chat and preference records),
``chat_records`` (the base of both chat pipelines), ``tokenizer``, ``corpus`` (the
standard library every built-in source reads), ``module`` (the resumable data-module
base), ``sampler`` and ``mixture``. A pipeline imports only these and, for preference
pairs rendered as chats, ``chat/``. A leaf package: it never imports models, training or objectives.
"""

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
