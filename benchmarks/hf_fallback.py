r"""Training throughput of the transformers fallback against the native path, on the
families that have both (``llama``, ``qwen3``).

For each family one transformers config (about 1B parameters by default; ``--tiny``: two
layers of width 64) is built twice through ``recipes_lib.training.build.build_model``, as
a run builds it: natively (``model.family=<family>``) and through the fallback
(``model.family=hf``, transformers' own ``AutoModelForCausalLM``), both from the same
seed, both with the head fused with the chunked loss (``kernels.loss_chunk_size``). Each
takes ``--steps`` AdamW steps on random token rows of ``--seq-len`` under bf16 autocast
(fp32 on the CPU), after ``--warmup`` untimed ones; tokens/s, step times, MFU and peak
memory are reported per path, and ``ratio`` is the fallback's tokens/s over the native
path's (the issue's target: at least 0.8).

Prints one JSON object to stdout. On the GPU machine::

    python benchmarks/hf_fallback.py --out $OUT/hf_fallback.json

``--tiny`` (or ``--smoke``) runs on the CPU in seconds, so CI can check that the script
works::

    python benchmarks/hf_fallback.py --tiny
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any

import torch
from _common import (
    StepTimer,
    benchmark_device,
    command_line,
    device_name,
    emit,
    package_versions,
    peak_bf16_tflops,
    reset_memory,
    throughput_report,
)

from recipes_lib.checkpoint.hf import model_config_from_hf
from recipes_lib.config.schema import KernelsConfig, PrecisionConfig, StrategyConfig
from recipes_lib.models.hf_fallback import fallback_model_config
from recipes_lib.training.build import ModelBuild, build_model

# about 1B parameters (Llama 3.2 1B's width and depth), and a tiny shape for the CPU
SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    ),
}
FAMILIES = ("llama", "qwen3")


def hf_config(family: str, shape: dict[str, Any]) -> dict[str, Any]:
    """A ``config.json`` of ``family`` with ``shape``, as transformers writes it."""
    import transformers

    config = transformers.AutoConfig.for_model(family, **shape, tie_word_embeddings=False)
    return config.to_dict()


def measure(path: str, config: dict[str, Any], args, device: torch.device) -> dict:
    """Train ``args.steps`` timed steps of one path; its throughput report."""
    if path == "native":
        model_config = model_config_from_hf(config, max_seq_len=args.seq_len)
    else:
        model_config = fallback_model_config(config, max_seq_len=args.seq_len)
    kernels = KernelsConfig(attention=args.attention, loss_chunk_size=args.loss_chunk)
    plan = ModelBuild(
        model=model_config, kernels=kernels, precision=PrecisionConfig(), strategy=StrategyConfig()
    )
    reset_memory(device)
    torch.manual_seed(0)
    model = build_model(plan, device=device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    vocab = model_config.vocab_size
    batches = [
        torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=generator).to(device)
        for _ in range(4)
    ]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    timer = StepTimer(device)
    loss = torch.tensor(float("nan"))
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            timer.start()
        rows = batches[step % len(batches)]
        with autocast:
            loss = model(rows[:, :-1], labels=rows[:, 1:], loss_chunk_size=args.loss_chunk)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            timer.step_end()
    timer.stop()
    report = throughput_report(
        timer,
        tokens_per_step=args.batch * args.seq_len,
        flops_per_token=model.flops_per_token(args.seq_len),
        peak_tflops=peak_bf16_tflops(device_name(device)) if device.type == "cuda" else None,
        final_loss=float(loss),
    )
    report["parameters"] = model.num_params()
    del model, optimizer
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny", "--smoke", dest="tiny", action="store_true", help="tiny shape on the CPU"
    )
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--attention", default="sdpa", help="kernels.attention of both paths")
    parser.add_argument("--loss-chunk", type=int, default=4096)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.seq_len = args.seq_len or (64 if tiny else 2048)
    args.batch = args.batch or (2 if tiny else 4)
    args.steps = args.steps or (3 if tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 5)
    device = benchmark_device(tiny)
    shape = SHAPES["tiny" if tiny else "1b"]
    result: dict[str, Any] = {
        "benchmark": "hf_fallback",
        "command": command_line(),
        "device": device_name(device),
        "versions": package_versions("transformers", "recipes-lib"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "shape": shape,
        "families": {},
    }
    failed = False
    for family in args.families:
        entry: dict[str, Any] = {}
        for path in ("native", "fallback"):
            try:
                entry[path] = measure(path, hf_config(family, shape), args, device)
            except Exception as err:  # noqa: BLE001 - recorded; the other paths still run
                failed = True
                entry[path] = {"status": "error", "error": repr(err)}
                traceback.print_exc(file=sys.stderr)
        native, fallback = entry["native"], entry["fallback"]
        if "tokens_per_sec" in native and "tokens_per_sec" in fallback:
            entry["ratio"] = round(fallback["tokens_per_sec"] / native["tokens_per_sec"], 3)
        result["families"][family] = entry
    emit(result, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
