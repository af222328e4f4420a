r"""Forward + backward throughput of each attention backend, causal and document-masked.

Every backend is called through ``recipes_lib.kernels`` -- ``build_mask(doc_ids, T)`` once
per batch, then ``backend(q, k, v, mask)`` -- exactly as ``recipes_lib.models.Transformer``
calls it, with ``q``/``k``/``v`` laid out as the model's projections give them
(``(B, T, heads, D)`` storage viewed as ``(B, heads, T, D)``). For each head dim (64, 128)
and sequence length (2048, 4096, 8192) the batch and head counts keep the work per call
fixed: ``B * T`` tokens (default 16384) and ``n_heads * head_dim`` (default 2048, so 32
heads of 64 or 16 of 128); ``--gqa-group`` shares each key/value head between that many
query heads. Masks:

- ``causal``: every token attends to the ones before it in its row.
- ``document_mean<N>``: rows packed with documents whose lengths are drawn (fixed seed)
  from an exponential distribution of mean ``N`` tokens; a token attends causally within
  its own document only. ``sdpa`` cannot do this and is recorded as unsupported.
  ``documents`` and ``mean_document_len`` count what the rows hold (a document cut at a
  row's end counts once in each row), ``masked_in_fraction`` the ``(q, k)`` pairs kept.

FLOPs of one call are ``4 * B * H * T^2 * D * f * 3.5`` (forward 1x, backward 2.5x).
``tflops_dense_equivalent`` takes ``f = 0.5``, the causal convention, for every mask, so
it compares token throughput across masks; ``tflops_effective`` takes the fraction of
the ``T x T`` matrix that the mask actually keeps (``(T + 1) / 2T`` causal, much less
with documents), so it tells how well a kernel uses the work it must do.

Times are CUDA-event gaps between consecutive fwd+bwd calls after warmup; the first call,
where ``flex`` compiles, is reported apart as ``first_call_s``. Each (head dim, length)
shape starts from ``torch._dynamo.reset()``, so ``flex`` compiles for static shapes, as a
training run does for its one shape. Mask building is timed on its own (``mask_build``),
the first build (compilation included) apart from later builds of fresh ``doc_ids``. At
each shape ``ratios_to_sdpa_causal`` divides every backend's tokens/s by that of causal
``sdpa``; ``summary`` collects the flex document-masked ones against the 0.8 target.

Prints one JSON object to stdout. On the GPU machine (a few minutes on an H100, most
of it compilation; progress on stderr)::

    python benchmarks/attention.py --out $OUT/attention.json

A configuration that fails is recorded as ``{"status": "error", ...}``, the others still
run, and the exit status is 1. ``--smoke`` runs tiny shapes on CPU in fp32 (no
compilation there) in seconds, so CI can check that the script works.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch
from _common import (
    StepTimer,
    command_line,
    device_name,
    emit,
    package_versions,
    peak_bf16_tflops,
    reset_memory,
    synchronize,
)
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask

from recipes_lib.errors import UnsupportedKernelError
from recipes_lib.kernels import ATTENTION_BACKENDS, AttentionBackend, get_attention_backend

CAUSAL = "causal"
FWD_BWD_FLOPS_FACTOR = 3.5  # forward 1x + backward 2.5x
CAUSAL_CONVENTION_FRACTION = 0.5
TARGET_RATIO = 0.8  # document-masked flex within 20% of causal sdpa tokens/s


@dataclass(frozen=True)
class Shape:
    batch_size: int
    n_heads: int
    n_kv_heads: int
    seq_len: int
    head_dim: int

    @property
    def key(self) -> str:
        return f"hd{self.head_dim}_T{self.seq_len}"

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def fwd_bwd_flops(self, fraction: float) -> float:
        B, H, T, D = self.batch_size, self.n_heads, self.seq_len, self.head_dim
        return 4 * B * H * T * T * D * fraction * FWD_BWD_FLOPS_FACTOR


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (tiny CPU figures must not round to 0)."""
    return float(f"{x:.{digits}g}")


def document_name(mean_len: int) -> str:
    return f"document_mean{mean_len}"


def document_ids(batch: int, seq_len: int, mean_len: int, seed: int) -> torch.Tensor:
    """``(B, T)`` int32 ids of documents of exponentially distributed lengths, packed.

    Documents are laid end to end over the ``B * T`` tokens and cut into rows, as the
    packed pretraining data does; a document cut at a row's end goes on in the next row.
    """
    generator = torch.Generator().manual_seed(seed)
    n_tokens = batch * seq_len
    lengths = torch.empty(0, dtype=torch.long)
    while int(lengths.sum()) < n_tokens:
        draw = torch.empty(max(8, 2 * n_tokens // mean_len)).exponential_(
            1 / mean_len, generator=generator
        )
        lengths = torch.cat([lengths, draw.ceil().long()])  # each >= 1
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    return ids[:n_tokens].view(batch, seq_len)  # (B, T)


def document_stats(doc_ids: torch.Tensor) -> dict:
    """Documents per batch (pieces within rows), their mean length and the kept fraction."""
    B, T = doc_ids.shape
    pieces, kept_pairs = 0, 0
    for row in doc_ids:
        _, counts = torch.unique_consecutive(row, return_counts=True)
        pieces += len(counts)
        kept_pairs += int((counts * (counts + 1) // 2).sum())  # causal within each piece
    return {
        "documents": pieces,
        "mean_document_len": round(B * T / pieces, 1),
        "masked_in_fraction": kept_pairs / (B * T * T),
    }


def attention_inputs(shape: Shape, device, dtype, seed: int):
    """``q (B, H, T, D)``, ``k, v (B, Hkv, T, D)`` needing grad, and an output gradient.

    Each is a transposed view of ``(B, T, heads, D)`` storage, the layout in which the
    model's projections hand them to the backend (and receive the output's gradient).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    B, T, D = shape.batch_size, shape.seq_len, shape.head_dim

    def make(heads: int, grad: bool) -> torch.Tensor:
        x = torch.randn(B, T, heads, D, device=device, dtype=dtype, generator=generator)
        return x.requires_grad_(grad).transpose(1, 2)  # (B, heads, T, D)

    q, k, v = make(shape.n_heads, True), make(shape.n_kv_heads, True), make(shape.n_kv_heads, True)
    return q, k, v, make(shape.n_heads, False)


def fwd_bwd(backend: AttentionBackend, q, k, v, mask, grad_out) -> None:
    out = backend(q, k, v, mask)  # (B, H, T, D)
    torch.autograd.grad(out, (q, k, v), grad_out)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def time_mask_builds(
    backend: AttentionBackend, doc_id_sets: list[torch.Tensor | None], T: int, device
) -> tuple[object | None, dict]:
    """Builds a mask from each set of ``doc_ids`` (None: causal), timing each build.

    Returns the first mask and the wall time of its build (compilation included) apart
    from the median of the later builds, which is what every further batch costs.
    """
    masks, times = [], []
    for doc_ids in doc_id_sets:
        doc_ids = doc_ids.to(device) if doc_ids is not None else None
        synchronize(device)
        t0 = time.perf_counter()
        masks.append(backend.build_mask(doc_ids, T, device=device))
        synchronize(device)
        times.append(time.perf_counter() - t0)
    rebuild_ms = [t * 1e3 for t in times[1:]]
    report = {
        "first_build_s": _sig(times[0]),  # compiles if the shape's first such build
        "rebuild_ms_median": _sig(statistics.median(rebuild_ms)) if rebuild_ms else None,
        "rebuilds": len(rebuild_ms),
    }
    return masks[0], report


def measure(
    backend: AttentionBackend,
    shape: Shape,
    doc_mean_len: int | None,
    fraction: float,
    args,
    device: torch.device,
) -> dict:
    """Times fwd+bwd of one backend under one mask (causal when ``doc_mean_len`` is None)."""
    B, T = shape.batch_size, shape.seq_len
    if doc_mean_len is None:
        build_sets: list[torch.Tensor | None] = [None] * (1 + args.mask_rebuilds)
    else:  # the measured layout first, then fresh ones, as every batch brings
        seeds = [args.seed + i for i in range(1 + args.mask_rebuilds)]
        build_sets = [document_ids(B, T, doc_mean_len, seed) for seed in seeds]
    mask, build_report = time_mask_builds(backend, build_sets, T, device)
    q, k, v, grad_out = attention_inputs(shape, device, args.dtype, args.seed)

    synchronize(device)
    t0 = time.perf_counter()
    fwd_bwd(backend, q, k, v, mask, grad_out)  # flex compiles here on CUDA
    synchronize(device)
    first_call_s = time.perf_counter() - t0
    graphs_before = counters["stats"]["unique_graphs"]
    for _ in range(args.warmup):
        fwd_bwd(backend, q, k, v, mask, grad_out)
    timer = StepTimer(device)
    timer.start()
    for _ in range(args.iters):
        fwd_bwd(backend, q, k, v, mask, grad_out)
        timer.step_end()
    timer.stop()

    step_ms = timer.step_times_ms()
    median_s = statistics.median(step_ms) / 1e3
    dense_tflops = shape.fwd_bwd_flops(CAUSAL_CONVENTION_FRACTION) / median_s / 1e12
    report = {
        "status": "ok",
        "fwd_bwd_ms": {
            "median": round(statistics.median(step_ms), 4),
            "mean": round(statistics.fmean(step_ms), 4),
            "min": round(min(step_ms), 4),
            "max": round(max(step_ms), 4),
        },
        "iters": len(step_ms),
        "tokens_per_sec": _sig(shape.tokens / median_s, 6),
        "tflops_dense_equivalent": _sig(dense_tflops),
        "tflops_effective": _sig(shape.fwd_bwd_flops(fraction) / median_s / 1e12),
        "fraction_of_peak_dense_equivalent": (
            round(dense_tflops / args.peak, 4) if args.peak else None
        ),
        "first_call_s": round(first_call_s, 3),
        # nonzero: a recompile crept into warmup or timing (a guard failing per call)
        "graphs_compiled_after_first_call": counters["stats"]["unique_graphs"] - graphs_before,
        "mask_build": build_report,
        "peak_memory_gib": (
            round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            if device.type == "cuda"
            else None
        ),
    }
    if isinstance(mask, BlockMask):  # the share of 128x128 blocks the kernel visits
        report["flex_computed_block_fraction"] = round(1 - mask.sparsity() / 100, 4)
    return report


def benchmark_config(
    backend: AttentionBackend,
    shape: Shape,
    doc_mean_len: int | None,
    fraction: float,
    args,
    device: torch.device,
) -> dict:
    """One backend under one mask: its figures, or why it did not run."""
    reason = backend.unavailable_reason()
    if reason is not None:
        return {"status": "unavailable", "reason": reason}
    try:
        backend.check(device=device, dtype=args.dtype, document_mask=doc_mean_len is not None)
    except UnsupportedKernelError as err:
        return {"status": "unsupported", "reason": str(err)}
    free_memory(device)
    try:
        return measure(backend, shape, doc_mean_len, fraction, args, device)
    except Exception as err:  # one configuration failing (e.g. out of memory) spares the rest
        traceback.print_exc(file=sys.stderr)
        return {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000]}
    finally:
        free_memory(device)


def benchmark_shape(shape: Shape, args, device: torch.device, log) -> dict:
    reset_memory(device)  # also torch._dynamo.reset(): flex compiles for this shape afresh
    backends = {name: get_attention_backend(name) for name in args.backends}
    T = shape.seq_len
    masks: dict[str, dict] = {CAUSAL: {"masked_in_fraction": (T + 1) / (2 * T)}}
    for mean_len in args.doc_mean_lens:
        doc_ids = document_ids(shape.batch_size, T, mean_len, args.seed)
        masks[document_name(mean_len)] = {"doc_mean_len": mean_len, **document_stats(doc_ids)}
    for mask_name, entry in masks.items():
        entry["backends"] = {}
        for name, backend in backends.items():
            report = benchmark_config(
                backend,
                shape,
                entry.get("doc_mean_len"),
                entry["masked_in_fraction"],
                args,
                device,
            )
            entry["backends"][name] = report
            if report["status"] == "ok":
                log(
                    f"{shape.key} {mask_name} {name}: {report['fwd_bwd_ms']['median']:.3f} ms, "
                    f"{report['tflops_effective']:.4g} TFLOP/s effective, "
                    f"{report['tflops_dense_equivalent']:.4g} dense-equivalent "
                    f"(first call {report['first_call_s']:.1f} s)"
                )
            else:
                log(f"{shape.key} {mask_name} {name}: {report['status']}")

    base = masks[CAUSAL]["backends"].get("sdpa", {}).get("tokens_per_sec")
    ratios = {  # None where causal sdpa did not run
        f"{name}_{mask_name}/sdpa_causal": (
            round(report["tokens_per_sec"] / base, 4) if base else None
        )
        for mask_name, entry in masks.items()
        for name, report in entry["backends"].items()
        if report["status"] == "ok" and (name, mask_name) != ("sdpa", CAUSAL)
    }
    return {
        **asdict(shape),
        "tokens_per_call": shape.tokens,
        "masks": masks,
        "ratios_to_sdpa_causal": ratios,
    }


def summarize(shapes: dict, doc_mean_lens: list[int]) -> dict:
    by_shape = {
        key: {
            document_name(m): entry["ratios_to_sdpa_causal"].get(
                f"flex_{document_name(m)}/sdpa_causal"
            )
            for m in doc_mean_lens
        }
        for key, entry in shapes.items()
    }
    values = [r for ratios in by_shape.values() for r in ratios.values()]
    return {
        "flex_document_over_sdpa_causal_tokens_per_sec": by_shape,
        "target": TARGET_RATIO,
        "all_within_target": (
            all(r >= TARGET_RATIO for r in values) if values and None not in values else None
        ),
    }


def _ints(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(ATTENTION_BACKENDS), help="comma-separated")
    p.add_argument("--seq-lens", default="2048,4096,8192")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--doc-mean-lens", default="512,1024", help="mean document lengths")
    p.add_argument("--tokens-per-call", type=int, default=16384, help="B * T, held fixed")
    p.add_argument("--heads-width", type=int, default=2048, help="n_heads * head_dim, fixed")
    p.add_argument("--gqa-group", type=int, default=1, help="query heads per key/value head")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--mask-rebuilds", type=int, default=5, help="timed builds after the first")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the lookup")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, fp32")
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if unknown := set(args.backends) - set(ATTENTION_BACKENDS):
        p.error(f"unknown backends {sorted(unknown)}; choose from {ATTENTION_BACKENDS}")
    args.seq_lens, args.head_dims = _ints(args.seq_lens), _ints(args.head_dims)
    args.doc_mean_lens = _ints(args.doc_mean_lens)
    args.dtype = torch.bfloat16
    if args.smoke:
        args.seq_lens, args.head_dims, args.doc_mean_lens = [128, 256], [32], [48]
        args.tokens_per_call, args.heads_width = 512, 128
        args.warmup, args.iters, args.mask_rebuilds = 1, 2, 1
        args.dtype = torch.float32
    for T in args.seq_lens:
        if args.tokens_per_call % T:
            p.error(f"--tokens-per-call {args.tokens_per_call} is not a multiple of T={T}")
    for D in args.head_dims:
        if args.heads_width % D or (args.heads_width // D) % args.gqa_group:
            p.error(
                f"--heads-width {args.heads_width} / head dim {D} is not a whole number "
                f"of heads divisible by --gqa-group {args.gqa_group}"
            )
    if args.iters < 1:
        p.error("--iters must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device; run with --smoke for the CPU check")
    name = device_name(device)
    args.peak = args.peak_tflops or (
        peak_bf16_tflops(name) if args.dtype == torch.bfloat16 else None
    )
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", file=sys.stderr, flush=True)

    shapes = [
        Shape(
            batch_size=args.tokens_per_call // T,
            n_heads=args.heads_width // D,
            n_kv_heads=args.heads_width // D // args.gqa_group,
            seq_len=T,
            head_dim=D,
        )
        for D in args.head_dims
        for T in args.seq_lens
    ]
    results = {shape.key: benchmark_shape(shape, args, device, log) for shape in shapes}
    sdpa_flags = {
        kernel: getattr(torch.backends.cuda, f"{kernel}_sdp_enabled")()
        for kernel in ("flash", "mem_efficient", "cudnn", "math")
    }
    result = {
        "benchmark": "attention",
        "device": name,
        "peak_tflops_per_card": args.peak,
        "versions": package_versions("flash-attn", "recipes-lib"),
        "command": command_line(),
        "settings": {
            "backends": args.backends,
            "dtype": str(args.dtype).removeprefix("torch."),
            "tokens_per_call": args.tokens_per_call,
            "heads_width": args.heads_width,
            "gqa_group": args.gqa_group,
            "seq_lens": args.seq_lens,
            "head_dims": args.head_dims,
            "doc_mean_lens": args.doc_mean_lens,
            "doc_length_distribution": "exponential, lengths rounded up, packed end to end "
            "across the batch's rows; ids from seed (rebuild timing: seed + 1, ...)",
            "warmup": args.warmup,
            "iters": args.iters,
            "mask_rebuilds": args.mask_rebuilds,
            "seed": args.seed,
            "flops": "4 * B * H * T^2 * D * fraction * 3.5 (fwd 1x + bwd 2.5x); fraction "
            "0.5 for dense_equivalent, the mask's masked_in_fraction for effective",
            "timing": "median of CUDA-event gaps between consecutive fwd+bwd calls "
            "(torch.autograd.grad of q, k, v) after the first call and the warmup",
            "compile": "flex compiles once per shape (torch._dynamo.reset() between shapes), "
            "static shapes, on its first call (first_call_s)",
            "sdpa_kernels_enabled": sdpa_flags,
        },
        "shapes": results,
        "summary": summarize(results, args.doc_mean_lens),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    figures = main()
    reports = [
        report
        for shape in figures["shapes"].values()
        for mask in shape["masks"].values()
        for report in mask["backends"].values()
    ]
    sys.exit(1 if any(report["status"] == "error" for report in reports) else 0)
