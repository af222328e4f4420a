r"""Pretraining throughput of recipes_lib against a plain PyTorch loop and Hugging Face.

For each model preset (a YAML file of ``conf/model/``) three trainers train the same
decoder shape in this process, on this card, on the same random-token batches (fixed
seed; data loading is not measured), with the same micro-batch size, fused AdamW (lr
3e-4, weight decay 0.1 on weight matrices only, via ``recipes_lib.optim.build_optimizer``),
gradient clipping at 1.0 and a constant LR:

- ``recipes_lib``: the library's own path, built as ``recipes-train`` builds it
  (``compose_config`` -> ``build_trainer`` / ``build_stage``) with the overrides
  ``strategy=--strategy``, ``precision=--precision``,
  ``kernels.activation_checkpointing``, ``kernels.compile`` (each block compiled).
  ``--precisions bf16-mixed,fp8`` measures it once per precision, in this process, on
  this card: the first is reported as ``recipes_lib``, the others as
  ``recipes_lib_<precision>``, with ``precision_comparison`` giving each one's tokens/s
  ratio to the first. ``--guard-off`` measures it once more with ``guard.policy=off``
  (``recipes_lib_guard_off``): what checking every update for non-finite values costs.
  ``--attention flex,auto`` measures it once per ``kernels.attention`` choice, at the
  first precision: the first is ``recipes_lib`` (and the baselines' kernel), the others
  ``recipes_lib_attention_<choice>``, with ``attention_comparison`` giving each one's
  ratios to the first; each report names the backend of each kind of layer
  (``auto``: flex in the sliding-window layers, SDPA in the global ones).
- ``plain_pytorch``: the same ``recipes_lib.models.Transformer``, blocks compiled the
  same way, same attention kernel, bf16 autocast over fp32 weights, trained by a bare
  loop (no Lightning).
- ``hf_transformers``: transformers' own model of the preset's family and shape
  (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``, ...: the
  ``config.json`` the library exports) with SDPA attention, each decoder layer
  compiled, trained by the same bare loop; a mixture of experts with transformers'
  ``experts_implementation=--hf-experts`` (default ``grouped_mm``, its fastest).

All use the same FLOPs count (``Transformer.flops_per_token``) for TFLOP/s and MFU,
against the card's dense bf16 peak (also for FP8, so FP8's MFU reads as "bf16
equivalents"). The first ``--warmup-steps`` steps (where compilation happens) are not
timed. Prints one JSON object to stdout. On the GPU machine::

    python benchmarks/pretrain_throughput.py --models gpt_124m,llama_1b \
        --precisions bf16-mixed,fp8 --out $OUT/pretrain_throughput.json
    python benchmarks/pretrain_throughput.py --models gemma3_1b --seq-len 8192 \
        --trainers recipes_lib --batch-size 2 --loss-chunk-size 4096 \
        --attention flex,auto --out $OUT/gemma3_attention.json

A trainer that fails (out of memory, say) is recorded as ``{"error": ...}``, the others
still run, and the exit status is 1. ``--smoke`` runs the tiny preset on CPU in fp32
without compilation, end to end in seconds, so CI can check that the script works.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict

import lightning as L
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
from _library import (
    GRAD_CLIP,
    compose_run,
    fit_measured,
    flag,
    measured_run_overrides,
    meta_transformer,
    synthetic_batches,
    temporary_run_dir,
)

from recipes_lib.checkpoint.hf_export import hf_config_from_model
from recipes_lib.config import ModelConfig, OptimConfig, list_group_options
from recipes_lib.kernels import ATTENTION_CHOICES
from recipes_lib.losses import causal_lm_loss
from recipes_lib.models import Transformer
from recipes_lib.models.windows import attention_choice
from recipes_lib.optim import build_optimizer

TRAINERS = ("recipes_lib", "plain_pytorch", "hf_transformers")
STRATEGIES = ("single", "ddp", "fsdp")
PRECISIONS = ("bf16-mixed", "bf16-true", "fp8", "32-true")
DEFAULT_BATCH_SIZES = {"gpt_124m": 32, "llama_1b": 8, "tiny": 4}  # the recipes' micro-batches
FALLBACK_BATCH_SIZE = 8

Batch = dict[str, torch.Tensor]
Measured = tuple[StepTimer, float]  # the timer of the measured steps, the last loss


# --------------------------------------------------------------------------- trainers
def recipes_lib_overrides(
    name: str,
    precision: str,
    batch_size: int,
    args,
    device: torch.device,
    run_dir: str,
    guard: str = "auto",
    attention: str | None = None,
) -> list[str]:
    """What ``recipes-train`` would be given for this measurement (``attention``:
    ``kernels.attention``, default the first of ``--attention``)."""
    chunk = args.loss_chunk_size
    return [
        f"guard.policy={guard}",
        f"model={name}",
        *args.model_override,
        f"kernels.attention={attention or args.attention}",
        f"kernels.compile={flag(args.compile)}",
        f"kernels.loss_chunk_size={'null' if chunk is None else chunk}",
        f"kernels.activation_checkpointing={flag(args.activation_checkpointing)}",
        f"strategy={args.strategy}",
        f"precision={precision}",
        *measured_run_overrides(
            steps=args.warmup_steps + args.steps,
            seq_len=args.seq_len,
            batch_size=batch_size,
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            run_dir=run_dir,
            seed=args.seed,
            monitors=args.monitors,
        ),
    ]


def run_recipes_lib(
    name: str,
    precision: str,
    batches: list[Batch],
    args,
    device: torch.device,
    guard: str,
    attention: str | None = None,
) -> Measured:
    batch_size = batches[0]["input_ids"].shape[0]
    with temporary_run_dir() as root:
        overrides = recipes_lib_overrides(
            name, precision, batch_size, args, device, root, guard, attention
        )
        cfg = compose_run(overrides)
        fit = fit_measured(cfg, batches, warmup_steps=args.warmup_steps, device=device)
        return fit.timer, fit.final_loss


def plain_loop(
    model: torch.nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    batches: list[Batch],
    optim: OptimConfig,
    args,
    device: torch.device,
) -> Measured:
    """Autocast forward, fp32 cross-entropy, backward, clip, fused AdamW, zero grads."""
    optimizer = build_optimizer(model, optim)
    # CausalLMModule compiles its loss (fp32 upcast fused with log-softmax) with its blocks
    loss_fn = torch.compile(causal_lm_loss) if args.compile else causal_lm_loss
    timer = StepTimer(device)
    model.train()
    for step, batch in enumerate(batches):
        if step == args.warmup_steps:
            timer.start()
        input_ids = batch["input_ids"].to(device, non_blocking=True)  # (B, T)
        labels = batch["labels"].to(device, non_blocking=True)  # (B, T)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = forward(input_ids)  # (B, T, V)
        loss = loss_fn(logits, labels)  # the library's loss, compiled alike
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup_steps:
            timer.step_end()
    timer.stop()
    return timer, loss.item()


def run_plain_pytorch(
    cfg: ModelConfig, optim: OptimConfig, batches: list[Batch], args, device
) -> Measured:
    with device:
        model = Transformer(cfg, attention=args.attention)
    if args.compile:
        for block in model.layers:
            block.compile()  # as CausalLMModule.configure_model does
    return plain_loop(model, model, batches, optim, args, device)


def hf_model_config(cfg: ModelConfig):
    """The transformers config of ``cfg``'s family and shape (``LlamaConfig``,
    ``Qwen3Config``, ``Gemma3TextConfig``, ...): the ``config.json`` the library exports."""
    from transformers import AutoConfig

    fields = hf_config_from_model(cfg)
    model_type = fields.pop("model_type")
    for key in ("architectures", "torch_dtype", "dtype", "use_cache"):
        fields.pop(key, None)
    return AutoConfig.for_model(model_type, use_cache=False, **fields)


def run_hf_transformers(
    cfg: ModelConfig, optim: OptimConfig, batches: list[Batch], args, device
) -> Measured:
    from transformers import AutoModelForCausalLM

    # a mixture of experts: transformers' fastest experts kernel (--hf-experts)
    experts = {"experts_implementation": args.hf_experts} if cfg.moe_experts else {}
    with device:
        try:
            model = AutoModelForCausalLM.from_config(
                hf_model_config(cfg), attn_implementation="sdpa", **experts
            )
        except ValueError as err:  # a model without SDPA (gpt-oss): its flex attention
            if "scaled_dot_product_attention" not in str(err):
                raise
            model = AutoModelForCausalLM.from_config(
                hf_model_config(cfg), attn_implementation="flex_attention", **experts
            )
        model = model.to(dtype=torch.float32)
    expected = meta_transformer(cfg).num_params()
    if model.num_parameters() != expected:
        raise RuntimeError(
            f"{type(model).__name__} has {model.num_parameters()} parameters, the recipes_lib "
            f"Transformer {expected}: the shapes differ"
        )
    if args.compile:
        for layer in model.model.layers:
            layer.compile()  # per decoder layer, like the recipes_lib blocks
    forward = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    return plain_loop(model, forward, batches, optim, args, device)


BASELINES = {"plain_pytorch": run_plain_pytorch, "hf_transformers": run_hf_transformers}


# ------------------------------------------------------------------------------ main
def recipes_lib_key(precision: str, args) -> str:
    """``recipes_lib`` for the first of ``--precisions``, ``recipes_lib_<p>`` for the rest."""
    return "recipes_lib" if precision == args.precisions[0] else f"recipes_lib_{precision}"


def measure(label: str, work: Callable[[], Measured], device, tokens_per_step, flops, peak) -> dict:
    """``work()``'s figures, or ``{"error": ...}`` when it fails (the others still run)."""
    print(f"{label} ...", file=sys.stderr, flush=True)
    reset_memory(device)
    try:
        timer, final_loss = work()
        report = throughput_report(
            timer,
            tokens_per_step=tokens_per_step,
            flops_per_token=flops,
            peak_tflops=peak,
            final_loss=final_loss,
        )
    except Exception as err:  # one trainer failing (e.g. out of memory) spares the rest
        traceback.print_exc(file=sys.stderr)
        report = {"error": f"{type(err).__name__}: {err}"[:2000]}
    print(f"{label}: {report}", file=sys.stderr, flush=True)
    return report


def _ratio(a: dict, b: dict, key: str) -> float | None:
    x, y = a.get(key), b.get(key)
    numbers = isinstance(x, float | int) and isinstance(y, float | int)
    return round(x / y, 4) if numbers and y else None


def benchmark_model(name: str, args, device: torch.device, peak: float | None) -> dict:
    batch_size = args.batch_sizes.get(name, DEFAULT_BATCH_SIZES.get(name, FALLBACK_BATCH_SIZE))
    # The composed config gives the model shape and optimizer that every trainer uses.
    run_cfg = compose_run(
        recipes_lib_overrides(name, args.precisions[0], batch_size, args, device, "unused"),
        check=False,  # a precision this machine lacks fails in its own measurement
    )
    cfg, optim = run_cfg.model, run_cfg.optim
    shape = meta_transformer(cfg)
    flops_per_token = shape.flops_per_token(args.seq_len)
    batches = synthetic_batches(
        cfg.vocab_size, batch_size, args.seq_len, args.warmup_steps + args.steps, args.seed
    )
    tokens_per_step = batch_size * args.seq_len
    result: dict = {
        "config": asdict(cfg),
        "batch_size": batch_size,
        "tokens_per_step": tokens_per_step,
        "num_params": shape.num_params(),
        "flops_per_token": flops_per_token,
        "trainers": {},
    }
    trainers = result["trainers"]
    for trainer in args.trainers:
        if trainer == "recipes_lib":
            for precision in args.precisions:
                key = recipes_lib_key(precision, args)
                report = measure(
                    f"[{name}] {key} ({args.strategy}, {precision})",
                    lambda p=precision: run_recipes_lib(name, p, batches, args, device, "auto"),
                    device,
                    tokens_per_step,
                    flops_per_token,
                    peak,
                )
                report.update(
                    strategy=args.strategy,
                    precision=precision,
                    activation_checkpointing=args.activation_checkpointing,
                    attention=attention_by_kind(run_cfg, args.attention),
                )
                trainers[key] = report
            for choice in args.attentions[1:]:  # the same, another kernels.attention
                report = measure(
                    f"[{name}] recipes_lib_attention_{choice} ({args.precisions[0]})",
                    lambda c=choice: run_recipes_lib(
                        name, args.precisions[0], batches, args, device, "auto", c
                    ),
                    device,
                    tokens_per_step,
                    flops_per_token,
                    peak,
                )
                report.update(attention=attention_by_kind(run_cfg, choice))
                trainers[f"recipes_lib_attention_{choice}"] = report
            if args.guard_off:  # the same, without the training guard's checks
                report = measure(
                    f"[{name}] recipes_lib_guard_off ({args.strategy}, {args.precisions[0]})",
                    lambda: run_recipes_lib(name, args.precisions[0], batches, args, device, "off"),
                    device,
                    tokens_per_step,
                    flops_per_token,
                    peak,
                )
                trainers["recipes_lib_guard_off"] = report
                result["guard_cost"] = {
                    "tokens_per_sec_ratio_guard_on/off": _ratio(
                        trainers["recipes_lib"], report, "tokens_per_sec"
                    )
                }
            continue
        if trainer == "hf_transformers" and importlib.util.find_spec("transformers") is None:
            trainers[trainer] = {"skipped": "transformers is not installed"}
            continue
        L.seed_everything(args.seed, verbose=False)
        trainers[trainer] = measure(
            f"[{name}] {trainer}",
            lambda t=trainer: BASELINES[t](cfg, optim, batches, args, device),
            device,
            tokens_per_step,
            flops_per_token,
            peak,
        )

    plain = trainers.get("plain_pytorch", {})
    result["tokens_per_sec_ratios"] = {  # None where either side did not run
        f"{trainer}/plain_pytorch": _ratio(trainers.get(trainer, {}), plain, "tokens_per_sec")
        for trainer in ("recipes_lib", "hf_transformers")
    }
    if "recipes_lib" in args.trainers and len(args.precisions) > 1:
        first = args.precisions[0]
        base = trainers["recipes_lib"]
        comparison = {}
        for precision in args.precisions[1:]:
            other = trainers[recipes_lib_key(precision, args)]
            comparison[f"{precision}/{first}"] = _comparison(other, base)
        result["precision_comparison"] = comparison
    if "recipes_lib" in args.trainers and len(args.attentions) > 1:
        base = trainers["recipes_lib"]
        result["attention_comparison"] = {
            f"{choice}/{args.attention}": _comparison(
                trainers[f"recipes_lib_attention_{choice}"], base
            )
            for choice in args.attentions[1:]
        }
    return result


def attention_by_kind(run_cfg, attention: str) -> dict[str, str]:
    """The backend each kind of layer of ``run_cfg``'s model runs with
    ``kernels.attention=attention`` (``global``, ``local``)."""
    kernels = dataclasses.replace(run_cfg.kernels, attention=attention)
    document_mask = run_cfg.data.document_mask
    return attention_choice(kernels, run_cfg.model, document_mask=document_mask).names()


def _comparison(other: dict, base: dict) -> dict:
    """``other``'s tokens/s and peak memory over ``base``'s, and its final loss's
    difference."""
    loss_a, loss_b = other.get("final_loss"), base.get("final_loss")
    return {
        "tokens_per_sec_ratio": _ratio(other, base, "tokens_per_sec"),
        "peak_memory_ratio": _ratio(other, base, "peak_memory_gib"),
        "final_loss_difference": round(loss_a - loss_b, 5)
        if isinstance(loss_a, float) and isinstance(loss_b, float)
        else None,
    }


def _batch_sizes(text: str) -> dict[str, int]:
    """``16`` (every model) or ``gpt_124m=16,llama_1b=8``; an empty string keeps the defaults."""
    if not text:
        return {}
    if "=" not in text:
        return {"*": int(text)}
    pairs = (item.split("=", 1) for item in text.split(",") if item)
    return {name.strip(): int(value) for name, value in pairs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt_124m,llama_1b", help="comma-separated presets")
    p.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated subset")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", default="", help="N for all, or gpt_124m=16,llama_1b=8")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--attention",
        default="sdpa",
        help=f"kernels.attention ({' | '.join(ATTENTION_CHOICES)}); several comma-separated "
        "(e.g. flex,auto) measure recipes_lib once per choice, the first for the baselines",
    )
    p.add_argument("--loss-chunk-size", type=int, default=None, help="recipes_lib trainer only")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--strategy", default="single", choices=STRATEGIES, help="recipes_lib, on one device"
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="recipes_lib (default bf16-mixed; 32-true with --smoke)",
    )
    p.add_argument(
        "--precisions",
        default=None,
        help="recipes_lib once per precision, e.g. bf16-mixed,fp8 (overrides --precision)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recipes_lib: recompute each block's activations in the backward pass",
    )
    p.add_argument(
        "--monitors",
        action="store_true",
        help="recipes_lib: add ThroughputMonitor, GradNormMonitor",
    )
    p.add_argument(
        "--guard-off",
        action="store_true",
        help="recipes_lib also with guard.policy=off: what the training guard costs",
    )
    p.add_argument(
        "--model-override",
        action="append",
        default=[],
        help="a model.* override of the preset for every trainer, e.g. model.n_layers=4 "
        "(a shorter stack of a model too large to train on one card)",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="override the lookup")
    p.add_argument(
        "--hf-experts",
        default="grouped_mm",
        help="transformers' experts_implementation for a mixture of experts (eager, "
        "batched_mm, grouped_mm)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, fp32, no compile")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.trainers = [t for t in args.trainers.split(",") if t]
    if unknown := set(args.trainers) - set(TRAINERS):
        p.error(f"unknown trainers {sorted(unknown)}; choose from {TRAINERS}")
    if unknown := set(args.models) - set(list_group_options("model")):
        presets = list_group_options("model")
        p.error(f"unknown model presets {sorted(unknown)}; choose from {presets}")
    if args.precisions:
        args.precisions = list(dict.fromkeys(x for x in args.precisions.split(",") if x))
    elif args.precision:
        args.precisions = [args.precision]
    else:
        args.precisions = ["32-true" if args.smoke else "bf16-mixed"]
    if unknown := set(args.precisions) - set(PRECISIONS):
        p.error(f"unknown precisions {sorted(unknown)}; choose from {PRECISIONS}")
    args.attentions = list(dict.fromkeys(x for x in args.attention.split(",") if x))
    if not args.attentions or (unknown := set(args.attentions) - set(ATTENTION_CHOICES)):
        p.error(f"unknown --attention {args.attention!r}; choose from {ATTENTION_CHOICES}")
    args.attention = args.attentions[0]
    args.batch_sizes = _batch_sizes(args.batch_size)
    args.bf16 = True  # the baselines' autocast
    if args.smoke:
        args.models, args.seq_len, args.warmup_steps, args.steps = ["tiny"], 64, 2, 3
        args.compile, args.bf16 = False, False
    if "*" in args.batch_sizes:
        args.batch_sizes = dict.fromkeys(args.models, args.batch_sizes["*"])
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = benchmark_device(args.smoke)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    name = device_name(device)
    peak = args.peak_tflops or (peak_bf16_tflops(name) if args.bf16 else None)
    result: dict = {
        "benchmark": "pretrain_throughput",
        "device": name,
        "peak_tflops_per_card": peak,
        "versions": package_versions("lightning", "transformers", "torchao", "recipes-lib"),
        "command": command_line(),
        "settings": {
            "seq_len": args.seq_len,
            "warmup_steps": args.warmup_steps,
            "steps": args.steps,
            "precision": "bf16 autocast, fp32 weights" if args.bf16 else "fp32",
            "compile": "each transformer block / decoder layer" if args.compile else "off",
            "attention": args.attention,
            "attentions": args.attentions,
            "hf_transformers_attention": "sdpa (flex_attention where the model has no SDPA)",
            "loss_chunk_size": args.loss_chunk_size,
            "recipes_lib": {
                "built_by": "compose_config -> build_trainer / build_stage",
                "strategy": args.strategy,
                "precisions": args.precisions,
                "activation_checkpointing": args.activation_checkpointing,
                "monitors": args.monitors,
            },
            "optimizer": "AdamW fused (foreach on CPU), lr 3e-4, weight decay 0.1, constant LR",
            "grad_clip_norm": GRAD_CLIP,
            "mfu_peak": "dense bf16 peak of the card, for every precision",
            "seed": args.seed,
        },
        "models": {},
    }
    # Lightning and transformers print banners; keep stdout for the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        for model_name in args.models:
            result["models"][model_name] = benchmark_model(model_name, args, device, peak)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    figures = main()
    reports = [r for entry in figures["models"].values() for r in entry["trainers"].values()]
    sys.exit(1 if any("error" in report for report in reports) else 0)
