"""Compiled blocks: one graph per kind of call whatever the batch's rows, shared by every
layer; padded lengths in a few buckets; a shape the compiled path cannot take runs
eagerly with a warning. Dynamo's ``eager`` backend decides the graphs as inductor would
(guards are dynamo's), without compiling C++ on the CPU."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.data.chat.packing import pad_collate
from recipes_lib.data.preference.collate import collate_pairs
from recipes_lib.kernels.compiled import (
    LENGTH_MULTIPLE,
    MIN_ROWS,
    bucketed_length,
    compile_blocks,
    start_compile_workers,
    watch_compiles,
)
from recipes_lib.models import Transformer

SEQ = 64


@pytest.fixture
def eager_compile(monkeypatch):
    """``Module.compile`` with dynamo's eager backend, in a fresh dynamo."""
    compile_module = torch.nn.Module.compile

    def compile_eager(self, *args, **kwargs):
        return compile_module(self, *args, **{"backend": "eager", **kwargs})

    monkeypatch.setattr(torch.nn.Module, "compile", compile_eager)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(varying: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(n_layers=4, max_seq_len=SEQ), attention="flex")
    compile_blocks(model.layers, varying_shapes=varying)
    return model


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (rows, SEQ))
    doc_ids = (torch.arange(SEQ) >= SEQ // 3).int().expand(rows, SEQ).contiguous()
    return ids, doc_ids


def _train_steps(model: Transformer, row_counts) -> None:
    for rows in row_counts:
        model(*_batch(rows)).sum().backward()


def test_rows_of_any_count_take_one_graph_shared_by_every_layer(eager_compile):
    model = _model(varying=True)
    with watch_compiles() as stats:
        _train_steps(model, [3, 5, 2, 8, 4])
    # four layers, five row counts: one graph (automatic dynamic shapes took two)
    assert stats.graphs == 1, stats
    with watch_compiles() as stats, torch.no_grad():
        for rows in (2, 6, 3):
            model(*_batch(rows))
    assert stats.graphs == 1, stats  # the no-grad kind: a graph of its own, once


def test_without_varying_shapes_a_changed_row_count_recompiles(eager_compile):
    model = _model(varying=False)
    with watch_compiles() as stats:
        _train_steps(model, [3, 5, 2, 8, 4])
    assert stats.graphs == 2, stats  # static, then dynamic: what the marking saves


def test_a_mixture_on_its_per_expert_loop_compiles_a_few_graphs_whatever_the_routing(
    eager_compile,
):
    # 32 experts over 2 x 16 tokens: many experts take 0 or 1 rows, counts a compiled
    # loop was specialized on (the recompile limit within a few steps)
    config = tiny_model_config(
        family="mixtral", n_layers=2, moe_experts=32, moe_top_k=4, moe_ffn_dim=32
    )
    torch.manual_seed(0)
    model = Transformer(config, attention="sdpa")
    compile_blocks(model.layers, varying_shapes=False)
    with watch_compiles() as stats:
        for _ in range(12):
            ids = torch.randint(0, config.vocab_size, (2, 16))
            model(ids, labels=ids).backward()
    assert stats.recompile_limit_hits == 0, stats
    assert stats.graphs <= 6, stats


def test_a_shape_the_compiled_path_cannot_take_runs_eagerly_with_one_warning(monkeypatch, caplog):
    calls = []

    def refusing_backend(graph, example_inputs):
        calls.append(1)
        raise RuntimeError("this backend takes no graph")

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module,
        "compile",
        lambda self, *a, **k: compile_module(self, *a, **{**k, "backend": refusing_backend}),
    )
    torch._dynamo.reset()
    try:
        model = _model(varying=True)
        torch.manual_seed(1)
        ids, doc_ids = _batch(3)
        with caplog.at_level(logging.WARNING, logger="recipes_lib.kernels.compiled"):
            out = model(ids, doc_ids)
            again = model(ids, doc_ids)
        eager = Transformer(tiny_model_config(n_layers=4, max_seq_len=SEQ), attention="flex")
        eager.load_state_dict(model.state_dict())
        torch.testing.assert_close(out, eager(ids, doc_ids))
        torch.testing.assert_close(again, out)
    finally:
        torch._dynamo.reset()
    warnings = [r for r in caplog.records if "run eagerly" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "(3, 64, 32)" in warnings[0].getMessage()
    assert len(calls) == 1  # the shapes are not compiled again at every call


@pytest.mark.parametrize(
    "length,limit,expected",
    [
        (1, None, LENGTH_MULTIPLE),
        (128, None, 128),
        (129, None, 256),
        (300, 320, 320),
        (300, 512, 384),
        (600, 512, 640),
    ],
)
def test_padded_lengths_are_rounded_up_to_a_few_buckets(length, limit, expected):
    assert bucketed_length(length, limit) == expected


def _pair(index: int, prompt: int, chosen: int, rejected: int) -> dict:
    def seq(n):
        return torch.arange(1, prompt + n + 1), torch.arange(prompt + n) >= prompt

    (c_ids, c_mask), (r_ids, r_mask) = seq(chosen), seq(rejected)
    return {
        "index": index,
        "chosen_ids": c_ids,
        "chosen_mask": c_mask,
        "rejected_ids": r_ids,
        "rejected_mask": r_mask,
    }


def test_packed_pairs_for_compiled_blocks_fill_at_least_two_rows():
    pairs = [_pair(0, 3, 2, 4), _pair(1, 2, 5, 1)]  # all four fit in one row
    eager = collate_pairs(pairs, 0, packing=True, seq_len=64)
    compiled = collate_pairs(pairs, 0, packing=True, seq_len=64, fixed_width=True)
    assert eager["input_ids"].shape[0] == 1
    assert compiled["input_ids"].shape == (MIN_ROWS, 64)
    assert (compiled["sequence_ids"][1] == -1).all()  # the added row is padding only
    assert (compiled["labels"][1] == -100).all()
    kto = [{**p, "desirable": i == 0} for i, p in enumerate(pairs)]
    batch = collate_pairs(kto, 0, packing=True, seq_len=64, fixed_width=True)
    assert batch["twin_rows"] == MIN_ROWS and batch["input_ids"].shape[0] == 2 * MIN_ROWS


def test_padded_rows_for_compiled_blocks_are_a_bucket_wide():
    pairs = [_pair(0, 30, 50, 100), _pair(1, 2, 5, 1)]
    assert collate_pairs(pairs, 0, seq_len=512)["input_ids"].shape[1] == 129
    assert collate_pairs(pairs, 0, seq_len=512, fixed_width=True)["input_ids"].shape[1] == 256
    items = [{"input_ids": torch.arange(n), "labels": torch.arange(n)} for n in (5, 70)]
    assert pad_collate(0)(items)["input_ids"].shape[1] == 70
    assert pad_collate(0, bucket_within=96)(items)["input_ids"].shape[1] == 96


def test_varying_shape_blocks_compile_without_inductors_row_count_guard(monkeypatch):
    """Inductor's mix-order reduction guards a graph on rows x width against a fixed
    size: a run whose blocks take varying rows turns it off, a fixed-shape run leaves it,
    and the run's end puts the process's setting back."""
    from recipes_lib.kernels.compiled import row_count_fusion

    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: None)
    before = row_count_fusion()
    assert before is not None  # this torch has the fusion
    with watch_compiles():
        compile_blocks([torch.nn.Linear(2, 2)], varying_shapes=False)
        assert row_count_fusion() == before
        compile_blocks([torch.nn.Linear(2, 2)], varying_shapes=True)
        assert row_count_fusion() is False
    assert row_count_fusion() == before


def test_the_compile_workers_start_with_the_run_only_where_triton_compiles(monkeypatch):
    import torch._inductor.async_compile as async_compile
    import torch.utils._triton as triton_check

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(1))
    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 16)
    monkeypatch.setattr(triton_check, "has_triton_package", lambda: False)
    assert start_compile_workers() is False and not started  # C++ compiles in-process
    monkeypatch.setattr(triton_check, "has_triton_package", lambda: True)
    monkeypatch.delenv("TORCH_WARM_POOL", raising=False)
    assert start_compile_workers() is True and started == [1]
    monkeypatch.setenv("TORCH_WARM_POOL", "0")  # torch's own switch: the pool stays off
    assert start_compile_workers() is False
    monkeypatch.delenv("TORCH_WARM_POOL")
    started.clear()
    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 1)  # no pool at all
    assert start_compile_workers() is False and not started
