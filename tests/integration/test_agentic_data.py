"""Tool-use and reasoning data end to end: tiny SFT runs lower the held-out loss on a
generated tool-use set and a reasoning set, and DPO trains on pairs whose answers call tools."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from integration_helpers import metric_series, read_metrics
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.config import compose_config
from recipes_lib.train import run

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two whole numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def tool_use_record(rng: random.Random, n: int) -> dict:
    a, b = rng.randint(1, 60), rng.randint(1, 60)
    call = {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "add", "arguments": {"a": a, "b": b}},
    }
    return {
        "tools": [ADD_TOOL],
        "messages": [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": str(a + b)},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ],
    }


def reasoning_record(rng: random.Random) -> dict:
    n = rng.randint(2, 99)
    answer = "even" if n % 2 == 0 else "odd"
    return {
        "messages": [
            {"role": "user", "content": f"Is {n} even or odd?"},
            {
                "role": "assistant",
                "reasoning_content": f"{n} divided by 2 leaves {n % 2}, so {n} is {answer}.",
                "content": f"{n} is {answer}.",
            },
        ]
    }


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def sft_overrides(run_dir, data: str, *extra: str) -> list[str]:
    """A tiny SFT run from scratch: its tokenizer is trained on the records with the
    ChatML tokens, so the built-in chatml template renders the tools, calls and
    reasoning with the chat tokens the model will use."""
    return [
        "recipe=sft/tiny",
        "data.chat.chat_template=chatml",
        f"run.dir={run_dir / 'run'}",
        f"data.cache_dir={run_dir / 'cache'}",
        f"data.path={data}",
        "data.seq_len=192",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        *SMALL_VOCAB_OVERRIDES,
        "optim.lr=3e-3",
        "trainer.max_steps=30",
        "trainer.val_check_interval=10",
        "trainer.limit_val_batches=4",
        "trainer.log_every_n_steps=1",
        *QUIET_OVERRIDES,
        "scheduler.warmup=3",
        "run.checkpoint_every_n_steps=30",
        "callbacks=minimal",
        *extra,
    ]


def _sft(run_dir, kind: str):
    rng = random.Random(0)
    if kind == "tool_use":
        records = [tool_use_record(rng, n) for n in range(300)]
    else:
        records = [reasoning_record(rng) for _ in range(300)]
    run_dir.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(run_dir / f"{kind}.jsonl", records)
    return run(compose_config(sft_overrides(run_dir, data)))


@pytest.fixture(scope="module")
def tool_sft(tmp_path_factory):
    return _sft(tmp_path_factory.mktemp("tool_sft"), "tool_use")


def _falls(result) -> None:
    assert result.global_step == 30
    losses = [loss for _, loss in metric_series(read_metrics(result.output_dir), "val/loss")]
    assert len(losses) == 3
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.slow
def test_sft_on_tool_use_lowers_the_held_out_loss(tool_sft):
    _falls(tool_sft)


@pytest.mark.slow
def test_sft_on_reasoning_lowers_the_held_out_loss(tmp_path):
    _falls(_sft(tmp_path, "reasoning"))


@pytest.mark.slow
def test_dpo_trains_on_pairs_whose_answers_call_tools(tmp_path, tool_sft):
    rng = random.Random(1)
    pairs = []
    for n in range(200):
        record = tool_use_record(rng, n)
        wrong = json.loads(json.dumps(record["messages"][1:]))
        wrong[0]["tool_calls"][0]["function"]["name"] = "subtract"
        pairs.append(
            {
                "tools": record["tools"],
                "prompt": record["messages"][:1],
                "chosen": record["messages"][1:],
                "rejected": wrong,
            }
        )
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    overrides = [
        "recipe=dpo/tiny",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"stage.init_from={tool_sft.weights_path}",
        f"data.tokenizer.path={tool_sft.tokenizer_path}",
        "data.chat.chat_template=null",  # the SFT stage's chatml, saved with its tokenizer
        f"data.path={data}",
        *SMALL_VOCAB_OVERRIDES,
        "data.seq_len=384",
        "data.batch_size=4",
        "optim.lr=1e-3",
        "scheduler.warmup=2",
        "trainer.max_steps=12",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=4",
        "trainer.log_every_n_steps=1",
        *QUIET_OVERRIDES,
        "callbacks=minimal",
    ]
    result = run(compose_config(overrides))
    assert result.global_step == 12
    margin = metric_series(read_metrics(result.output_dir), "val/rewards/margin")
    assert margin and all(math.isfinite(m) for _, m in margin)
    # the policy starts as its reference (margin 0) and learns to prefer the right call
    assert margin[-1][1] > margin[0][1] + 0.01 and margin[-1][1] > 0, margin


EXAMPLE_SETS = Path(__file__).resolve().parents[2] / "examples" / "data"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "settings"),
    [
        ("tool_use", ()),
        ("reasoning", ("data.chat.enable_thinking=true",)),
        ("sharegpt", ("data.chat.format=sharegpt",)),
        ("alpaca", ()),  # detected by its fields
    ],
)
def test_a_tiny_sft_recipe_trains_on_each_example_set(tmp_path, example, settings):
    """Each shipped example set (twenty records written by hand) trains a tiny model
    from scratch: its training loss falls as it learns the set."""
    data = str(EXAMPLE_SETS / f"{example}.jsonl")
    overrides = sft_overrides(tmp_path, data, *settings)
    overrides += ["trainer.max_steps=20", "run.checkpoint_every_n_steps=20"]
    result = run(compose_config(overrides))
    assert result.global_step == 20
    losses = [loss for _, loss in metric_series(read_metrics(result.output_dir), "train/loss")]
    assert len(losses) == 20
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses
