r"""Each optimizer choice's state: the spec's estimate against the CUDA memory it takes.

For each of ``--optimizers`` the decoder of ``--recipe`` (default ``pretrain/llama_1b``,
its matrices, norms, embedding and head) is built on the GPU with a random gradient on
every parameter; the optimizer is built and steps once. Measured: what stays allocated
after the step (``torch.cuda.memory_allocated`` after minus before: the state), the peak
of the step above the start (``max_memory_allocated``: the state plus the step's
temporaries) and the bytes of the tensors in ``optimizer.state``. Estimated:
:func:`recipes_lib.optim.optimizer_state_bytes` over the same decoder on the meta device,
the figure the pre-launch check's memory estimate uses. The error is
``estimate / allocated - 1``; the target is within 1% (the allocator rounds every tensor
up to 512 bytes, so each 0-d ``step`` counter takes 512 bytes for its 4). On one 80 GB
GPU, in about a minute::

    python benchmarks/optimizer_memory.py

writes ``benchmarks/results/optimizer_memory_<card>.json`` (``--out`` elsewhere).
``--dtype bf16`` stores the weights in bf16 (``precision=bf16-true``); ``--layers`` keeps
fewer blocks. ``--smoke`` runs the tiny model on CPU (state bytes only, no CUDA figures).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import re
from pathlib import Path

import torch
from _common import benchmark_device, command_line, device_name, emit, package_versions

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.schema import OptimConfig
from recipes_lib.models import Transformer
from recipes_lib.optim import OPTIMIZERS, build_optimizer, optimizer_state_bytes
from recipes_lib.optim.state import optimizer_state_storage

HERE = Path(__file__).resolve()

TARGET_ERROR = 0.01
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def card(name: str) -> str:
    """A short name for the card, for the result's file name (``h100``)."""
    found = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    return (found.group(1) if found else re.sub(r"\W+", "_", name)).lower()


def measure(model: torch.nn.Module, config: OptimConfig, device: torch.device) -> dict:
    """One optimizer's step over ``model`` (whose gradients are set): its state's bytes."""
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    optimizer = build_optimizer(model, config)
    optimizer.step()
    result = {"state_tensor_bytes": optimizer_state_storage(optimizer)}
    if cuda:
        torch.cuda.synchronize(device)
        result["allocated_delta_bytes"] = torch.cuda.memory_allocated(device) - before
        result["peak_delta_bytes"] = torch.cuda.max_memory_allocated(device) - before
    del optimizer
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="pretrain/llama_1b")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--layers", type=int, default=None, help="keep this many blocks")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = benchmark_device(args.smoke)
    overrides = [f"recipe={'pretrain/tiny' if args.smoke else args.recipe}"]
    if args.layers is not None:
        overrides.append(f"model.n_layers={args.layers}")
    model_config = to_run_config(compose_config(overrides)).model
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(model_config).to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    with torch.device("meta"):
        shapes = Transformer(model_config).to(dtype)

    runs = []
    for name in args.optimizers:
        spec = OPTIMIZERS[name]
        if spec.needs_cuda and device.type != "cuda":
            continue
        package = spec.needs_package[0] if spec.needs_package else None
        if package and importlib.util.find_spec(package) is None:
            runs.append({"optimizer": name, "skipped": f"{package} is not installed"})
            continue
        config = OptimConfig(name=name)
        run = {"optimizer": name, "estimate_bytes": optimizer_state_bytes(shapes, config)}
        run.update(measure(model, config, device))
        measured = run.get("allocated_delta_bytes", run["state_tensor_bytes"])
        run["error"] = round(run["estimate_bytes"] / measured - 1, 6) if measured else None
        run["within_target"] = run["error"] is not None and abs(run["error"]) <= TARGET_ERROR
        runs.append(run)

    name = device_name(device)
    result = {
        "benchmark": "optimizer_memory",
        "command": command_line(),
        "device": name,
        "recipe": overrides[0].split("=", 1)[1],
        "layers": model_config.n_layers,
        "dtype": args.dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "target_error": TARGET_ERROR,
        "runs": runs,
        "versions": package_versions("bitsandbytes", "lightning"),
    }
    out = args.out
    if out is None and not args.smoke:
        out = str(HERE.parent / "results" / f"optimizer_memory_{card(name)}.json")
    emit(result, out)


if __name__ == "__main__":
    main()
