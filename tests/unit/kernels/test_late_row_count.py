"""Packed preference batches whose rows first grow late in a run compile nothing then.

On heavy-tailed pairs most batches fit two rows of the run's packed width and one in a
few dozen needs a third, so the row count first changes in the middle of training. A
graph compiled at that step is a compile inside the measured steps: SimPO and reward
models on such pairs ran at 815 and 762 tok/s on an H200 instead of about 15,000, when
each batch's flex mask came from a compiled ``create_block_mask`` that dynamo had
specialised on the first batch's row count (its guard ``B == 2`` failed at the
three-row batch). The blocks trace the rows dynamic from the first call and the mask is
built without compiling, so every graph of a kind of call is compiled at its first call.

Every ``torch.compile`` (the blocks' and any helper's) runs dynamo's ``eager`` backend:
which graphs dynamo makes is decided by its guards, before any backend runs. The mask
builder is the same on every device; ``tests/gpu/test_late_row_count_gpu.py`` runs the
CUDA kernels under inductor.
"""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.data.preference.collate import collate_pairs
from recipes_lib.kernels.compiled import compile_blocks, watch_compiles
from recipes_lib.models import Transformer

WIDTH = 256  # the run's packed width
SHORT = [(40, 30)] * 4  # four pairs of short answers: two rows (one is padding)
# three long sequences and five short ones: first fit needs a third row
LONG = [(200, 20), (200, 20), (200, 20), (20, 20)]
# two-row batches, then a three-row one (the matrix's heavy-tailed pairs: at step 9)
ROWS_LATE = [SHORT] * 3 + [LONG] + [SHORT]


@pytest.fixture
def eager_backend(monkeypatch):
    """Every ``torch.compile`` and ``Module.compile`` with dynamo's eager backend, in a
    fresh dynamo."""
    compile_module, compile_fn = torch.nn.Module.compile, torch.compile

    def module_eager(self, *args, **kwargs):
        return compile_module(self, *args, **{**kwargs, "backend": "eager"})

    def fn_eager(model=None, **kwargs):
        kwargs["backend"] = "eager"
        return compile_fn(model, **kwargs) if model is not None else compile_fn(**kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", module_eager)
    monkeypatch.setattr(torch, "compile", fn_eager)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pairs(lengths: list[tuple[int, int]], shifted: bool, seed: int) -> dict:
    """A batch of pairs whose chosen and rejected inputs are ``lengths`` tokens long,
    packed as the data module packs them for compiled blocks."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(3, 64, (n + int(shifted),), generator=gen)

    items = []
    for index, (chosen, rejected) in enumerate(lengths):
        c, r = ids(chosen), ids(rejected)
        items.append(
            {
                "index": index,
                "chosen_ids": c,
                "chosen_mask": torch.ones_like(c, dtype=torch.bool),
                "rejected_ids": r,
                "rejected_mask": torch.ones_like(r, dtype=torch.bool),
            }
        )
    return collate_pairs(
        items, pad_id=0, packing=True, seq_len=WIDTH, shifted=shifted, fixed_width=True
    )


@pytest.mark.parametrize("shifted", [True, False], ids=["simpo", "reward"])
def test_a_batch_that_first_needs_a_third_row_late_compiles_nothing(eager_backend, shifted):
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(max_seq_len=WIDTH), attention="flex")
    compile_blocks(model.layers, varying_shapes=True)
    batches = [_pairs(lengths, shifted, seed) for seed, lengths in enumerate(ROWS_LATE)]
    rows = [b["input_ids"].shape[0] for b in batches]
    assert rows == [2, 2, 2, 3, 2]  # the row count first changes at step 3
    compiled_at = []
    with watch_compiles() as first:
        for step, batch in enumerate(batches):
            with watch_compiles() as stats:
                model(batch["input_ids"], batch["doc_ids"]).float().logsumexp(-1).mean().backward()
                with torch.no_grad():  # a reference's pass: the no-grad kind of call
                    model(batch["input_ids"], batch["doc_ids"])
            compiled_at += [step] * stats.graphs
    assert first.recompile_limit_hits == 0, first
    # the training and the no-grad kind, each at its first call: none later
    assert compiled_at == [0, 0], compiled_at
