"""Compiled blocks with a bounded number of graphs on any data, and what a run compiled.

``torch.compile`` keeps one cache of graphs per code object: every transformer block of
every model in the process (the policy, a frozen reference or teacher) shares
``TransformerBlock.forward``'s. A graph is guarded on the shapes it was traced with, on
the grad mode and on the modules' types, so each kind of call takes graphs of its own:
the policy's training pass, its no-grad passes (validation, a precomputed reference),
the adapters-bypassed reference, a frozen model's pass (its projections stored
narrower). Under dynamo's automatic dynamic shapes a kind first traces its static shape;
when a length changes it traces once more with that dimension dynamic, and again where
a dimension of size 1 (a batch of one row, a sequence of one attention block) is
specialised. On data whose batches vary in shape (preference pairs, unpadded rows,
rollouts) the kinds together passed dynamo's recompile limit of 8, and past it the
blocks ran eagerly, several times slower.

The count is bounded all the same: at most :data:`CALL_KINDS` kinds, each with its
static graph and at most :data:`SPECIALISATIONS` dynamic ones, so where batches vary the
recompile limit is raised to that bound (:data:`GRAPH_BOUND`). Tracing every dimension
as dynamic from the first call would need fewer graphs, but on an H200 it made DPO's
steps 27% slower than the static graph of the common shape.
:func:`watch_compiles` counts what a run compiled and turns a limit hit into one
warning line the user sees.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

CALL_KINDS = 4  # training; the policy without gradients; adapters bypassed; a frozen model
SPECIALISATIONS = 4  # dynamic graphs of a kind: batch and length each of size 1 or more
GRAPH_BOUND = CALL_KINDS * (1 + SPECIALISATIONS)  # graphs of one compiled block, any data
_LIMIT_MESSAGE = "recompile_limit"  # in dynamo's warning when a code object passes it
# dynamo's setting of the graphs one code object may keep (its older name before 2.7)
_LIMIT_NAME = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else ("cache_size_limit")
)


def _config():
    return torch._dynamo.config


def recompile_limit() -> int:
    """Dynamo's limit of graphs per code object, as this process has it now."""
    return int(getattr(_config(), _LIMIT_NAME))


def compile_blocks(blocks: Iterable[nn.Module], *, varying_shapes: bool) -> None:
    """Compile each block in place (parameter names stay as they are).

    Args:
        blocks: the transformer blocks of a model.
        varying_shapes: the batches vary in shape: let dynamo keep :data:`GRAPH_BOUND`
            graphs of a block. Fixed-shape rows (pretraining, packed SFT) take a graph
            per kind of call.
    """
    if varying_shapes:
        # the bound is structural (kinds of call x their graphs), not a guess;
        # watch_compiles puts the process's own limit back when the run ends
        setattr(_config(), _LIMIT_NAME, max(recompile_limit(), GRAPH_BOUND))
    for block in blocks:
        block.compile()


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
    try:  # dynamo's own bookkeeping: read, never written
        from torch._dynamo.utils import counters
    except ImportError:
        return 0, 0
    graphs = int(counters.get("stats", {}).get("unique_graphs", 0))
    unimplemented = counters.get("unimplemented", {})
    hits = sum(int(n) for reason, n in unimplemented.items() if "recompile limit" in reason)
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
            recompile_limit(),
            f" in {where.removeprefix('function:').strip()}" if where else "",
        )


@contextmanager
def watch_compiles() -> Iterator[CompileStats]:
    """Count what ``torch.compile`` compiles inside the block into the yielded stats,
    and warn in one line when a code object hits the recompile limit."""
    stats = CompileStats()
    graphs, hits = _counts()
    limit = recompile_limit()  # what compile_blocks may raise for the run, restored after
    handler = _LimitWarning(level=logging.WARNING)
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    try:
        yield stats
    finally:
        dynamo_log.removeHandler(handler)
        setattr(_config(), _LIMIT_NAME, limit)
        now_graphs, now_hits = _counts()
        stats.graphs = now_graphs - graphs
        stats.recompile_limit_hits = now_hits - hits
