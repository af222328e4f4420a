"""Prompt batches for online RL: a resumable data module of prompt records.

A batch of ``B`` prompts (:func:`collate_prompts`) is::

    index           (B,)   int64  the prompts' indices in their dataset
    input_ids       (B, P) int64  the prompts, rendered with the chat template and the
                                  assistant header (ready to be continued), left-padded
                                  with 0 to the longest
    prompt_lengths  (B,)   int64  each prompt's tokens (the last ones of its row)
    records         list of B dicts: the records, whose fields the rewards read
    where           list of B str: each record's file and line (or source and index)

A prompt is ``data.chat.prompt_field`` (text, a user turn) or ``messages_field`` (a
conversation to continue, tool rounds included); a record's ``tools`` (JSON schemas, or
their list as JSON text) are given to the template, as in SFT, so the policy sees the
tools it may call. Prompts longer than ``data.seq_len - stage.grpo.max_new_tokens``
tokens leave no room for a completion: ``data.chat.truncation=left`` cuts their start,
otherwise they are skipped and counted.

Each batch is drawn ``stage.grpo.updates_per_batch`` times in a row (:class:`RepeatingSampler`),
once per optimizer step on its completions, so the position in the stream stays
``optimizer steps x batch size`` as for every objective, and a run resumed between two
of those steps starts again at the same batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from recipes_lib.config.schema import DataConfig, SourceConfig
from recipes_lib.data.chat.messages import TOOLS_FIELD, BadRecord, parse_tools, text_field
from recipes_lib.data.chat.template import ChatRenderer
from recipes_lib.data.chat_records import (
    ChatRecordsDataModule,
    PreparedChat,
    bad_record_error,
    check_chat_format,
)
from recipes_lib.data.module import check_batch_shape, rank_zero_warning
from recipes_lib.data.prompts.stdlib_task import stdlib_task_records
from recipes_lib.data.records import RecordBuiltin, record_where
from recipes_lib.data.sampler import ResumableSampler
from recipes_lib.data.sources import source_key
from recipes_lib.data.tokenizer import check_vocab_fits, eos_token_id
from recipes_lib.errors import ConfigError, DataError

DEFAULT_PROMPT_SOURCES = {"stdlib_grpo": SourceConfig(builtin="stdlib_grpo")}
PROMPT_BUILTINS: dict[str, RecordBuiltin] = {"stdlib_grpo": stdlib_task_records}


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, its record and where the record came from."""

    ids: list[int]
    record: dict[str, Any]
    where: str


class PromptDataset(Dataset):
    def __init__(self, prompts: Sequence[Prompt]) -> None:
        self.prompts = list(prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        prompt = self.prompts[index]
        return {"index": index, "prompt": prompt}


def collate_prompts(items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A batch as the module docstring describes it."""
    prompts = [item["prompt"] for item in items]
    width = max(len(p.ids) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt.ids) :] = torch.tensor(prompt.ids)
    return {
        "index": torch.tensor([int(item["index"]) for item in items], dtype=torch.long),
        "input_ids": input_ids,
        "prompt_lengths": torch.tensor([len(p.ids) for p in prompts], dtype=torch.long),
        "records": [p.record for p in prompts],
        "where": [p.where for p in prompts],
    }


def prompts_of(batch: Mapping[str, Any]) -> list[list[int]]:
    """The token ids of each prompt of a batch, without their padding."""
    rows, lengths = batch["input_ids"].tolist(), batch["prompt_lengths"].tolist()
    return [row[len(row) - n :] for row, n in zip(rows, lengths, strict=True)]


class RepeatingSampler(ResumableSampler):
    """A :class:`ResumableSampler` whose every run of ``batch_size`` draws comes
    ``repeats`` times in a row: draw ``p`` is the stream's draw
    ``(p // (batch_size * repeats)) * batch_size + p % batch_size``."""

    def __init__(self, *args: Any, batch_size: int, repeats: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size, self.repeats = batch_size, repeats

    def __iter__(self) -> Iterator[int]:
        group = self.batch_size * self.repeats
        while True:
            draw = (self.position // group) * self.batch_size + self.position % self.batch_size
            self.position += 1
            yield self.index_at(self.global_position(draw))


class PromptDataModule(ChatRecordsDataModule):
    """Batches of prompts (see the module docstring), resumable like every data module.

    Args:
        config: the data configuration (``data.chat`` for the fields and policies).
        model_vocab_size, model_max_seq_len, total_train_samples, tokenizer_path: as
            :class:`~recipes_lib.data.chat_records.ChatRecordsDataModule`.
        max_new_tokens: ``stage.grpo.max_new_tokens``; a prompt leaves room for them.
        repeats: ``stage.grpo.updates_per_batch``: the optimizer steps each batch serves.

    Raises:
        ConfigError: bad sizes or policies, or no room for a prompt.
    """

    default_sources = DEFAULT_PROMPT_SOURCES

    def __init__(
        self,
        config: DataConfig,
        model_vocab_size: int,
        model_max_seq_len: int,
        total_train_samples: int | None = None,
        tokenizer_path: str | None = None,
        *,
        max_new_tokens: int,
        repeats: int = 1,
    ) -> None:
        check_batch_shape(config, model_max_seq_len, min_seq_len=2)
        check_chat_format(config.chat)
        if config.seq_len - max_new_tokens < 1:
            raise ConfigError(
                f"data.seq_len={config.seq_len} leaves no room for a prompt before "
                f"stage.grpo.max_new_tokens={max_new_tokens} new tokens"
            )
        super().__init__(
            config,
            model_vocab_size,
            model_max_seq_len,
            total_train_samples,
            builtins=PROMPT_BUILTINS,
            tokenizer_path=tokenizer_path,
        )
        self.max_prompt_tokens = config.seq_len - max_new_tokens
        self.repeats = repeats
        self.eos_id: int | None = None
        self.skipped: Counter = Counter()

    def _text_fields(self) -> tuple[str, ...]:
        return (self.config.chat.prompt_field, self.config.chat.messages_field)

    def _encode(self, record: Mapping, renderer: ChatRenderer, where: str) -> list[int]:
        chat = self.config.chat
        # a conversation to continue, else a prompt (a loader gives every record both)
        field = chat.messages_field if record.get(chat.messages_field) else chat.prompt_field
        prompt = text_field(record, field, where)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        try:
            tools = parse_tools(record.get(TOOLS_FIELD))
        except ValueError as err:
            problem = f"{where}: field {TOOLS_FIELD!r} {err}"
            raise BadRecord(problem, f"malformed field {TOOLS_FIELD!r}") from None
        try:
            ids = renderer.render_prompt(messages, tools)
        except DataError as err:
            raise BadRecord(f"{where}: {err}", "template failed to render") from err
        if len(ids) <= self.max_prompt_tokens:
            return ids
        if chat.truncation == "left":
            return ids[len(ids) - self.max_prompt_tokens :]
        raise BadRecord(
            f"{where}: the prompt has {len(ids)} tokens, more than data.seq_len - "
            f"stage.grpo.max_new_tokens = {self.max_prompt_tokens}",
            f"prompt too long (data.chat.truncation={chat.truncation})",
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        tokenizer, template, tokenizer_path = self._load_tokenizer()
        check_vocab_fits(tokenizer, self.model_vocab_size)
        renderer = ChatRenderer.from_config(tokenizer, self.config, template, self.tokenizer_path)
        splits: dict[str, list[Prompt]] = {"train": [], "val": []}
        on_bad = self.config.chat.on_bad_record
        for name in self.sources:
            records, where_of = self._source_records(name), self._record_source(name)
            for split, indices in zip(("train", "val"), self._split(name), strict=True):
                for index in indices:
                    where = record_where(where_of, index)
                    try:
                        ids = self._encode(records[index], renderer, where)
                    except BadRecord as bad:
                        if on_bad == "error" and "data.chat.truncation" not in bad.reason:
                            raise bad_record_error(bad) from None
                        self.skipped[bad.reason] += 1
                        continue
                    splits[split].append(Prompt(ids, dict(records[index]), where))
        if self.skipped:
            reasons = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common())
            total = sum(self.skipped.values())
            rank_zero_warning(f"data.sources: skipped {total} prompts: {reasons}")
        if not splits["train"]:
            keys = [source_key(name) for name in self.sources]
            raise DataError(f"{keys}: no usable prompts for training ({dict(self.skipped)})")
        self.train_dataset = PromptDataset(splits["train"])
        self.val_dataset = PromptDataset(splits["val"]) if splits["val"] else None
        self.tokenizer = tokenizer
        self.eos_id = eos_token_id(tokenizer, self.config.tokenizer.eos_token)
        self.prepared = PreparedChat(
            tokenizer_path=Path(tokenizer_path).resolve(),
            fingerprint=self._data_fingerprint(tokenizer, renderer.template_text),
            chat_template=renderer.template_text,
        )

    def skipped_records(self) -> dict[str, int]:
        return dict(self.skipped) | self.oversized_skipped()

    def collate_fn(self):
        return collate_prompts

    def skip_samples(self, count: int) -> None:
        """Move on by ``count`` samples rounded up to whole groups of repeated batches,
        so the batches after a skip (a rollback's window) still come in groups that
        start where the optimizer steps' groups do."""
        group = self.config.batch_size * self.repeats
        super().skip_samples(-(-count // group) * group)

    def make_sampler(self, num_samples: int, **kwargs: Any) -> RepeatingSampler:
        """Each batch of the stream drawn ``stage.grpo.updates_per_batch`` times in a row."""
        return RepeatingSampler(
            num_samples, batch_size=self.config.batch_size, repeats=self.repeats, **kwargs
        )
