"""Compiled blocks on data whose lengths vary widely: every objective keeps the few
graphs its kinds of call need (:mod:`recipes_lib.kernels.compiled`), whatever the
lengths, and never hits dynamo's recompile limit.

The runs compile with dynamo's ``eager`` backend: which graphs dynamo traces, and when
it gives up, is decided by its guards before any backend runs, and inductor would spend
minutes compiling C++ on a CPU for the same count. The GPU tests run inductor.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tiny import QUIET_OVERRIDES

from recipes_lib.config import compose_config
from recipes_lib.kernels.compiled import CALL_KINDS, GRAPHS_PER_KIND
from recipes_lib.train import run

STEPS = 50
# packed pairs: one graph per kind of call (policy with and without gradients, the
# reference); under LoRA the first block's input takes no gradient, one more
PACKED = CALL_KINDS
# padded rows: the first length, then the length dynamic, for training and validation;
# and the same two of the loss's compiled cross-entropy
PADDED = 2 * GRAPHS_PER_KIND + 2
WORDS = "def return value list index item name path file data model token ".split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _length(rng: random.Random) -> int:
    """Heavy-tailed: mostly a few words, sometimes hundreds."""
    return min(400, max(1, int(rng.paretovariate(1.1) * 4)))


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> dict[str, Path]:
    """Pairs, conversations and unpaired examples of widely varying lengths."""
    rng = random.Random(0)
    folder = tmp_path_factory.mktemp("varied")
    paths = {name: folder / f"{name}.jsonl" for name in ("pairs", "chat", "examples")}
    with open(paths["pairs"], "w") as pairs, open(paths["chat"], "w") as chat:
        for _ in range(300):
            prompt = _text(rng, _length(rng))
            chosen, rejected = _text(rng, _length(rng)), _text(rng, _length(rng))
            pairs.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}))
            pairs.write("\n")
            turns = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": chosen},
            ]
            chat.write(json.dumps({"messages": turns}) + "\n")
    with open(paths["examples"], "w") as examples:
        for i in range(300):
            record = {
                "prompt": _text(rng, _length(rng)),
                "completion": _text(rng, _length(rng)),
                "label": i % 2 == 0,
            }
            examples.write(json.dumps(record) + "\n")
    return paths


@pytest.fixture
def eager_backend(monkeypatch):
    """Blocks compiled by the library trace with dynamo's eager backend."""
    compile_module = torch.nn.Module.compile

    def compile_eager(self, *args, **kwargs):
        return compile_module(self, *args, **{**kwargs, "backend": "eager"})

    original = torch.compile

    def compile_fn(model=None, **kwargs):
        kwargs["backend"] = "eager"
        return original(model, **kwargs) if model is not None else original(**kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_eager)
    monkeypatch.setattr(torch, "compile", compile_fn)
    torch._dynamo.reset()  # no graph of an earlier test in this process serves this one
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,data,extra,at_most",
    [
        ("dpo/full", "pairs", (), PACKED),
        ("dpo/lora", "pairs", (), PACKED),
        ("kto/full", "examples", (), PACKED),
        ("reward/full", "pairs", (), PACKED),
        ("sft/full", "chat", ("data.chat.packing=false",), PADDED),
    ],
    ids=["dpo", "dpo-lora", "kto", "reward", "sft-padded"],
)
def test_every_objective_keeps_a_bounded_number_of_graphs(
    tmp_path, hf_folder, varied, eager_backend, recipe, data, extra, at_most
):
    overrides = [
        f"recipe={recipe}",
        f"stage.init_from={hf_folder}",
        f"data.path={varied[data]}",
        f"run.dir={tmp_path / 'run'}",
        "trainer=cpu",
        "kernels=flex",
        "kernels.compile=true",
        "data.seq_len=512",
        "data.batch_size=4",
        f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=25",
        "trainer.limit_val_batches=2",
        "scheduler.warmup=2",
        "run.checkpoint_every_n_steps=0",
        "callbacks=minimal",
        *QUIET_OVERRIDES,
        *extra,
    ]
    result = run(compose_config(overrides))
    assert result.global_step == STEPS
    assert result.compiled["recompile_limit_hits"] == 0, result.compiled
    assert 0 < result.compiled["graphs"] <= at_most, result.compiled
    assert set(result.start) == {"import", "data", "load", "compile", "first_step", "total"}
