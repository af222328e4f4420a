r"""Post-training costs: SFT packing against padding, DPO against SFT, adapter memory.

Three measurements, in this process, on this card, with the same random-init model,
the same tokenizer (a BPE with the ChatML tokens, trained on the instruction records)
and the built-in standard-library data, so every figure has its baseline beside it:

- ``sft_packing``: SFT tokens/s on the variable-length ``stdlib_sft`` conversations,
  padded to the longest of each batch (``padded``) against packed into rows of
  ``--seq-len`` (``packed``: plain causal attention across the packed conversations, as
  pretraining does; ``packed_document_mask``: flex attention that keeps them apart).
  Tokens are real (non-padding) tokens; ``padding_fraction`` is the share of the
  computed positions that were padding.
- ``dpo_vs_sft``: DPO on ``stdlib_dpo`` pairs (the same functions' real and corrupted
  source, padded) with a live reference model and with precomputed reference log-probs;
  ``cost_per_token_vs_sft`` is the time per real token relative to padded SFT on the
  same model. The one-off precomputation pass is reported on its own.
- ``adapter_memory``: peak CUDA memory (and tokens/s) of full, LoRA and QLoRA SFT of
  ``--memory-model`` (a 1B shape by default), padded batches, same settings; then
  again under ``lean`` with activation checkpointing per block and the chunked
  output+loss (the full logits never exist), where weights and optimizer state rather
  than activations decide the peak.

bf16 autocast over fp32 weights, AdamW (fused on CUDA), lr 1e-5 (2e-4 with adapters),
gradient clipping at 1.0, no compilation (padded batches change shape every step). The
first ``--warmup-steps`` steps are not timed. Prints one JSON object to stdout::

    python benchmarks/posttrain.py --model llama_1b --out $OUT/posttrain.json

A measurement that fails is recorded as ``{"error": ...}`` (exit status 1) and the
others still run; QLoRA without CUDA or bitsandbytes is ``{"skipped": reason}``.
``--smoke`` runs the tiny preset on CPU in fp32, end to end in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import (
    StepTimer,
    benchmark_device,
    command_line,
    device_name,
    emit,
    package_versions,
    reset_memory,
)
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset, RandomSampler, default_collate

from recipes_lib.adapters import check_adapter_config
from recipes_lib.config import (
    DataConfig,
    KernelsConfig,
    ModelConfig,
    OptimConfig,
    SchedulerConfig,
    SourceConfig,
    TokenizerConfig,
    conf_dir,
    list_group_options,
)
from recipes_lib.config.schema import AdapterConfig, ChatFormatConfig
from recipes_lib.data.chat.module import ChatDataModule
from recipes_lib.data.chat.packing import pad_collate
from recipes_lib.data.preference.module import PreferenceDataModule
from recipes_lib.errors import ConfigError
from recipes_lib.objectives.dpo import DPOSettings
from recipes_lib.objectives.preference import PreferenceModule
from recipes_lib.objectives.sft import SFTModule

GRAD_CLIP = 1.0
LEAN_LOSS_CHUNK = 2048  # rows of the chunked output+loss in the lean memory setting
SCHEDULER = SchedulerConfig(name="constant", warmup=0, min_lr_ratio=1.0)
ADAPTERS = {
    "full": AdapterConfig(kind="none"),
    "lora": AdapterConfig(kind="lora", r=16, alpha=32, dropout=0.0),
    "qlora": AdapterConfig(kind="qlora", r=16, alpha=32, dropout=0.0),
}


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


# ------------------------------------------------------------------------------ data
def data_config(args, source: str, *, packing: bool, tokenizer: str | None) -> DataConfig:
    return DataConfig(
        sources={source: SourceConfig(builtin=source, max_documents=args.records)},
        tokenizer=TokenizerConfig(path=tokenizer, vocab_size=args.vocab_size),
        seq_len=args.seq_len,
        batch_size=args.batch_size if source == "stdlib_sft" else args.dpo_batch_size,
        val_fraction=0.0,
        cache_dir=args.cache_dir,
        seed=args.seed,
        chat=ChatFormatConfig(packing=packing, truncation="right"),
    )


_CHAT_DATA: dict[tuple, ChatDataModule] = {}


def chat_data(args, cfg: ModelConfig, tokenizer: str, *, packing: bool) -> ChatDataModule:
    """The set-up SFT data module (rendered once per packing choice and model limits)."""
    key = (packing, cfg.vocab_size, cfg.max_seq_len)
    if key not in _CHAT_DATA:
        config = data_config(args, "stdlib_sft", packing=packing, tokenizer=tokenizer)
        datamodule = ChatDataModule(config, cfg.vocab_size, cfg.max_seq_len)
        datamodule.setup()
        _CHAT_DATA[key] = datamodule
    return _CHAT_DATA[key]


class CountedRows(Dataset):
    """The SFT data module's training rows, each with its real (non-padding) and trained
    token counts, so a batch's counts are known on the host without a device sync."""

    def __init__(self, dataset: Dataset, packed: bool) -> None:
        self.dataset, self.packed = dataset, packed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> dict:
        item = dict(self.dataset[index])
        if self.packed:  # whole examples first, then padding
            rows, examples = self.dataset.rows, self.dataset.examples  # type: ignore[attr-defined]
            item["num_tokens"] = sum(len(examples[i]) for i in rows[index])
        else:
            item["num_tokens"] = len(item["input_ids"])
        item["num_trained"] = int((item["labels"] != -100).sum())
        return item


class CountingCollate:
    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, items: list[dict]) -> dict:
        counts = {k: sum(it.pop(k) for it in items) for k in ("num_tokens", "num_trained")}
        batch = self.collate(items)
        batch.update(counts)  # plain ints: Lightning leaves them on the host
        return batch


def sft_loader(datamodule: ChatDataModule, args, n_batches: int) -> DataLoader:
    packed = datamodule.config.chat.packing
    dataset = CountedRows(datamodule.train_dataset, packed)
    collate = default_collate if packed else pad_collate(datamodule.pad_id)
    sampler = RandomSampler(
        dataset,
        replacement=True,
        num_samples=n_batches * datamodule.config.batch_size,
        generator=torch.Generator().manual_seed(args.seed),
    )
    return DataLoader(
        dataset,
        batch_size=datamodule.config.batch_size,
        sampler=sampler,
        collate_fn=CountingCollate(collate),
        drop_last=True,
    )


# ------------------------------------------------------------------------ measuring
class Measure(L.Callback):
    """Times the steps after the warmup, counts their tokens, and records peak memory
    and the one-off work between the start of fit and the first step."""

    def __init__(self, device: torch.device, warmup_steps: int, total_steps: int) -> None:
        self.timer = StepTimer(device)
        self.device, self.warmup_steps, self.total_steps = device, warmup_steps, total_steps
        self.tokens = self.trained = self.slots = 0
        self.last_loss: torch.Tensor | None = None
        self.setup_seconds = 0.0
        self._fit_start = 0.0

    def on_fit_start(self, trainer, pl_module) -> None:
        self._fit_start = time.perf_counter()  # before the module's own on_fit_start

    def on_train_start(self, trainer, pl_module) -> None:
        self.setup_seconds = time.perf_counter() - self._fit_start
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup_steps:
            self.timer.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.last_loss = loss.detach()
        if batch_idx >= self.warmup_steps:
            self.timer.step_end()
            for micro in batch if isinstance(batch, list) else [batch]:  # a step's micro-batches
                self.tokens += int(micro["num_tokens"])
                self.trained += int(micro.get("num_trained", 0))
                self.slots += micro["input_ids"].numel()
        if batch_idx == self.total_steps - 1:
            self.timer.stop()

    def report(self, module: L.LightningModule) -> dict:
        if not self.timer.started or self.last_loss is None:
            raise RuntimeError("the trainer stopped before the measured steps")
        seconds = self.timer.total_s
        step_ms = self.timer.step_times_ms()
        peak = None
        if self.device.type == "cuda":
            peak = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
        params = module.model.parameters()  # type: ignore[union-attr]
        trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)  # type: ignore[union-attr]
        report = {
            "tokens_per_sec": round(self.tokens / seconds, 1),
            "tokens": self.tokens,
            "padding_fraction": round(1 - self.tokens / self.slots, 4),
            "step_time_ms": {
                "median": round(statistics.median(step_ms), 3),
                "min": round(min(step_ms), 3),
                "max": round(max(step_ms), 3),
            },
            "measured_steps": len(step_ms),
            "peak_memory_gib": peak,
            "trainable_params": trainable,
            "params": sum(p.numel() for p in params),
            "final_loss": round(self.last_loss.item(), 5),
        }
        if self.trained:
            report["trained_tokens_per_sec"] = round(self.trained / seconds, 1)
        return report


def fit_and_measure(module, args, device, *, loader=None, datamodule=None) -> tuple[dict, Measure]:
    total = args.warmup_steps + args.steps
    measure = Measure(device, args.warmup_steps, total)
    module.gradient_clip = (GRAD_CLIP, None)  # the module clips its own steps
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
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[measure],
            default_root_dir=root,
            use_distributed_sampler=False,
        )
        trainer.fit(module, train_dataloaders=loader, datamodule=datamodule)
    return measure.report(module), measure


def module_kwargs(
    cfg: ModelConfig, args, *, attention: str = "sdpa", adapter=None, lean: bool = False
) -> dict:
    """``lean``: activation checkpointing per block and the chunked output+loss (no full
    logits), the memory-saving kernel settings."""
    lr = 2e-4 if adapter is not None and adapter.kind != "none" else 1e-5
    kernels = KernelsConfig(attention=attention, compile=False)
    if lean:
        kernels.activation_checkpointing = True
        kernels.loss_chunk_size = LEAN_LOSS_CHUNK
    return {
        "model": cfg,
        "kernels": kernels,
        "optim": OptimConfig(lr=lr, weight_decay=0.0),
        "scheduler": SCHEDULER,
        "total_steps": args.warmup_steps + args.steps,
        "tokens_per_step": args.seq_len * args.batch_size,
        "adapter": adapter,
    }


def guarded(name: str, work: Callable[[], dict]) -> dict:
    """``work()``, or ``{"error": ...}`` when it fails (the other measurements go on)."""
    print(f"[posttrain] {name} ...", file=sys.stderr, flush=True)
    try:
        result = work()
    except Exception as err:  # out of memory, a kernel that is missing, ...
        traceback.print_exc(file=sys.stderr)
        result = {"error": f"{type(err).__name__}: {err}"[:2000]}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"[posttrain] {name}: {result}", file=sys.stderr, flush=True)
    return result


def _ratio(a: dict, b: dict, key: str = "tokens_per_sec") -> float | None:
    x, y = a.get(key), b.get(key)
    return round(x / y, 4) if x and y else None


# ----------------------------------------------------------------------- benchmarks
def sft_packing(cfg: ModelConfig, args, device, tokenizer: str) -> dict:
    n_batches = args.warmup_steps + args.steps
    variants = {
        "padded": (False, "sdpa", False),
        "packed": (True, "sdpa", False),
        "packed_document_mask": (True, "flex", True),
    }
    result: dict[str, Any] = {"model": args.model}

    def run(packing: bool, attention: str, document_mask: bool) -> dict:
        datamodule = chat_data(args, cfg, tokenizer, packing=packing)
        reset_memory(device)
        L.seed_everything(args.seed, verbose=False)
        module = SFTModule(
            **module_kwargs(cfg, args, attention=attention), document_mask=document_mask
        )
        report, _ = fit_and_measure(
            module, args, device, loader=sft_loader(datamodule, args, n_batches)
        )
        report["rows_per_batch"] = datamodule.config.batch_size
        return report

    for name, (packing, attention, document_mask) in variants.items():
        result[name] = guarded(
            f"sft {name}", lambda p=packing, a=attention, d=document_mask: run(p, a, d)
        )
    result["tokens_per_sec_ratio"] = {
        f"{name}/padded": _ratio(result[name], result["padded"])
        for name in ("packed", "packed_document_mask")
    }
    return result


def dpo_vs_sft(cfg: ModelConfig, args, device, tokenizer: str, sft_padded: dict) -> dict:
    result: dict[str, Any] = {
        "model": args.model,
        "pairs_per_batch": args.dpo_batch_size,
        "sft_padded_tokens_per_sec": sft_padded.get("tokens_per_sec"),
    }

    def run(precompute: bool) -> dict:
        config = data_config(args, "stdlib_dpo", packing=False, tokenizer=tokenizer)
        total = (args.warmup_steps + args.steps) * config.batch_size
        datamodule = PreferenceDataModule(
            config, cfg.vocab_size, cfg.max_seq_len, total_train_samples=total
        )
        reset_memory(device)
        L.seed_everything(args.seed, verbose=False)
        module = PreferenceModule(
            **module_kwargs(cfg, args),
            objective="dpo",
            settings=DPOSettings(loss="sigmoid", beta=0.1, precompute_reference=precompute),
            varying_shapes=True,  # pairs of every length, as the dpo spec says
        )
        report, measure = fit_and_measure(module, args, device, datamodule=datamodule)
        if precompute:
            pairs = len(datamodule.train_dataset)  # type: ignore[arg-type]
            report["precompute_pairs"] = pairs
            report["precompute_seconds"] = round(measure.setup_seconds, 3)
        return report

    result["dpo_live"] = guarded("dpo live reference", lambda: run(False))
    result["dpo_precomputed"] = guarded("dpo precomputed reference", lambda: run(True))
    # time per real token relative to padded SFT: the inverse ratio of tokens/s
    result["cost_per_token_vs_sft"] = {
        name: _ratio(sft_padded, result[name]) for name in ("dpo_live", "dpo_precomputed")
    }
    return result


def adapter_memory(args, device, tokenizer: str) -> dict:
    """Peak memory of full, LoRA and QLoRA SFT with the default kernels, then again
    with the lean ones (activation checkpointing + chunked loss) under ``lean``."""
    cfg = load_model_preset(args.memory_model)
    n_batches = args.warmup_steps + args.steps

    def run(adapter: AdapterConfig, lean: bool) -> dict:
        datamodule = chat_data(args, cfg, tokenizer, packing=False)
        reset_memory(device)
        L.seed_everything(args.seed, verbose=False)
        module = SFTModule(**module_kwargs(cfg, args, adapter=adapter, lean=lean))
        report, _ = fit_and_measure(
            module, args, device, loader=sft_loader(datamodule, args, n_batches)
        )
        return report

    def measure_all(lean: bool) -> dict:
        result: dict[str, Any] = {}
        for name, adapter in ADAPTERS.items():
            try:
                check_adapter_config(adapter)
                if adapter.kind == "qlora" and device.type != "cuda":
                    raise ConfigError("adapter.kind=qlora needs a CUDA GPU")
            except ConfigError as err:
                result[name] = {"skipped": str(err)}
                continue
            label = f"sft memory {name}{' lean' if lean else ''}"
            result[name] = guarded(label, lambda a=adapter: run(a, lean))
        full = result["full"].get("peak_memory_gib")
        result["peak_memory_vs_full"] = {
            name: round(result[name]["peak_memory_gib"] / full, 4)
            if full and result[name].get("peak_memory_gib")
            else None
            for name in ("lora", "qlora")
        }
        return result

    result: dict[str, Any] = {"model": args.memory_model, **measure_all(lean=False)}
    result["lean"] = {
        "kernels": f"activation_checkpointing=true, loss_chunk_size={LEAN_LOSS_CHUNK}",
        **measure_all(lean=True),
    }
    return result


def train_tokenizer(args) -> str:
    """A BPE with the ChatML tokens trained on the instruction records (cached)."""
    config = data_config(args, "stdlib_sft", packing=True, tokenizer=None)
    datamodule = ChatDataModule(config, args.vocab_size, 1 << 20)
    datamodule.prepare_data()
    datamodule.setup()
    return str(datamodule.prepared.tokenizer_path)  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama_1b", help="preset for throughput and DPO")
    p.add_argument("--memory-model", default="llama_1b", help="preset for adapter memory")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8, help="SFT rows per micro-batch")
    p.add_argument("--dpo-batch-size", type=int, default=4, help="pairs per micro-batch")
    p.add_argument("--records", type=int, default=3000, help="records of each built-in source")
    p.add_argument("--vocab-size", type=int, default=32768, help="of the trained tokenizer")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cache-dir", default=None, help="tokenizer cache (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, fp32, a few steps")
    args = p.parse_args(argv)
    args.bf16 = True
    if args.smoke:
        args.model = args.memory_model = "tiny"
        args.seq_len, args.batch_size, args.dpo_batch_size = 96, 4, 2
        args.records, args.vocab_size, args.warmup_steps, args.steps = 80, 512, 1, 2
        args.bf16 = False
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = benchmark_device(args.smoke)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    cfg = load_model_preset(args.model)
    result: dict[str, Any] = {
        "benchmark": "posttrain",
        "device": device_name(device),
        "versions": package_versions("lightning", "peft", "bitsandbytes", "recipes-lib"),
        "command": command_line(),
        "settings": {
            "seq_len": args.seq_len,
            "sft_rows_per_batch": args.batch_size,
            "dpo_pairs_per_batch": args.dpo_batch_size,
            "records": args.records,
            "tokenizer_vocab_size": args.vocab_size,
            "warmup_steps": args.warmup_steps,
            "steps": args.steps,
            "precision": "bf16 autocast, fp32 weights" if args.bf16 else "fp32",
            "compile": "off",
            "optimizer": "AdamW, lr 1e-5 (2e-4 with adapters), no weight decay, constant LR",
            "grad_clip_norm": GRAD_CLIP,
            "dpo": "sigmoid loss, beta 0.1, reference = the policy's initial weights",
            "seed": args.seed,
        },
    }
    with contextlib.ExitStack() as stack:
        if args.cache_dir is None:
            args.cache_dir = stack.enter_context(tempfile.TemporaryDirectory())
        # Lightning prints banners; keep stdout for the JSON alone.
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        tokenizer = train_tokenizer(args)
        result["settings"]["tokenizer"] = Path(tokenizer).name
        result["sft_packing"] = sft_packing(cfg, args, device, tokenizer)
        padded = result["sft_packing"]["padded"]
        result["dpo_vs_sft"] = dpo_vs_sft(cfg, args, device, tokenizer, padded)
        result["adapter_memory"] = adapter_memory(args, device, tokenizer)
    emit(result, args.out)
    return result


def _errors(node: Any) -> int:
    if isinstance(node, dict):
        return int("error" in node) + sum(_errors(v) for v in node.values())
    return 0


if __name__ == "__main__":
    figures = main()
    sys.exit(1 if _errors(figures) else 0)
