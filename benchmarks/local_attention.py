r"""A Gemma 3 local layer against a global one at a long sequence.

One decoder block of a preset (default ``gemma3_1b``), built twice by the library: as a
local layer (attending to the last ``--window`` keys, the preset's window by default) and
as a global layer (every earlier key), at ``--seq-len`` tokens (default 8192), bf16
autocast over fp32 weights, forward and backward, each block compiled. It is timed for
each attention kernel in ``--kernels``: ``flex`` skips the blocks of the score matrix
outside the window (the local layer's work shrinks with it); ``sdpa`` takes the window
as a dense mask (which rules out its flash kernel). Prints one JSON object::

    python benchmarks/local_attention.py --out $OUT/local_attention.json

``--smoke`` runs a small block on CPU in fp32 without compilation, so CI can check that
the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.kernels import get_attention_backend
from recipes_lib.models.blocks import TransformerBlock
from recipes_lib.models.rope import rope_tables


def time_block(config, window_layers: list[int], kernel: str, args, device) -> dict:
    """Median and spread of a block's forward+backward, in ms, as layer 0."""
    model = replace(config, window_layers=window_layers, n_layers=1)
    backend = get_attention_backend(kernel)
    torch.manual_seed(0)
    head_dim = model.head_dim or model.dim // model.n_heads
    block = TransformerBlock(model, head_dim, backend, 0).to(device)
    if args.compile:
        block.compile()
    tables = rope_tables(model, head_dim, device)
    local = block.attention.local_rope
    cos = tables["rope_cos_local" if local else "rope_cos"][: args.seq_len]
    sin = tables["rope_sin_local" if local else "rope_sin"][: args.seq_len]
    mask = backend.build_mask(None, args.seq_len, device=device, window=block.attention.window)
    x = torch.randn(args.batch_size, args.seq_len, model.dim, device=device, requires_grad=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    times = []
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            y = block(x, cos, sin, mask)
        y.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - started) * 1000)
    return {
        "ms_median": round(statistics.median(times), 3),
        "ms_min": round(min(times), 3),
        "ms_max": round(max(times), 3),
        "steps": len(times),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3_1b", help="a preset of conf/model/")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--window", type=int, default=None, help="default: the preset's")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--kernels", default="flex,sdpa")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--smoke", action="store_true", help="a small block on CPU, seconds")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = to_run_config(compose_config([f"model={args.model}"])).model
    if args.smoke:
        config = replace(config, dim=64, n_heads=4, n_kv_heads=1, head_dim=16, ffn_dim=128)
        args.seq_len, args.steps, args.warmup, args.compile = 256, 2, 1, False
        args.window = args.window or 32
    window = args.window or config.sliding_window
    config = replace(config, sliding_window=window, max_seq_len=max(args.seq_len, 1))
    result: dict = {
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "window": window},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "kernels": {},
    }
    status = 0
    for kernel in [k for k in args.kernels.split(",") if k]:
        entry = {}
        for label, layers in (("local", [0]), ("global", [])):
            try:
                entry[label] = time_block(config, layers, kernel, args, device)
            except Exception as err:  # recorded; the other measurements still run
                entry[label] = {"error": f"{type(err).__name__}: {err}"[:500]}
                status = 1
        if "ms_median" in entry["local"] and "ms_median" in entry["global"]:
            entry["local/global"] = round(
                entry["local"]["ms_median"] / entry["global"]["ms_median"], 3
            )
        result["kernels"][kernel] = entry
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
