"""Data: raw loading, tokenizers, tokenized shards, packing, mixtures, resumable sampling.

A leaf package: it never imports models or stages.
"""

from recipes_lib.data.chat import ChatRenderer, record_messages, render_chat, validate_messages
from recipes_lib.data.chat_module import ChatDataModule
from recipes_lib.data.corpus import iter_stdlib_documents
from recipes_lib.data.instructions import stdlib_instruction_records
from recipes_lib.data.mixture import MixtureDataset
from recipes_lib.data.module import PretrainDataModule
from recipes_lib.data.packing import PackedSequenceDataset
from recipes_lib.data.preference import PreferenceDataModule, stdlib_preference_records
from recipes_lib.data.prepare import PreparedData, prepare
from recipes_lib.data.raw import RawSource, iter_texts, load_source
from recipes_lib.data.records import load_records
from recipes_lib.data.sampler import ResumableSampler
from recipes_lib.data.shards import TokenShard, write_split_shards
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
