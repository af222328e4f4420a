"""The typed configs of the single-job console scripts (``recipes-generate``,
``recipes-eval``, ``recipes-export``) and how their command lines are read.

Each command is a Hydra app over its primary config (``conf/generate.yaml``,
``conf/eval.yaml``, ``conf/export.yaml``), whose first default is its dataclass here, so
every value is typed and ``--help`` lists the keys with their defaults. Two things
differ from Hydra's own reading of ``key=value`` (:func:`command_line`):

- a text or path key (``prompt``, ``checkpoint``, ...) is taken as written, so a prompt
  may hold commas, quotes, brackets or ``${`` (``null`` still clears an optional one);
- a list key takes comma-separated items (``tasks=hellaswag,arc_easy``) as well as
  Hydra's ``tasks=[hellaswag,arc_easy]``.

Before Hydra composes anything, an override is refused in one line when it names a key
the command does not have (with the closest one), holds a value of the wrong type, or
cannot be read at all (:func:`check_command_overrides`).
"""

from __future__ import annotations

import enum
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes_lib.config.overrides import first_line, unknown_key, wrong_value
from recipes_lib.errors import ConfigError


class Dtype(enum.Enum):
    """``dtype=``: ``auto`` keeps the weights' stored dtype."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    def torch_dtype(self) -> Any:
        """The ``torch.dtype`` (None for ``auto``)."""
        import torch

        return None if self is Dtype.auto else getattr(torch, self.value)


def _required(form: str) -> Any:
    """A field the command line must set; ``form`` is how its error spells it."""
    return field(default=MISSING, metadata={"form": form})


@dataclass
class GenerateConfig:
    """``recipes-generate``: print ``prompt`` and the model's continuation of it.

    Attributes:
        checkpoint: a ``.ckpt``, a stage or run folder, its weights, or a Hugging Face
            folder.
        prompt: the text to continue (empty: the model starts a document).
        max_new_tokens: the most tokens to generate.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_p: nucleus sampling mass.
        seed: seeds the sampling (null: unseeded).
        tokenizer: a tokenizer.json or a folder holding one (null: found beside the
            checkpoint).
        device: ``auto`` (a GPU when there is one), ``cpu``, ``cuda``, ``cuda:1``...
        dtype: the parameters' dtype.
    """

    checkpoint: str = _required("PATH")
    prompt: str = ""
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    tokenizer: str | None = None
    device: str = "auto"
    dtype: Dtype = Dtype.auto


@dataclass
class EvalConfig:
    """``recipes-eval``: score a checkpoint on tasks, print a table, write JSON.

    Attributes:
        checkpoint: as ``recipes-generate`` takes it.
        tasks: built-in tasks, ``.jsonl`` choice files, task folders and lm-eval
            task names.
        task_dirs: folders of lm-eval task YAMLs whose tasks ``tasks`` may name.
        limit: the first examples of each task only (null: all).
        batch_size: the most rows per forward pass.
        batch_tokens: the most padded tokens per forward pass.
        num_fewshot: few-shot examples of lm-eval tasks (null: each task's own).
        chat_template: render lm-eval prompts with the model's chat template.
        tokenizer: as ``recipes-generate`` takes it.
        device: as ``recipes-generate`` takes it.
        dtype: the parameters' dtype (``auto``: bfloat16 on a GPU, else as stored).
        output: a JSON file for the results (null: none).
        seed: lm-eval's seeds (few-shot sampling).
    """

    checkpoint: str = _required("PATH")
    tasks: list[str] = _required("NAME[,NAME...]")
    task_dirs: list[str] = field(default_factory=list)
    limit: int | None = None
    batch_size: int = 256
    batch_tokens: int = 32768
    num_fewshot: int | None = None
    chat_template: bool = False
    tokenizer: str | None = None
    device: str = "auto"
    dtype: Dtype = Dtype.auto
    output: str | None = None
    seed: int = 0


@dataclass
class ExportConfig:
    """``recipes-export``: any checkpoint as a Hugging Face folder, checked.

    Attributes:
        checkpoint: a run folder, its weights, a manifest, a ``.ckpt`` or a sharded
            checkpoint folder.
        out: the folder to write.
        tokenizer: as ``recipes-generate`` takes it.
        dtype: the dtype to store.
        check: load the folder with transformers and compare logits after writing.
    """

    checkpoint: str = _required("PATH")
    out: str = _required("PATH")
    tokenizer: str | None = None
    dtype: Dtype = Dtype.auto
    check: bool = True


# primary config (conf/<name>.yaml) -> the schema it lists first as <name>_schema
COMMANDS: dict[str, type] = {
    "generate": GenerateConfig,
    "eval": EvalConfig,
    "export": ExportConfig,
}


def register_command_schemas() -> None:
    """Store each command's dataclass as ``<command>_schema`` in the ConfigStore."""
    from hydra.core.config_store import ConfigStore

    for name, schema in COMMANDS.items():
        ConfigStore.instance().store(name=f"{name}_schema", node=schema)


def to_command_config(cfg: DictConfig, schema: type) -> Any:
    """The composed ``cfg`` as a ``schema`` instance.

    Raises:
        ConfigError: a required key is not set (``checkpoint: required; pass
            checkpoint=PATH``), or a value does not fit its type.
    """
    for f in fields(schema):
        if OmegaConf.is_missing(cfg, f.name):
            raise ConfigError(f"{f.name}: required; pass {f.name}={f.metadata['form']}")
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(first_line(err)) from err


# ------------------------------------------------------------ reading the command line
def _field_kinds(schema: type) -> tuple[set[str], set[str], set[str]]:
    """The names of ``schema``'s text fields, of those that may be null, and of its list
    fields."""
    text, nullable, lists = set(), set(), set()
    for name, hint in typing.get_type_hints(schema).items():
        args = set(typing.get_args(hint))
        if hint is str or args == {str, type(None)}:
            text.add(name)
            if type(None) in args:
                nullable.add(name)
        elif typing.get_origin(hint) is list:
            lists.add(name)
    return text, nullable, lists


def quoted(text: str) -> str:
    """``text`` as a quoted Hydra override value that reads back as ``text`` exactly.

    Hydra unescapes a backslash only before a quote or at the end of the value, and
    OmegaConf only before ``${``; everything else is as written.
    """
    out = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), text)
    out = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", out)
    return f"'{out}'"


def command_line(argv: Sequence[str], schema: type) -> list[str]:
    """``argv`` with the values of ``schema``'s text keys quoted and its list keys'
    comma-separated items bracketed, for Hydra to read as written (module docstring)."""
    text, nullable, lists = _field_kinds(schema)
    out = []
    for item in argv:
        key, sep, value = item.partition("=")
        if sep and key in text and not (value == "null" and key in nullable):
            item = f"{key}={quoted(value)}"
        elif sep and key in lists and not value.startswith("["):
            items = [quoted(v.strip()) for v in value.split(",") if v.strip()]
            item = f"{key}=[{','.join(items)}]"
        out.append(item)
    return out


def check_command_overrides(overrides: Sequence[str], schema: type) -> None:
    """Refuse the first override (as :func:`command_line` wrote it) that Hydra cannot
    read, that names a key ``schema`` does not have, or whose value ``schema`` cannot
    hold. Overrides of ``hydra`` and deletions (``~key``) are left to Hydra.

    Raises:
        ConfigError: ``<override>: <why>``, e.g. ``temprature=1: no such key (did you
            mean temperature?)``.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as err:
            lines = str(err).strip().splitlines()
            reason = lines[1] if len(lines) > 1 else first_line(err)
            raise ConfigError(f"{text}: not key=value ({reason})") from err
        key = override.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or override.is_delete():
            continue
        why = unknown_key(key, schema)
        if why is not None:
            raise ConfigError(f"{text}: {why}")
        if override.is_sweep_override():
            raise ConfigError(f"{text}: a sweep; this command runs one job")
        why = wrong_value(key, override.value(), schema)
        if why is not None:
            raise ConfigError(f"{text}: {why}")
