"""Packed preference batches whose rows first grow late compile nothing then, on a GPU
(``pytest -m gpu``): flex's CUDA kernel inside blocks compiled by inductor, the masks
built as a CUDA run builds them.

On heavy-tailed pairs the row count first changes in the middle of a run (the matrix's
SimPO and reward cells: two rows a batch until step 9, then three). When flex masks
came from a compiled ``create_block_mask``, dynamo had specialised it on the first
batch's row count and compiled again at that step, inside the measured steps: 815 and
762 tok/s instead of about 15,000 on an H200. ``tests/unit/kernels/test_late_row_count.py``
checks the same on a CPU with dynamo's eager backend.

The model has the matrix's row width and hidden size (1,152 x 2,048): a two-row batch
is below, a three-row one above, the size at which inductor's mix-order reduction (a
norm's backward) decides to fuse. Inductor guarded the graph on that comparison, so the
three-row batch compiled again (SimPO on heavy-tailed pairs, an H200, torch 2.11);
varying-shape blocks now compile without that fusion
(:func:`recipes_lib.kernels.compiled.set_row_count_fusion`).

With that fixed, the three-row batch still compiled twice on an H200 (torch 2.11): the
blocks called flex compiled on its own, which broke their graph at the attention, and
the frames after it were traced with the rows static. Inside a compiled block flex is
now the operator itself (:func:`recipes_lib.kernels.attention.compiled_flex`), and
this test passed.
"""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.data.preference.collate import collate_pairs
from recipes_lib.kernels.compiled import compile_blocks, watch_compiles
from recipes_lib.models import Transformer

pytestmark = pytest.mark.gpu

WIDTH = 1152
SHORT = [(60, 50)] * 4  # two rows (one of them padding)
LONG = [(800, 40), (800, 40), (800, 40), (40, 40)]  # first fit needs a third row


def _batch(lengths: list[tuple[int, int]], seed: int) -> dict:
    """Pairs of ``lengths`` input tokens, packed as for compiled blocks, on CUDA."""
    gen = torch.Generator().manual_seed(seed)
    items = []
    for index, (chosen, rejected) in enumerate(lengths):
        c = torch.randint(3, 256, (chosen + 1,), generator=gen)
        r = torch.randint(3, 256, (rejected + 1,), generator=gen)
        items.append(
            {
                "index": index,
                "chosen_ids": c,
                "chosen_mask": torch.ones_like(c, dtype=torch.bool),
                "rejected_ids": r,
                "rejected_mask": torch.ones_like(r, dtype=torch.bool),
            }
        )
    batch = collate_pairs(items, pad_id=0, packing=True, seq_len=WIDTH, fixed_width=True)
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_a_batch_that_first_needs_a_third_row_late_compiles_nothing_on_cuda():
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny_model_config(
        vocab_size=256, dim=2048, n_heads=16, n_kv_heads=4, ffn_dim=512, max_seq_len=WIDTH
    )
    model = Transformer(config, attention="flex").cuda()
    compile_blocks(model.layers, varying_shapes=True)
    batches = [_batch(lengths, seed) for seed, lengths in enumerate([SHORT] * 5 + [LONG, SHORT])]
    assert [b["input_ids"].shape[0] for b in batches] == [2] * 5 + [3, 2]
    compiled_at = []
    with watch_compiles() as run:
        for step, batch in enumerate(batches):
            with watch_compiles() as stats:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(batch["input_ids"], batch["doc_ids"])
                out.float().logsumexp(-1).mean().backward()
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    model(batch["input_ids"], batch["doc_ids"])  # the no-grad kind
            torch.cuda.synchronize()
            compiled_at += [step] * stats.graphs
    torch._dynamo.reset()
    assert run.recompile_limit_hits == 0, run
    # every graph at the first call of its kind; none at the three-row batch (step 5)
    assert compiled_at and set(compiled_at) == {0}, compiled_at
