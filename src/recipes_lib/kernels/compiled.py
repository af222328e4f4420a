"""Compiled blocks with a bounded number of graphs on any data, and what a run compiled.

``torch.compile`` keeps one cache of graphs per code object: every transformer block of
every model in the process (the policy, a frozen reference or teacher) shares
``TransformerBlock.forward``'s. A graph is guarded on the shapes it was traced with, on
the grad mode and on the modules' types, so each kind of call takes its own graphs: the
policy's training pass, its no-grad passes (validation, a precomputed reference, the
adapters-bypassed reference), a frozen model's pass (its projections stored narrower).
With the default automatic dynamic shapes, each kind first traces its static shape and
traces again when a length changes: on data whose batches vary in shape (preference
pairs, unpacked rows, rollouts) the kinds together passed dynamo's recompile limit
(8), and past it the blocks ran eagerly, several times slower.

Where batches vary in shape, blocks are therefore compiled with dynamic batch and
sequence dimensions from their first call: a new length never adds a graph. What still
does is finite: the kind of call (at most :data:`CALL_KINDS`) and dynamo's own
specialisation of a dimension of size 1 (a batch of one row, a sequence of one
attention block), at most :data:`SPECIALISATIONS` graphs per kind. The recompile limit
is raised to that bound (:data:`GRAPH_BOUND`), and :func:`watch_compiles` counts what a
run compiled and turns a limit hit into one warning line the user sees.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

CALL_KINDS = 4  # training; the policy without gradients; a frozen model; adapters bypassed
SPECIALISATIONS = 4  # a dimension of size 1 or more, for the batch and for the sequence
GRAPH_BOUND = CALL_KINDS * SPECIALISATIONS  # graphs of one compiled block, on any data
_LIMIT_MESSAGE = "recompile_limit"  # in dynamo's warning when a code object passes it


def compile_blocks(blocks: Iterable[nn.Module], *, dynamic_shapes: bool) -> None:
    """Compile each block in place (parameter names stay as they are).

    Args:
        blocks: the transformer blocks of a model.
        dynamic_shapes: the batches vary in shape: trace the batch and sequence
            dimensions as dynamic from the first call, and let dynamo keep
            :data:`GRAPH_BOUND` graphs of a block. False: automatic dynamic shapes, which
            trace fixed-shape rows (pretraining, packed SFT) as static graphs.
    """
    if dynamic_shapes:
        # the bound is structural (kinds of call x size-1 specialisations), not a guess
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, GRAPH_BOUND)
    for block in blocks:
        block.compile(dynamic=True if dynamic_shapes else None)


@dataclass
class CompileStats:
    """What ``torch.compile`` did during a run: the graphs it compiled and how many
    times a code object passed the recompile limit (after which it runs eagerly)."""

    graphs: int = 0
    recompile_limit_hits: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"graphs": self.graphs, "recompile_limit_hits": self.recompile_limit_hits}


def _counts() -> tuple[int, int]:
    """Dynamo's process-wide counters: graphs compiled, recompile-limit hits."""
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"].get("unique_graphs", 0))
    hits = sum(
        int(n) for reason, n in counters["unimplemented"].items() if "recompile limit" in reason
    )
    return graphs, hits


class _LimitWarning(logging.Handler):
    """Dynamo's recompile-limit warning, as one line of the library's own."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if _LIMIT_MESSAGE not in message:
            return
        where = next((ln.strip() for ln in message.splitlines() if "function:" in ln), "")
        log.warning(
            "torch.compile hit its recompile limit (%d)%s: that code now runs eagerly, "
            "slower; kernels.compile=false runs every block eagerly from the start",
            torch._dynamo.config.recompile_limit,
            f" in {where.removeprefix('function:').strip()}" if where else "",
        )


@contextmanager
def watch_compiles() -> Iterator[CompileStats]:
    """Count what ``torch.compile`` compiles inside the block into the yielded stats,
    and warn in one line when a code object hits the recompile limit."""
    stats = CompileStats()
    graphs, hits = _counts()
    handler = _LimitWarning(level=logging.WARNING)
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    try:
        yield stats
    finally:
        dynamo_log.removeHandler(handler)
        now_graphs, now_hits = _counts()
        stats.graphs = now_graphs - graphs
        stats.recompile_limit_hits = now_hits - hits
