r"""The experts of a mixture-of-experts layer: one grouped GEMM per weight against a loop
over the experts, forward + backward.

For each (experts, top-k) case, one MoE layer (:class:`recipes_lib.models.moe.MoEFeedForward`
with its router) of ``--dim`` width and ``--ffn-dim`` per expert, on ``--tokens`` tokens,
bf16 autocast over fp32 weights, timed both ways on this card in this process: the
grouped path (``torch._grouped_mm`` over the tokens sorted by expert) and the loop (one
matmul per expert over its rows, which needs the counts on the host). Neither is
compiled. Also reports how far the two outputs are apart (bf16). Prints one JSON object::

    python benchmarks/moe_experts.py --out $OUT/moe_experts.json

``--smoke`` runs small cases on CPU (the grouped path through PyTorch's CPU fallback).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import benchmark_device, command_line, device_name, emit, package_versions

from recipes_lib.config.schema import ModelConfig
from recipes_lib.models.blocks import FeedForward
from recipes_lib.models.moe import MoEFeedForward


def time_layer(
    layer: MoEFeedForward, x: torch.Tensor, path: str, args
) -> tuple[dict, torch.Tensor]:
    layer.experts.path = path
    device = x.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    times, out = [], None
    for step in range(args.warmup + args.steps):
        layer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            out = layer(x)
        out.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - started) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}, out.detach().float()


def case(experts: int, top_k: int, args, device) -> dict:
    config = ModelConfig(
        family="qwen3_moe",
        dim=args.dim,
        n_layers=1,
        moe_experts=experts,
        moe_top_k=top_k,
        moe_ffn_dim=args.ffn_dim,
    )
    torch.manual_seed(0)
    layer = MoEFeedForward(config, FeedForward).to(device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, args.tokens, args.dim, device=device)
    grouped, y_grouped = time_layer(layer, x, "grouped", args)
    loop, y_loop = time_layer(layer, x, "loop", args)
    return {
        "experts": experts,
        "top_k": top_k,
        "grouped": grouped,
        "loop": loop,
        "loop/grouped": round(loop["median_ms"] / grouped["median_ms"], 3),
        "max_abs_diff": float((y_grouped - y_loop).abs().max()),
        "output_abs_mean": float(y_loop.abs().mean()),
    }


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="8x2,64x8", help="experts x top-k, comma-separated")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--ffn-dim", type=int, default=768)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a small case on CPU, seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.dim, args.ffn_dim, args.steps, args.warmup = 64, 32, 16, 2, 1
    device = benchmark_device(args.smoke)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    result = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "device": device_name(device),
        "versions": package_versions("torch"),
        "command": command_line(),
        "cases": [case(e, k, args, device) for e, k in cases],
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
