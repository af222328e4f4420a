r"""Pretraining throughput of recipes_lib against a plain PyTorch loop and Hugging Face.

For each model preset (a YAML file of ``conf/model/``) three trainers train the same
decoder shape in this process, on this card, on the same random-token batches (fixed
seed; data loading is not measured), with the same micro-batch size, bf16 autocast over
fp32 weights, fused AdamW (lr 3e-4, weight decay 0.1 on weight matrices only, via
``recipes_lib.optim.build_optimizer``), gradient clipping at 1.0 and a constant LR:

- ``recipes_lib``: ``CausalLMModule`` trained by a ``lightning.Trainer``
  (``precision="bf16-mixed"``); ``kernels.compile=true`` compiles each block.
- ``plain_pytorch``: the same ``recipes_lib.models.Transformer``, blocks compiled the
  same way, same attention kernel, trained by a bare loop (no Lightning).
- ``hf_transformers``: ``transformers.LlamaForCausalLM`` of the same shape with SDPA
  attention, each decoder layer compiled, trained by the same bare loop.

All three use the same FLOPs count (``Transformer.flops_per_token``) for TFLOP/s and
MFU. The first ``--warmup-steps`` steps (where compilation happens) are not timed.
Prints one JSON object to stdout. On the GPU machine::

    python benchmarks/pretrain_throughput.py --models gpt_124m,llama_1b \
        --out $OUT/pretrain_throughput.json

A trainer that fails (out of memory, say) is recorded as ``{"error": ...}``, the others
still run, and the exit status is 1. ``--smoke`` runs the tiny preset on CPU in fp32
without compilation, end to end in seconds, so CI can check that the script works.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict

import lightning as L
import torch
from _common import (
    StepTimer,
    command_line,
    device_name,
    emit,
    package_versions,
    peak_bf16_tflops,
    reset_memory,
    throughput_report,
)
from omegaconf import OmegaConf

from recipes_lib.callbacks import GradNormMonitor, ThroughputMonitor
from recipes_lib.config import (
    KernelsConfig,
    ModelConfig,
    OptimConfig,
    SchedulerConfig,
    conf_dir,
    list_group_options,
)
from recipes_lib.kernels import ATTENTION_BACKENDS
from recipes_lib.losses import causal_lm_loss
from recipes_lib.models import Transformer
from recipes_lib.optim import build_optimizer
from recipes_lib.stages import CausalLMModule

TRAINERS = ("recipes_lib", "plain_pytorch", "hf_transformers")
DEFAULT_BATCH_SIZES = {"gpt_124m": 16, "llama_1b": 8, "tiny": 4}
FALLBACK_BATCH_SIZE = 8
OPTIM = OptimConfig(lr=3e-4, weight_decay=0.1)  # fused=None: fused AdamW on CUDA
SCHEDULER = SchedulerConfig(name="constant", warmup=0, min_lr_ratio=1.0)
GRAD_CLIP = 1.0

Batch = dict[str, torch.Tensor]
Measured = tuple[StepTimer, float]  # the timer of the measured steps, the last loss


def load_model_preset(name: str) -> ModelConfig:
    """``conf/model/<name>.yaml`` merged onto :class:`ModelConfig`."""
    if name not in list_group_options("model"):
        raise SystemExit(
            f"unknown model preset {name!r}; choose from {list_group_options('model')}"
        )
    merged = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(conf_dir() / "model" / f"{name}.yaml")
    )
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def meta_transformer(cfg: ModelConfig) -> Transformer:
    """The model without memory behind its weights, for parameter and FLOP counts."""
    with torch.device("meta"):
        return Transformer(cfg)


def synthetic_batches(vocab_size: int, batch_size: int, seq_len: int, n: int, seed: int):
    """``n`` batches of uniformly random tokens on the CPU, the same for every trainer."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (n, batch_size, seq_len + 1), generator=generator)
    doc_ids = torch.zeros(batch_size, seq_len, dtype=torch.int32)  # one document per row
    return [
        {"input_ids": row[:, :-1].clone(), "labels": row[:, 1:].clone(), "doc_ids": doc_ids}
        for row in tokens
    ]  # each (B, T)


# --------------------------------------------------------------------------- trainers
class _MeasuredSteps(L.Callback):
    """Starts the timer at the first measured batch and stops it after the last one."""

    def __init__(self, timer: StepTimer, warmup_steps: int, total_steps: int):
        self.timer, self.warmup_steps, self.total_steps = timer, warmup_steps, total_steps
        self.last_loss: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup_steps:
            self.timer.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        self.last_loss = loss.detach()
        if batch_idx >= self.warmup_steps:
            self.timer.step_end()
        if batch_idx == self.total_steps - 1:
            self.timer.stop()


def run_recipes_lib(cfg: ModelConfig, batches: list[Batch], args, device) -> Measured:
    total = len(batches)
    B, T = batches[0]["input_ids"].shape
    module = CausalLMModule(
        cfg,
        KernelsConfig(
            attention=args.attention, compile=args.compile, loss_chunk_size=args.loss_chunk_size
        ),
        OPTIM,
        SCHEDULER,
        total_steps=total,
        tokens_per_step=B * T,
    )
    timer = StepTimer(device)
    measured = _MeasuredSteps(timer, args.warmup_steps, total)
    callbacks: list[L.Callback] = [measured]
    if args.monitors:  # the per-step monitors of conf/callbacks/default.yaml
        callbacks += [ThroughputMonitor(window=20), GradNormMonitor()]
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            precision="bf16-mixed" if args.bf16 else "32-true",
            max_steps=total,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            gradient_clip_val=GRAD_CLIP,
            num_sanity_val_steps=0,
            callbacks=callbacks,
            default_root_dir=root,
        )
        loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
        trainer.fit(module, train_dataloaders=loader)
    if not timer.started or measured.last_loss is None:
        raise RuntimeError(f"the trainer stopped after {trainer.global_step} of {total} steps")
    return timer, measured.last_loss.item()


def plain_loop(
    model: torch.nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    batches: list[Batch],
    args,
    device: torch.device,
) -> Measured:
    """Autocast forward, fp32 cross-entropy, backward, clip, fused AdamW, zero grads."""
    optimizer = build_optimizer(model, OPTIM)
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


def run_plain_pytorch(cfg: ModelConfig, batches: list[Batch], args, device) -> Measured:
    with device:
        model = Transformer(cfg, attention=args.attention)
    if args.compile:
        for block in model.layers:
            block.compile()  # as CausalLMModule.configure_model does
    return plain_loop(model, model, batches, args, device)


def hf_llama_config(cfg: ModelConfig):
    """A ``transformers.LlamaConfig`` of the same shape as ``cfg``."""
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = cfg.rope_scaling
    if scaling.type == "linear":
        rope.update(rope_type="linear", factor=scaling.factor)
    elif scaling.type == "llama3":
        rope.update(
            rope_type="llama3",
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_seq_len,
        )
    rope_kwargs = {"rope_parameters": rope}
    if "rope_parameters" not in inspect.signature(LlamaConfig.__init__).parameters:  # 4.x
        rope_kwargs = {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
        head_dim=cfg.head_dim or cfg.dim // cfg.n_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        attention_bias=cfg.qkv_bias,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        use_cache=False,
        attn_implementation="sdpa",
        **rope_kwargs,
    )


def run_hf_transformers(cfg: ModelConfig, batches: list[Batch], args, device) -> Measured:
    from transformers import LlamaForCausalLM

    with device:
        model = LlamaForCausalLM(hf_llama_config(cfg)).to(dtype=torch.float32)
    expected = meta_transformer(cfg).num_params()
    if model.num_parameters() != expected:
        raise RuntimeError(
            f"LlamaForCausalLM has {model.num_parameters()} parameters, the recipes_lib "
            f"Transformer {expected}: the shapes differ"
        )
    if args.compile:
        for layer in model.model.layers:
            layer.compile()  # per decoder layer, like the recipes_lib blocks
    forward = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    return plain_loop(model, forward, batches, args, device)


RUNNERS = {
    "recipes_lib": run_recipes_lib,
    "plain_pytorch": run_plain_pytorch,
    "hf_transformers": run_hf_transformers,
}


# ------------------------------------------------------------------------------ main
def benchmark_model(name: str, args, device: torch.device, peak: float | None) -> dict:
    cfg = load_model_preset(name)
    batch_size = args.batch_sizes.get(name, DEFAULT_BATCH_SIZES.get(name, FALLBACK_BATCH_SIZE))
    shape = meta_transformer(cfg)
    flops_per_token = shape.flops_per_token(args.seq_len)
    batches = synthetic_batches(
        cfg.vocab_size, batch_size, args.seq_len, args.warmup_steps + args.steps, args.seed
    )
    result: dict = {
        "config": asdict(cfg),
        "batch_size": batch_size,
        "tokens_per_step": batch_size * args.seq_len,
        "num_params": shape.num_params(),
        "flops_per_token": flops_per_token,
        "trainers": {},
    }
    for trainer in args.trainers:
        if trainer == "hf_transformers" and importlib.util.find_spec("transformers") is None:
            result["trainers"][trainer] = {"skipped": "transformers is not installed"}
            continue
        print(f"[{name}] {trainer} ...", file=sys.stderr, flush=True)
        reset_memory(device)
        L.seed_everything(args.seed, verbose=False)  # CausalLMModule inits from PL_GLOBAL_SEED
        try:
            timer, final_loss = RUNNERS[trainer](cfg, batches, args, device)
            result["trainers"][trainer] = throughput_report(
                timer,
                tokens_per_step=batch_size * args.seq_len,
                flops_per_token=flops_per_token,
                peak_tflops=peak,
                final_loss=final_loss,
            )
        except Exception as err:  # one trainer failing (e.g. out of memory) spares the rest
            traceback.print_exc(file=sys.stderr)
            result["trainers"][trainer] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        print(f"[{name}] {trainer}: {result['trainers'][trainer]}", file=sys.stderr, flush=True)

    def tokens_per_sec(trainer: str) -> float | None:
        return result["trainers"].get(trainer, {}).get("tokens_per_sec")

    base = tokens_per_sec("plain_pytorch")
    result["tokens_per_sec_ratios"] = {  # None where either side did not run
        f"{trainer}/plain_pytorch": round(other / base, 4) if base and other else None
        for trainer in ("recipes_lib", "hf_transformers")
        for other in [tokens_per_sec(trainer)]
    }
    return result


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
    p.add_argument("--attention", default="sdpa", choices=ATTENTION_BACKENDS)
    p.add_argument("--loss-chunk-size", type=int, default=None, help="recipes_lib trainer only")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--monitors",
        action="store_true",
        help="recipes_lib: add ThroughputMonitor, GradNormMonitor",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="override the lookup")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, fp32, no compile")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.trainers = [t for t in args.trainers.split(",") if t]
    if unknown := set(args.trainers) - set(TRAINERS):
        p.error(f"unknown trainers {sorted(unknown)}; choose from {TRAINERS}")
    args.batch_sizes = _batch_sizes(args.batch_size)
    args.bf16 = True
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
    device = torch.device("cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    elif not args.smoke:
        raise SystemExit("no CUDA device; run with --smoke for the CPU check")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    name = device_name(device)
    peak = args.peak_tflops or (peak_bf16_tflops(name) if args.bf16 else None)
    result: dict = {
        "benchmark": "pretrain_throughput",
        "device": name,
        "peak_tflops_per_card": peak,
        "versions": package_versions("lightning", "transformers", "recipes-lib"),
        "command": command_line(),
        "settings": {
            "seq_len": args.seq_len,
            "warmup_steps": args.warmup_steps,
            "steps": args.steps,
            "precision": "bf16 autocast, fp32 weights" if args.bf16 else "fp32",
            "compile": "each transformer block / decoder layer" if args.compile else "off",
            "attention": args.attention,
            "hf_transformers_attention": "sdpa",
            "loss_chunk_size": args.loss_chunk_size,
            "recipes_lib_monitors": args.monitors,
            "optimizer": "AdamW fused (foreach on CPU), lr 3e-4, weight decay 0.1, constant LR",
            "grad_clip_norm": GRAD_CLIP,
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
