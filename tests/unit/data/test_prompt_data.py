"""Prompts for GRPO: rendered ready to continue, their records kept for the rewards, bad
ones named by file and line, and each batch drawn once per update on its completions."""

from __future__ import annotations

import json

import pytest
import torch
from data_helpers import data_config

from recipes_lib.config.schema import SourceConfig
from recipes_lib.data.prompts.module import PromptDataModule, RepeatingSampler, prompts_of
from recipes_lib.data.prompts.stdlib_task import stdlib_task_records
from recipes_lib.data.sampler import ResumableSampler
from recipes_lib.errors import DataError


def test_each_batch_comes_as_often_as_it_is_updated_on_and_resumes_anywhere():
    plain = list(zip(range(12), ResumableSampler(10, seed=3), strict=False))
    repeated = RepeatingSampler(10, seed=3, batch_size=2, repeats=3)
    draws = [index for _, index in zip(range(18), repeated, strict=False)]
    stream = [index for _, index in plain]
    assert draws == [*stream[0:2] * 3, *stream[2:4] * 3, *stream[4:6] * 3]
    for start in range(18):  # a run resumed after `start` draws continues the same stream
        resumed = RepeatingSampler(10, seed=3, start=start, batch_size=2, repeats=3)
        assert [i for _, i in zip(range(18 - start), resumed, strict=False)] == draws[start:]


def test_a_skip_moves_on_by_whole_groups_of_repeated_batches(tmp_path):
    config = data_config(tmp_path, batch_size=4)
    module = PromptDataModule(config, 512, 1024, max_new_tokens=16, repeats=3)
    module.skip_samples(5)  # a rollback's window of batches
    module.load_state_dict({"consumed_samples": 24})  # a checkpoint at step 6
    assert module.sample_offset == 12  # one group of 3 batches of 4, not 5 samples


def write_prompts(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_prompts_are_rendered_to_continue_and_keep_their_records(tmp_path, small_tokenizer_path):
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]
    rows[3] = {"messages": [{"role": "user", "content": "Say hi."}], "answer": "hi"}
    write_prompts(tmp_path / "prompts.jsonl", rows)
    config = data_config(
        tmp_path / "cache",
        {"prompts": SourceConfig(path=str(tmp_path / "prompts.jsonl"))},
        small_tokenizer_path,
        val_fraction=0.25,
    )
    config.chat.chat_template = "plain"
    module = PromptDataModule(config, 512, 1024, total_train_samples=8, max_new_tokens=16)
    module.setup()
    assert len(module.train_dataset) == 9 and len(module.val_dataset) == 3
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4
    header = module.tokenizer.encode("### assistant\n", add_special_tokens=False).ids
    for ids, record, where in zip(prompts_of(batch), batch["records"], batch["where"], strict=True):
        assert ids[-len(header) :] == header  # ready for the assistant's answer
        text = module.tokenizer.decode(ids)
        assert (record.get("prompt") or "Say hi.") in text
        line = int(where.rsplit(":", 1)[1])
        assert rows[line - 1]["answer"] == record["answer"]
    assert (batch["input_ids"][:, -1] == torch.tensor([h[-1] for h in prompts_of(batch)])).all()

    rows[6] = {"prompt": 7}
    write_prompts(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(DataError, match=r"prompts\.jsonl:7: field 'prompt' holds int"):
        PromptDataModule(config, 512, 1024, max_new_tokens=16).setup()


def test_the_builtin_task_asks_for_a_function_by_its_name():
    records = stdlib_task_records(5)
    assert len(records) == 5
    for record in records:
        assert f"`{record['source'].split(':')[1]}`" in record["prompt"]
        assert f"def {record['name']}(" in record["prompt"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# writes the tools before the turns, as the families' templates do
TOOLS_TEMPLATE = (
    "{% if tools %}{% for t in tools %}{{ 'tool ' + t['function']['name'] + '\\n' }}"
    "{% endfor %}{% endif %}{% for m in messages %}{{ '### ' + m['role'] + '\\n' }}"
    "{{ m['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}"
)


def test_prompts_give_their_tools_to_the_template(tmp_path, small_tokenizer_path):
    """A prompt record's tools reach the template (listed JSON or its text); one whose
    tools are not JSON is named by file:line."""
    rows = [{"prompt": f"weather in city {i}", "tools": [WEATHER]} for i in range(3)]
    rows.append({"prompt": "weather in paris", "tools": json.dumps([WEATHER])})
    rows.append({"prompt": "no tools here"})
    write_prompts(tmp_path / "prompts.jsonl", rows)
    config = data_config(
        tmp_path / "cache",
        {"prompts": SourceConfig(path=str(tmp_path / "prompts.jsonl"))},
        small_tokenizer_path,
        val_fraction=0.0,
    )
    config.chat.chat_template = TOOLS_TEMPLATE
    module = PromptDataModule(config, 512, 1024, total_train_samples=5, max_new_tokens=16)
    module.setup()
    texts = {}
    for prompt in module.train_dataset.prompts:
        texts[prompt.record["prompt"]] = module.tokenizer.decode(prompt.ids)
    assert len(texts) == 5
    for name, text in texts.items():
        assert text.startswith("tool get_weather\n") == (name != "no tools here"), text

    rows[2] = {"prompt": "broken", "tools": "[{not json"}
    write_prompts(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(DataError, match=r"prompts\.jsonl:3: field 'tools' is not JSON"):
        PromptDataModule(config, 512, 1024, max_new_tokens=16).setup()
