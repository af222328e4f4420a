r"""Post-training against TRL: SFT, LoRA, DPO and ORPO on the same folder, data and card.

Every case trains the same Hugging Face folder on the same records with the same
settings, each side in a process of its own (so each peak is its own), one after the
other on this card:

- the folder: a preset's shape (default ``llama_1b``) made by transformers at random
  init and saved (bf16) with a tokenizer (a BPE trained on the records, with the ChatML
  tokens) and a ChatML chat template: what a user's downloaded folder holds;
- the data (``--data``): synthetic text in one of three shapes (``short``: prompts of
  20-80 words and answers near 100; ``long``: prompts and answers near 300; ``heavy``:
  Pareto-distributed lengths, most short and some near the sequence length), or
  ``builtin``: the built-in instruction conversations (``stdlib_sft``) and preference
  pairs (``stdlib_dpo``: a function's real body against a corrupted copy); as
  ``chat.jsonl`` and ``pairs.jsonl``, both as chat messages;
- the cases: ``sft_full``, ``sft_lora`` (r 16, alpha 32, dropout 0.05, every linear of
  the blocks), ``dpo_live`` (a reference model in memory), ``dpo_precomputed`` (its
  log-probs computed once before training) and ``orpo``;
- recipes_lib: the recipe (``sft/full``, ``sft/lora``, ``dpo/full``) with
  ``stage.init_from=FOLDER data.path=...`` and the sizes: packed rows, compiled blocks,
  flex attention with the document mask, bf16 autocast over fp32 weights, the output
  head fused with the loss (the recipes' default);
- TRL: ``SFTTrainer`` (``packing=True``, padding-free), ``DPOTrainer`` (its own
  chunked log-prob head), ``experimental.orpo.ORPOTrainer``; bf16 autocast over fp32
  weights, SDPA, ``adamw_torch_fused``;
- TRL with Liger (``use_liger_kernel=True``): Liger's RMSNorm, SwiGLU and RoPE kernels,
  and for SFT its fused linear cross-entropy; ``trl_liger_bf16`` (on request) loads the
  folder in bf16 instead (weights, norms and residual stream in bf16; PEFT keeps LoRA's
  factors in fp32).

recipes_lib's LoRA stores the frozen projections in bf16 under bf16-mixed
(``adapter.base_dtype=auto``): the matmuls autocast computes anyway; pass
``--override adapter.base_dtype=float32`` to keep them in fp32.

Gradient checkpointing is the same on every side (``--checkpointing``, on by default as
TRL's trainers default to it). Throughput counts the real (non-padding) tokens of the
timed steps (after ``--warmup-steps``), both sequences of a pair for preference cases;
the peak is CUDA's allocated peak over the run (the precomputation pass included); time
to first step runs from the process start to the end of the first step. Prints one
JSON object::

    python benchmarks/posttrain_peer.py --out $OUT/posttrain_peer.json
    python benchmarks/posttrain_peer.py --cases dpo_live,orpo --sides recipes_lib,trl

A side that fails is recorded as ``{"error": ...}`` (exit status 1); TRL or Liger not
installed is ``{"skipped": ...}``. ``--smoke`` runs a tiny shape on CPU in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _peer import (  # noqa: E402
    DATA_SHAPES,
    add_peer_arguments,
    check_choices,
    compile_counts,
    figures,
    lightning_clock,
    make_folder,
    real_tokens,
    report_header,
    spawn,
    synthetic_records,
    trainer_clock,
    write_records,
)

CASES = ("sft_full", "sft_lora", "dpo_live", "dpo_precomputed", "orpo")
SIDES = ("recipes_lib", "trl", "trl_liger")
PEER_SIDES = (*SIDES[1:], "trl_liger_bf16")  # the last one on request
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
HF_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BETA = 0.1


# ---------------------------------------------------------------------------- data
def make_inputs(args, root: Path) -> tuple[Path, Path, Path]:
    """The model folder, ``chat.jsonl`` and ``pairs.jsonl`` every side trains on."""
    from recipes_lib.data.chat.instructions import stdlib_instruction_records
    from recipes_lib.data.preference.stdlib_pairs import stdlib_preference_records

    folder, chat, pairs = root / "model", root / "chat.jsonl", root / "pairs.jsonl"
    if getattr(args, "data", "builtin") == "builtin":  # grpo_peer.py has no --data
        records = [
            {"prompt": r["prompt"], "response": r["response"]}
            for r in stdlib_instruction_records(args.records)
        ]
        pair_records = [
            {"prompt": r["prompt"], "response": r["chosen"], "rejected": r["rejected"]}
            for r in stdlib_preference_records(args.pairs)
        ]
    else:
        records = synthetic_records(args.data, args.records, args.seq_len, args.seed)
        pair_records = synthetic_records(args.data, args.pairs, args.seq_len, args.seed + 1)
    write_records("chat", chat, records)
    write_records("pairs", pairs, pair_records)
    make_folder(
        folder,
        [r["prompt"] + r["response"] for r in records],
        model=args.model,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        seed=args.seed,
        smoke=args.smoke,
    )
    return folder, chat, pairs


# -------------------------------------------------------------------- recipes_lib
def run_recipes_lib(args, case: str, root: Path, start: float) -> dict:
    from recipes_lib.config import compose_config
    from recipes_lib.train import run

    preference = case.startswith("dpo") or case == "orpo"
    recipe = {"sft_full": "sft/full", "sft_lora": "sft/lora"}.get(case, "dpo/full")
    overrides = [
        f"recipe={recipe}",
        f"stage.init_from={root / 'model'}",
        f"data.path={root / ('pairs.jsonl' if preference else 'chat.jsonl')}",
        f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.pair_batch if preference else args.batch_size}",
        f"trainer.max_steps={args.warmup_steps + args.steps + 1}",
        "trainer.val_check_interval=null",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "data.val_fraction=0",
        f"optim.lr={args.lr}",
        "scheduler.warmup=1",
        "run.checkpoint_every_n_steps=0",
        f"run.dir={root / 'runs' / case}",
        f"data.cache_dir={root / 'cache'}",
        "callbacks=minimal",
        f"kernels.activation_checkpointing={str(args.checkpointing).lower()}",
        *(["trainer=cpu"] if args.smoke else []),
        *args.override,
    ]
    if case == "sft_lora":
        overrides += [f"adapter.r={LORA['r']}", f"adapter.alpha={LORA['alpha']}"]
    if preference:
        if case == "orpo":
            overrides += ["stage.objective=orpo", f"stage.orpo.odds_ratio_weight={BETA}"]
        else:
            precompute = str(case == "dpo_precomputed").lower()
            overrides += ["stage.dpo.loss=sigmoid", f"stage.dpo.beta={BETA}"]
            overrides.append(f"stage.dpo.precompute_reference={precompute}")
    clock = lightning_clock()
    before = compile_counts()
    result = run(compose_config(overrides), callbacks=[clock])
    report = figures(clock.ends, clock.tokens, args.warmup_steps, start)
    graphs, hits = (now - then for now, then in zip(compile_counts(), before, strict=True))
    return {
        **report,
        "final_loss": result.metrics.get("train/loss"),
        "compiled": {"graphs": graphs, "recompile_limit_hits": hits},
        "overrides": overrides,
    }


# --------------------------------------------------------------------------- TRL
def run_trl(args, case: str, root: Path, start: float, side: str) -> dict:
    """One TRL side: ``trl``, ``trl_liger``, or ``trl_liger_bf16`` (the folder loaded in
    bf16, weights and activations, as a user short of memory would)."""
    liger = side.startswith("trl_liger")
    try:
        import trl
    except ImportError as err:
        return {"skipped": f"trl is not installed ({err})"}
    if liger:
        try:
            import liger_kernel  # noqa: F401
        except ImportError as err:
            return {"skipped": f"liger-kernel is not installed ({err})"}
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer

    cuda = torch.cuda.is_available() and not args.smoke
    preference = case.startswith("dpo") or case == "orpo"
    common = {
        "output_dir": str(root / "trl" / case),
        "per_device_train_batch_size": args.pair_batch if preference else args.batch_size,
        "max_steps": args.warmup_steps + args.steps + 1,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": 1,
        "bf16": cuda,
        "use_cpu": not cuda,
        "optim": "adamw_torch_fused" if cuda else "adamw_torch",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "model_init_kwargs": {
            "dtype": torch.bfloat16 if side.endswith("bf16") else torch.float32,
            "attn_implementation": "sdpa",
        },
        "dataloader_num_workers": 0,
        "seed": args.seed,
        "gradient_checkpointing": args.checkpointing,
        "use_liger_kernel": liger,
    }
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    data = load_dataset(
        "json", data_files=str(root / ("pairs.jsonl" if preference else "chat.jsonl"))
    )
    dataset = data["train"]
    peft_config = None
    if case == "sft_lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules=HF_LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
    if case.startswith("sft"):
        config = trl.SFTConfig(max_length=args.seq_len, packing=True, **common)
        trainer_class = trl.SFTTrainer
    elif case == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        config = ORPOConfig(max_length=args.seq_len, beta=BETA, **common)
        trainer_class = ORPOTrainer
    else:
        config = trl.DPOConfig(
            max_length=args.seq_len,
            beta=BETA,
            precompute_ref_log_probs=case == "dpo_precomputed",
            **common,
        )
        trainer_class = trl.DPOTrainer
    clock = trainer_clock()

    class Counted(trainer_class):  # real tokens of each step's batch (one micro-batch)
        def training_step(self, model, inputs, *args, **kwargs):
            clock.tokens.append(real_tokens(inputs))
            return super().training_step(model, inputs, *args, **kwargs)

    kwargs = {"peft_config": peft_config} if peft_config is not None else {}
    trainer = Counted(
        model=str(root / "model"),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
        **kwargs,
    )
    output = trainer.train()
    report = figures(clock.ends, clock.tokens, args.warmup_steps, start)
    return {**report, "final_loss": output.training_loss, "trl": trl.__version__}


# ------------------------------------------------------------------------ driver
def worker(args) -> int:
    """One side of one case, in this process; its figures to ``--worker-out``."""
    start = float(os.environ.get("PEER_START", time.time()))
    root, case, side = Path(args.root), args.case, args.side
    if args.memory_breakdown:
        import _peak

        _peak.record()
    try:
        if side == "recipes_lib":
            result = run_recipes_lib(args, case, root, start)
        else:
            result = run_trl(args, case, root, start, side)
        status = 0
        if args.memory_breakdown:
            result["memory_breakdown"] = _peak.peak_breakdown()
    except Exception as err:  # recorded; the other sides still run
        import traceback

        traceback.print_exc()
        result, status = {"error": f"{type(err).__name__}: {err}"[:2000]}, 1
    Path(args.worker_out).write_text(json.dumps(result))
    return status


def summary(sides: dict) -> dict:
    """recipes_lib's throughput and peak relative to each peer side."""
    ours = sides.get("recipes_lib", {})
    ratios = {}
    for side in PEER_SIDES:
        theirs = sides.get(side, {})
        if ours.get("tokens_per_sec") and theirs.get("tokens_per_sec"):
            ratios[f"speed_vs_{side}"] = round(ours["tokens_per_sec"] / theirs["tokens_per_sec"], 3)
            if ours.get("peak_memory_gib") and theirs.get("peak_memory_gib"):
                ratios[f"memory_vs_{side}"] = round(
                    ours["peak_memory_gib"] / theirs["peak_memory_gib"], 3
                )
    return ratios


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama_1b", help="a preset of conf/model/")
    p.add_argument("--cases", default=",".join(CASES))
    sides = ", ".join((SIDES[0], *PEER_SIDES))
    p.add_argument("--sides", default=",".join(SIDES), help=f"of: {sides}")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="SFT rows of --seq-len")
    p.add_argument("--pair-batch", type=int, default=8, help="preference pairs per step")
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument(
        "--data",
        default="long",
        choices=DATA_SHAPES,
        help="the records: builtin (the standard library's) or synthetic text, short, "
        "long or heavy-tailed",
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    add_peer_arguments(p)
    p.add_argument(
        "--memory-breakdown",
        action="store_true",
        help="record allocations and report what is alive at each side's peak (CUDA)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_len, args.batch_size, args.pair_batch = 256, 2, 2
        args.records, args.pairs, args.vocab_size = 200, 60, 512
        args.warmup_steps, args.steps = 1, 2
        if args.data == "long":  # does not fit the smoke run's rows
            args.data = "short"
    check_choices(p, args, cases=CASES, sides=(SIDES[0], *PEER_SIDES))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    from _common import emit

    result = report_header(args, "trl", "liger-kernel", "peft", "lightning")
    status = 0
    with tempfile.TemporaryDirectory(prefix="posttrain-peer-") as tmp:
        root = Path(tmp)
        make_inputs(args, root)
        for case in args.cases.split(","):
            sides = {
                side: spawn(args, case, side, root, __file__) for side in args.sides.split(",")
            }
            status |= any("error" in figures for figures in sides.values())
            result["cases"][case] = {"sides": sides, **summary(sides)}
    emit(result, args.out)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
