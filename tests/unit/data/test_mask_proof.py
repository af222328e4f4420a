"""The mask proof: transformers' rendering of each family's chat format against the
library's, token for token and trained token for trained token.

The families' templates and tiny tokenizers come from ``tests/chat_families.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from chat_families import (
    FAMILIES,
    ChatFamily,
    multi_turn_records,
    plain_records,
    reasoning_records,
    tool_records,
    write_family_tokenizer,
    write_records,
)

from recipes_lib.config.schema import ChatFormatConfig, DataConfig, TokenizerConfig
from recipes_lib.data.chat.module import ChatDataModule
from recipes_lib.data.chat.proof import (
    MaskProofError,
    ReferenceRenderer,
    conversation_of,
    hf_tokenizer,
    library_rendering,
    prove_chat_data,
    prove_records,
    sample_indices,
)
from recipes_lib.data.chat.template import BUILTIN_TEMPLATES
from recipes_lib.errors import ConfigError

pytest.importorskip("transformers")

SHAPES = ("plain", "multi_turn", "tools", "reasoning")
END_OF_TURN = {  # what each family's trained runs end with
    "qwen3": ("<|im_end|>",),
    "qwen3_no_think": ("<|im_end|>",),
    "qwen3_5": ("<|im_end|>",),
    "llama3_1": ("<|eot_id|>",),
    "gemma3": ("<end_of_turn>",),
    "mistral": ("</s>",),
    "gpt_oss": ("<|return|>", "<|end|>", "<|call|>"),
    "smollm3": ("<|im_end|>",),
    "smollm3_no_think": ("<|im_end|>",),
}

_SWITCH = "the run gives its template no enable_thinking switch yet"
# the run's key for its template's switches, where the chat settings have one
_SWITCH_KEY = next(
    (k for k in ("template_kwargs", "enable_thinking") if hasattr(ChatFormatConfig(), k)), None
)


def _records(family: ChatFamily, shape: str) -> list[dict] | None:
    if shape == "tools":
        return tool_records() if family.tools else None
    if shape == "reasoning":
        field = family.reasoning_field
        return reasoning_records(field) if field else None
    return plain_records() if shape == "plain" else multi_turn_records()


def _cases() -> list:
    cases = []
    for name, family in FAMILIES.items():
        for shape in SHAPES:
            if _records(family, shape) is None:
                continue
            marks = []
            if family.template_kwargs and _SWITCH_KEY is None:  # both sides would ignore it
                marks = [pytest.mark.skip(reason=_SWITCH)]
            cases.append(pytest.param(name, shape, marks=marks, id=f"{name}-{shape}"))
    return cases


def _data_module(
    tmp_path: Path,
    family: ChatFamily,
    records: list[dict],
    template: str | None = None,
    **chat_settings,
) -> ChatDataModule:
    folder = write_family_tokenizer(tmp_path / "tokenizer", family, template)
    path = write_records(tmp_path / "chat.jsonl", records)
    chat = ChatFormatConfig(**chat_settings)
    if _SWITCH_KEY == "template_kwargs":
        chat = replace(chat, template_kwargs=dict(family.template_kwargs))
    elif _SWITCH_KEY == "enable_thinking":
        chat = replace(chat, enable_thinking=family.template_kwargs.get("enable_thinking"))
    config = DataConfig(
        chat=chat,
        path=str(path),
        tokenizer=TokenizerConfig(path=str(folder), eos_token=family.eos),
        seq_len=1024,
        val_fraction=0.0,
        cache_dir=str(tmp_path / "cache"),
        seed=0,
    )
    datamodule = ChatDataModule(config, model_vocab_size=1024, model_max_seq_len=4096)
    datamodule.setup("fit")
    return datamodule


def _reference(tmp_path: Path, family: ChatFamily, train_on: str = "all") -> ReferenceRenderer:
    folder = write_family_tokenizer(tmp_path / f"ref-{family.name}", family)
    tokenizer = hf_tokenizer(folder / "tokenizer.json", family.eos)
    return ReferenceRenderer(tokenizer, family.text, family.template_kwargs, train_on)


def _trained_runs(reference: ReferenceRenderer, record: dict) -> list[str]:
    """The reference's trained tokens of ``record``, decoded, one string per run."""
    messages, tools = conversation_of(record, DataConfig())
    rendering = reference.render(messages, tools)
    runs: list[str] = []
    previous = False
    for token, trained in zip(rendering.input_ids, rendering.trained, strict=True):
        if trained:
            piece = reference.tokenizer.decode([token])
            runs[-1:] = [runs[-1] + piece] if previous else [*runs[-1:], piece]
        previous = trained
    return runs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_reference_trains_each_assistant_turn_through_its_end_of_turn(tmp_path, name):
    """The reference alone (no library code): one trained run per assistant turn,
    holding the turn's text and ending at the family's end-of-turn token; no user or
    tool text trained; turns before the last left out under train_on=last."""
    family = FAMILIES[name]
    reference = _reference(tmp_path, family)
    last_only = _reference(tmp_path, family, train_on="last")
    for shape in SHAPES:
        records = _records(family, shape) or []
        for record in records:
            messages, _ = conversation_of(record, DataConfig())
            answers = [m for m in messages if m["role"] == "assistant"]
            runs = _trained_runs(reference, record)
            assert len(runs) == len(answers), (shape, runs)
            for run, answer in zip(runs, answers, strict=True):
                assert run.endswith(END_OF_TURN[name]), (shape, run)
                assert answer["content"].strip() in run
                for call in answer.get("tool_calls", []):
                    assert call["function"]["arguments"]["city"] in run
            others = [m["content"] for m in messages if m["role"] in ("user", "tool")]
            assert not any(text in "".join(runs) for text in others), (shape, runs)
            last = _trained_runs(last_only, record)
            assert last == runs[-1:], (shape, last)


@pytest.mark.parametrize("train_on", ["all", "last"])
@pytest.mark.parametrize(("name", "shape"), _cases())
def test_the_library_masks_as_transformers_does(tmp_path, name, shape, train_on):
    family = FAMILIES[name]
    records = _records(family, shape)
    assert records is not None
    datamodule = _data_module(tmp_path, family, records, train_on=train_on)
    (line,) = prove_chat_data(datamodule, 10)
    assert f"{len(records)} record(s): token ids and trained tokens equal" in line


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "gpt_oss", "smollm3"])
def test_without_reasoning_trains_each_answer_but_not_its_reasoning(tmp_path, name):
    """train_on=without_reasoning: the reasoning kept in the rendering is read, not
    trained; each answer is still trained through its end-of-turn token."""
    family = FAMILIES[name]
    assert family.reasoning_field is not None
    records = reasoning_records(family.reasoning_field)
    datamodule = _data_module(tmp_path, family, records, train_on="without_reasoning")
    (source,) = datamodule.sources
    rows = datamodule._source_records(source)
    assert datamodule.renderer is not None
    for index, record in enumerate(records):
        ours = library_rendering(
            rows, index, datamodule.renderer, datamodule.config, datamodule._record_source(source)
        )
        assert ours is not None
        decode = datamodule.renderer.tokenizer.decode
        text = decode(ours.input_ids, skip_special_tokens=False)
        trained = decode(
            [t for t, on in zip(ours.input_ids, ours.trained, strict=True) if on],
            skip_special_tokens=False,
        )
        last = record["messages"][-1]
        assert last[family.reasoning_field] in text  # rendered, as the template keeps it
        assert last[family.reasoning_field] not in trained
        assert "think" not in trained and "analysis" not in trained
        for turn in record["messages"][1::2]:
            assert turn["content"] in trained
        assert trained.endswith(END_OF_TURN[name])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("builtin", sorted(BUILTIN_TEMPLATES))
def test_the_builtin_templates_mask_as_transformers_does(tmp_path, builtin, shape):
    """The library's own templates, saved with a run's tokenizer, write tools, calls and
    reasoning, and transformers renders and masks them alike."""
    family = FAMILIES["smollm3"]  # the ChatML tokens, with <think> and <tool_call> added
    records = _records(family, shape)
    assert records is not None
    datamodule = _data_module(tmp_path, family, records, BUILTIN_TEMPLATES[builtin])
    (line,) = prove_chat_data(datamodule, 10)
    assert f"{len(records)} record(s): token ids and trained tokens equal" in line
    if shape in ("tools", "reasoning"):
        text = datamodule.tokenizer.decode(datamodule.train_dataset[0]["input_ids"].tolist())
        assert ("<tool_call>" if shape == "tools" else "<think>") in text


EXAMPLE_SETS = Path(__file__).resolve().parents[3] / "examples" / "data"


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("example", ["tool_use", "reasoning", "sharegpt", "alpaca"])
def test_the_example_sets_mask_as_transformers_does(tmp_path, example, name):
    """Every record of the shipped example sets, in every family's format that renders
    its shape: tool rounds (two calls in one turn, arguments as text, tools as JSON
    text), reasoning in either field or a <think> block, ShareGPT and Alpaca."""
    family = FAMILIES[name]
    if example == "tool_use" and not family.tools:
        pytest.skip(f"{name}'s format has no tool calls")
    records = [json.loads(line) for line in (EXAMPLE_SETS / f"{example}.jsonl").open()]
    # Llama 3.1's template refuses two calls in one turn: that record is skipped
    refused = 1 if (example, name) == ("tool_use", "llama3_1") else 0
    datamodule = _data_module(tmp_path, family, records, on_bad_record="skip")
    (line,) = prove_chat_data(datamodule, len(records))
    proved = f"{len(records) - refused} record(s): token ids and trained tokens equal"
    assert proved in line and line.endswith(
        f"{refused} left out by the library" if refused else "'"
    )


def test_a_wrong_mask_stops_at_the_record_with_a_readable_diff(tmp_path):
    """The library trains every assistant turn; a reference that trains only the last
    one disagrees on the second record's first answer: named by file:line, the tokens
    around the difference shown with each side's trained ones marked."""
    family = FAMILIES["smollm3"]
    records = plain_records() + multi_turn_records()
    datamodule = _data_module(tmp_path, family, records)
    assert datamodule.renderer is not None
    (name,) = datamodule.sources
    source = datamodule._record_source(name)
    records_read = datamodule._source_records(name)
    reference = _reference(tmp_path, family, train_on="last")
    prove_records(records_read, [0, 1], datamodule.renderer, reference, datamodule.config, source)
    with pytest.raises(MaskProofError) as caught:
        prove_records(
            records_read, [0, 1, 2], datamodule.renderer, reference, datamodule.config, source
        )
    message = str(caught.value)
    assert re.search(r"chat\.jsonl:3: data\.chat\.prove_masks: the trained tokens differ", message)
    theirs, ours = message.split("\n  transformers: ")[1].split("\n  library:      ")
    assert "four<|im_end|>" in theirs and "[[" not in theirs
    assert "[[four<|im_end|>]]" in ours


def test_a_wrong_template_stops_at_the_first_record_on_its_token_ids(tmp_path):
    """The library renders with one template, transformers with another that differs by
    a space: the first record stops the proof on its token ids."""
    family = FAMILIES["smollm3"]
    datamodule = _data_module(tmp_path, family, plain_records())
    assert datamodule.renderer is not None
    tokenizer = hf_tokenizer(tmp_path / "tokenizer" / "tokenizer.json", family.eos)
    wrong = family.text.replace("'<|im_start|>user\\n'", "'<|im_start|>user\\n '")
    assert wrong != family.text
    reference = ReferenceRenderer(tokenizer, wrong)
    (name,) = datamodule.sources
    records = datamodule._source_records(name)
    where = datamodule._record_source(name)
    with pytest.raises(MaskProofError, match=r"chat\.jsonl:1: .* the token ids differ"):
        prove_records(records, [0, 1], datamodule.renderer, reference, datamodule.config, where)


def test_the_sample_is_seeded_and_a_negative_count_refused(tmp_path):
    assert sample_indices(3, 10, seed=0) == [0, 1, 2]
    picked = sample_indices(100, 5, seed=1)
    assert picked == sorted(picked) == sample_indices(100, 5, seed=1) and len(set(picked)) == 5
    datamodule = _data_module(tmp_path, FAMILIES["smollm3"], plain_records())
    with pytest.raises(ConfigError, match=r"data\.chat\.prove_masks=-1 must be 0 or more"):
        prove_chat_data(datamodule, -1)


@pytest.mark.parametrize("name", ["smollm3", "smollm3_no_think"])
def test_spans_found_from_renderings_match_transformers_generation_tags(tmp_path, name):
    """SmolLM3's template marks assistant output with generation tags, which transformers
    reports; the same template without them gives the same trained tokens by the
    rendering comparisons alone."""
    family = FAMILIES[name]
    tagged = _reference(tmp_path, family)
    untagged_text = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", family.text)
    untagged = ReferenceRenderer(tagged.tokenizer, untagged_text, family.template_kwargs)
    assert tagged.tagged and not untagged.tagged
    for shape in SHAPES:
        for record in _records(family, shape) or []:
            messages, tools = conversation_of(record, DataConfig())
            assert untagged.render(messages, tools) == tagged.render(messages, tools), shape


def test_generation_blocks_decide_the_trained_tokens_where_a_template_has_them(tmp_path):
    """SmolLM3's template with its generation block stretched over the newline after
    the end-of-turn token: the library trains what the block holds, as transformers
    reports it, newline included."""
    family = FAMILIES["smollm3"]
    close = "{%- endgeneration %}\n{{- '\\n' }}"
    assert close in family.text
    stretched = family.text.replace(close, "{{- '\\n' }}\n{%- endgeneration %}")
    for shape in SHAPES:
        records = _records(family, shape)
        assert records is not None
        datamodule = _data_module(tmp_path / shape, family, records, stretched)
        (line,) = prove_chat_data(datamodule, 10)
        assert f"{len(records)} record(s): token ids and trained tokens equal" in line
        assert datamodule.renderer is not None
        pieces = datamodule.renderer.segments(conversation_of(records[-1], DataConfig())[0])
        assert all(text.endswith("<|im_end|>\n") for text, trained in pieces if trained)
