"""Compiled blocks with a small, fixed number of graphs on any data, and what a run
compiled.

``torch.compile`` keeps one cache of graphs per code object: every transformer block of
every model in the process (the policy, a frozen reference or teacher) shares
``TransformerBlock.forward``'s, and the recompile limit counts them together. A graph
is guarded on the shapes it was traced with, on the grad mode and on the modules'
types, so each kind of call takes graphs of its own: the policy's training pass, its
no-grad passes (validation, a precomputed reference, KTO's twin rows), the
adapters-bypassed reference, a frozen model's pass (its projections stored narrower).
Dynamo's cache already keeps these apart: a no-grad pass never replaces the policy's
training graph, it only adds one beside it.

Left to dynamo's automatic dynamic shapes, each kind traced its first shape static,
then again with a changed dimension dynamic, then again for a batch of one row: on
data whose batches vary (preference pairs, padded rows) that was a dozen graphs, most
of them compiled inside the training steps. Tracing every dimension dynamic from the
first call (``dynamic=True``) needs fewer, but made DPO's steps 27% slower on an H200.
So where an objective's batches vary, only what varies is dynamic (``mark_varying``):

- the rows of a batch (dim 0 of the hidden states and of the attention mask's
  per-row tensors) are dynamic from the first call: how many rows a batch of packed
  pairs fills varies, their width (one for the run: the data's longest sequence,
  rounded up) does not and stays static;
- padded lengths are rounded up to a multiple of :data:`LENGTH_MULTIPLE`
  (:func:`bucketed_length`, used by every collate that pads to its longest row under
  compile), so the few distinct lengths align with the attention kernels' blocks; the
  second length a kind sees makes the length dynamic, once.

A kind thus takes one graph on packed rows and at most two on padded ones
(:data:`GRAPHS_PER_KIND`), each compiled in its first steps; a batch of a single row
would be specialised by dynamo and take a third, so packed preference batches hold at
least two rows. :data:`GRAPH_BOUND` is the recompile limit a varying-shape run sets.
A call the compiled path cannot take (dynamo or its backend fails on that shape) runs
eagerly instead, with one warning line naming the shape (:func:`call_block`).
:func:`watch_compiles` counts what a run compiled and turns a limit hit into one
warning line.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

CALL_KINDS = 4  # training; the policy without gradients; adapters bypassed; a frozen model
GRAPHS_PER_KIND = 2  # the first length static, then the length dynamic (padded rows)
GRAPH_BOUND = CALL_KINDS * GRAPHS_PER_KIND  # graphs of one compiled block, any data
# padded rows are a multiple of this long under compile: flex attention's block of 128
# keys, and matmul tiles; more lengths would only add guard checks, fewer would pad more
LENGTH_MULTIPLE = 128
MIN_ROWS = 2  # a batch of one row is specialised by dynamo: packed batches hold at least 2
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
        varying_shapes: the batches vary in shape: the rows are traced dynamic from the
            first call (:func:`mark_varying`) and dynamo may keep :data:`GRAPH_BOUND`
            graphs of a block. Fixed-shape rows (pretraining, packed SFT) take a static
            graph per kind of call.
    """
    if varying_shapes:
        # the bound is structural (kinds of call x their graphs), not a guess;
        # watch_compiles puts the process's own limit back when the run ends
        setattr(_config(), _LIMIT_NAME, max(recompile_limit(), GRAPH_BOUND))
        set_row_count_fusion(False)
    for block in blocks:
        block.compile()
        # read by mark_varying and call_block; torch types a module's attributes as
        # tensors or modules: a flag is neither
        block.varying_shapes = varying_shapes  # type: ignore[assignment]


# inductor's setting of its mix-order reduction (see set_row_count_fusion)
_FUSION_NAME = "mix_order_reduction"


def _inductor_triton():
    import torch._inductor.config as inductor

    return inductor.triton


def row_count_fusion() -> bool | None:
    """Whether inductor fuses a norm's backward reductions across rows and columns
    (None: this torch has no such fusion)."""
    return getattr(_inductor_triton(), _FUSION_NAME, None)


def set_row_count_fusion(on: bool | None) -> None:
    """Turn inductor's mix-order reduction on or off, for the process (None: leave it).

    That fusion (a norm's backward reducing over rows and columns in one kernel) is
    decided by comparing rows x width, and the rows alone, with fixed sizes, and the
    graph is guarded on the outcome. Batches of packed pairs two rows wide traced
    ``rows < 2.2`` into the guards, and the first three-row batch, at about step ten of
    SimPO on heavy-tailed pairs, compiled the blocks again inside the timed steps (an
    H200, torch 2.11; found with ``TORCH_LOGS=recompiles``). So a run whose blocks take
    varying rows compiles without it (:func:`compile_blocks`), as inductor did before
    it had it; :func:`watch_compiles` puts the process's setting back when the run ends.
    The backward graphs are compiled when the first backward runs, so the setting holds
    for the run, not only around the blocks' compile.
    """
    triton = _inductor_triton()
    if on is not None and hasattr(triton, _FUSION_NAME):
        setattr(triton, _FUSION_NAME, on)


# the environment variables torch's compile caches read, with the folder each takes
# under kernels.compile_cache: inductor's FX graphs and AOTAutograd entries, Triton's
# compiled kernels
CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
# the folders keep_compile_caches set, by variable: a later run in this process (a
# pipeline's next stage) may move them, as it may not move the user's own
_KEPT: dict[str, str] = {}


def keep_compile_caches(directory: str | None) -> dict[str, str]:
    """Point torch's compile caches into ``directory`` (``kernels.compile_cache``), so a
    later run on this machine reads the kernels this one compiles: its blocks' graphs
    come from the caches instead of inductor (`result.compiled["cache_hits"]`).

    A variable the user set already is left as it is (inductor writes its own default
    into ``TORCHINDUCTOR_CACHE_DIR`` once it has read it, and an earlier run in this
    process may have set either: those are not the user's);
    ``None`` leaves torch's default (``/tmp/torchinductor_<user>``, which a job's private
    ``/tmp`` does not keep). Both caches read their variable whenever they look up or
    write an entry.

    Returns:
        The variables set, and their folders.
    """
    if directory is None:
        return {}
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = Path(directory).expanduser()
    torch_defaults = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(default_cache_dir())}
    chosen = {
        name: str(root / folder)
        for name, folder in CACHE_VARIABLES.items()
        if os.environ.get(name, torch_defaults.get(name))
        in (torch_defaults.get(name), _KEPT.get(name))
    }
    os.environ.update(chosen)
    _KEPT.update(chosen)
    return chosen


def start_compile_workers() -> bool:
    """Start inductor's pool of compile workers now, for a run that will compile on a GPU.

    Inductor starts the pool (one process per CPU, each importing torch and Triton) when
    it compiles its first graph, so a cold run waited for it inside its first step.
    Started as a run begins, the workers come up while the data is prepared and the
    model loaded. Call it after :func:`keep_compile_caches`: the workers read the cache
    folders' variables from the environment they start with.

    Returns:
        Whether a pool was asked for: not without Triton (inductor then compiles C++ in
        the process), with one compile thread, or where torch's ``TORCH_WARM_POOL=0``
        turns the early start off.
    """
    from torch._inductor.async_compile import get_compile_threads, maybe_warm_pool
    from torch.utils._triton import has_triton_package

    if not has_triton_package() or get_compile_threads() <= 1:
        return False
    maybe_warm_pool()
    return os.environ.get("TORCH_WARM_POOL", "1") == "1"


def bucketed_length(length: int, limit: int | None = None) -> int:
    """The length a padded batch is widened to under compile: ``length`` rounded up to a
    multiple of :data:`LENGTH_MULTIPLE`, but never past ``limit`` (``data.seq_len``)
    when ``length`` fits it."""
    rounded = -(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    if limit is not None and length <= limit:
        rounded = min(rounded, limit)
    return rounded


def varying(block: nn.Module) -> bool:
    """Whether ``block`` was compiled for batches of varying shape."""
    return bool(getattr(block, "varying_shapes", False))


def mark_varying(*tensors: Tensor | None) -> None:
    """Trace dim 0 (the rows) of each tensor dynamic from the first call.

    Dynamo would specialise a size of 1 anyway, so those are left static; a dim it must
    specialise all the same (a guard on its value) is never an error.
    """
    for tensor in tensors:
        if tensor is not None and tensor.ndim > 0 and tensor.shape[0] >= MIN_ROWS:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


# the shapes of the calls the compiled path could not take, run eagerly from then on
_eager_shapes: set[tuple] = set()


def _shape_key(args: tuple) -> tuple:
    shapes = tuple(tuple(a.shape) for a in args if isinstance(a, Tensor))
    return (shapes, torch.is_grad_enabled())


def call_block(block: nn.Module, *args) -> Tensor:
    """``block(*args)``; where compiling it for these shapes fails, the call runs
    eagerly instead (and so does every later one of the same shapes), with one warning
    line naming the shapes: a slower step, never a crash."""
    if not hasattr(block, "varying_shapes") or torch.compiler.is_compiling():
        return block(*args)  # not compiled here, or inside a larger compiled region
    key = _shape_key(args)
    if key not in _eager_shapes:
        try:
            return block(*args)
        except _compile_errors() as err:
            _eager_shapes.add(key)
            log.warning(
                "torch.compile could not compile a block for inputs of shapes %s "
                "(%s: %s); these shapes run eagerly, slower",
                list(key[0]),
                type(err).__name__,
                str(err).strip().splitlines()[0][:200] if str(err).strip() else "",
            )
    with torch.compiler.set_stance("force_eager"):
        return block(*args)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What dynamo raises when it cannot trace or compile a call (not the call's own
    errors: those an eager rerun raises again)."""
    from torch._dynamo import exc

    errors: tuple[type[BaseException], ...] = (
        exc.Unsupported,
        exc.BackendCompilerFailed,
        exc.TorchRuntimeError,
        exc.UserError,
    )
    try:  # inductor's own (a kernel it cannot lower, such as flex on heads under 16 wide)
        from torch._inductor.exc import InductorError
    except ImportError:  # older torch wraps it in BackendCompilerFailed
        return errors
    return (*errors, InductorError)


@dataclass
class CompileStats:
    """What ``torch.compile`` did during a run: the graphs it compiled and how many
    times a code object passed the recompile limit (after which it runs eagerly)."""

    graphs: int = 0
    recompile_limit_hits: int = 0
    # graphs inductor took from its caches (FX graph and AOTAutograd) instead of compiling
    cache_hits: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "graphs": self.graphs,
            "recompile_limit_hits": self.recompile_limit_hits,
            "cache_hits": self.cache_hits,
        }


def _counts() -> tuple[int, int, int]:
    """Dynamo's process-wide counters: graphs compiled, recompile-limit hits, and
    inductor's cache hits."""
    try:  # dynamo's own bookkeeping: read, never written
        from torch._dynamo.utils import counters
    except ImportError:
        return 0, 0, 0
    none: Counter[str] = Counter()
    graphs = int(counters.get("stats", none).get("unique_graphs", 0))
    unimplemented = counters.get("unimplemented", none)
    hits = sum(int(n) for reason, n in unimplemented.items() if "recompile limit" in reason)
    cached = int(counters.get("inductor", none).get("fxgraph_cache_hit", 0))
    cached += int(counters.get("aot_autograd", none).get("autograd_cache_hit", 0))
    return graphs, hits, cached


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
    graphs, hits, cached = _counts()
    limit = recompile_limit()  # what compile_blocks may raise for the run, restored after
    fusion = row_count_fusion()  # what compile_blocks may turn off, restored after
    handler = _LimitWarning(level=logging.WARNING)
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    try:
        yield stats
    finally:
        dynamo_log.removeHandler(handler)
        setattr(_config(), _LIMIT_NAME, limit)
        set_row_count_fusion(fusion)
        now_graphs, now_hits, now_cached = _counts()
        stats.graphs = now_graphs - graphs
        stats.recompile_limit_hits = now_hits - hits
        stats.cache_hits = now_cached - cached
