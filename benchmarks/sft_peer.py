r"""SFT from a Hugging Face folder: recipes_lib against TRL's ``SFTTrainer``.

Both train the same folder on the same conversations, in this process, on this card:

- the folder: a preset's shape (default ``qwen3_1_7b``) made by transformers at random
  init and saved (bf16) with a tokenizer (a BPE trained on the conversations, with the
  ChatML tokens) and a ChatML chat template: what a user's downloaded folder holds;
- the data: ``--records`` of the built-in instruction conversations (``stdlib_sft``, the
  data of the Llama figures) as a ``chat.jsonl`` of ``messages``;
- recipes_lib: ``recipe=sft/full stage.init_from=FOLDER data.path=chat.jsonl`` and
  nothing else but the sizes (``data.seq_len``, ``data.batch_size``, steps): packed rows,
  and on a GPU compiled blocks with the document mask (flex), bf16 autocast over fp32
  weights, fused AdamW;
- TRL: ``SFTTrainer`` on the folder and the same records, ``packing=True`` (best-fit
  packing, padding-free: one row of ``batch_size x seq_len`` tokens with position ids,
  which transformers turns into a block-diagonal mask for SDPA), ``max_length`` the same
  ``seq_len``, ``per_device_train_batch_size`` the same, bf16 autocast over fp32 weights
  (the model loaded in fp32), ``adamw_torch_fused``, SDPA attention (flash-attn is not
  installed here).

Throughput counts the real (non-padding) tokens of the timed steps (after
``--warmup-steps``), from each side's batches; the peak is CUDA's allocated peak over the
run. Both use the same learning rate and no gradient checkpointing. Prints one JSON
object::

    python benchmarks/sft_peer.py --out $OUT/sft_peer.json

A side that fails is recorded as ``{"error": ...}`` (exit status 1); TRL not installed
is ``{"skipped": ...}``. ``--smoke`` runs a tiny Qwen3 shape on CPU in fp32, for CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from _common import emit, package_versions, reset_memory
from lightning.pytorch.callbacks import Callback

from recipes_lib.checkpoint.hf import hf_config_from_model
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer
from recipes_lib.train import run

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_folder(args, root: Path) -> tuple[Path, Path]:
    """The model folder and the ``chat.jsonl`` both sides train on."""
    folder, chat = root / "model", root / "chat.jsonl"
    folder.mkdir(parents=True)
    records = stdlib_instruction_records(args.records)
    with open(chat, "w") as f:
        for r in records:
            turns = [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["response"]},
            ]
            f.write(json.dumps({"messages": turns}) + "\n")
    texts = [r["prompt"] + r["response"] for r in records]
    tokenizer = train_bpe_tokenizer(texts, args.vocab_size - 2, PAD)
    tokenizer.add_special_tokens([IM_START, IM_END])
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": PAD,
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))

    from transformers import AutoConfig, AutoModelForCausalLM

    model = to_run_config(compose_config([f"model={args.model}"])).model
    if args.smoke:
        model = replace(model, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
        model = replace(model, ffn_dim=128, vocab_size=args.vocab_size)
    model = replace(model, max_seq_len=max(args.seq_len, 2048))
    fields = hf_config_from_model(model, eos_token_id=tokenizer.token_to_id(IM_END))
    for key in ("architectures", "torch_dtype", "dtype"):
        fields.pop(key)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(args.seed)
    hf = AutoModelForCausalLM.from_config(config)
    hf.to(torch.float32 if args.smoke else torch.bfloat16).save_pretrained(folder)
    del hf
    return folder, chat


class StepClock(Callback):
    """Wall time and real tokens of each training step (synchronised at its end)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id
        self.ends: list[float] = []
        self.tokens: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        self.tokens.append(int((batch["input_ids"] != self.pad_id).sum()))


def figures(ends: list[float], tokens: list[int], warmup: int, device) -> dict:
    """Tokens/s and step time over the steps after ``warmup`` (each step's tokens)."""
    timed = len(ends) - warmup - 1
    if timed < 1:
        raise RuntimeError(f"only {len(ends)} steps ran; {warmup + 2} needed")
    seconds = ends[-1] - ends[warmup]
    counted = sum(tokens[warmup + 1 :])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {
        "tokens_per_sec": round(counted / seconds, 1),
        "step_time_ms": round(seconds / timed * 1000, 2),
        "timed_steps": timed,
        "tokens_per_step": round(counted / timed, 1),
        "peak_memory_gib": round(peak, 3) if peak is not None else None,
    }


def run_recipes_lib(args, folder: Path, chat: Path, root: Path, device) -> dict:
    from recipes_lib.data.tokenizer import load_tokenizer

    pad_id = load_tokenizer(folder).token_to_id(PAD)
    clock = StepClock(pad_id)
    overrides = [
        "recipe=sft/full",
        f"stage.init_from={folder}",
        f"data.path={chat}",
        f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch_size}",
        f"trainer.max_steps={args.warmup_steps + args.steps + 1}",
        "trainer.val_check_interval=null",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "data.val_fraction=0",
        f"optim.lr={args.lr}",
        "scheduler.warmup=1",
        "run.checkpoint_every_n_steps=0",
        f"run.dir={root / 'recipes_lib'}",
        f"data.cache_dir={root / 'cache'}",
        "callbacks=minimal",
        *(["trainer=cpu"] if device.type == "cpu" else []),
    ]
    result = run(compose_config(overrides), callbacks=[clock])
    report = figures(clock.ends, clock.tokens, args.warmup_steps, device)
    return {**report, "final_loss": result.metrics.get("train/loss"), "overrides": overrides}


def run_trl(args, folder: Path, chat: Path, root: Path, device) -> dict:
    try:
        import trl
    except ImportError as err:
        return {"skipped": f"trl is not installed ({err})"}
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.seen: list[int] = []

        def on_step_end(self, targs, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            self.seen.append(int(state.num_input_tokens_seen))

    clock = Clock()
    config = trl.SFTConfig(
        output_dir=str(root / "trl"),
        max_length=args.seq_len,
        packing=True,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup_steps + args.steps + 1,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=1,
        bf16=device.type == "cuda",
        use_cpu=device.type == "cpu",
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        include_num_input_tokens_seen=True,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        dataloader_num_workers=0,
        seed=args.seed,
    )
    dataset = load_dataset("json", data_files=str(chat), split="train")
    trainer = trl.SFTTrainer(
        model=str(folder),
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(folder),
        callbacks=[clock],
    )
    output = trainer.train()
    tokens = [b - a for a, b in zip([0, *clock.seen], clock.seen, strict=False)]
    report = figures(clock.ends, tokens, args.warmup_steps, device)
    return {**report, "final_loss": output.training_loss, "trl": trl.__version__}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3_1_7b", help="a preset of conf/model/")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--sides", default="recipes_lib,trl")
    p.add_argument("--smoke", action="store_true", help="a tiny Qwen3 shape on CPU, fp32")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_len, args.batch_size, args.records, args.vocab_size = 256, 2, 200, 512
        args.warmup_steps, args.steps = 1, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    result: dict = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": package_versions("torch", "transformers", "trl", "lightning"),
        "sides": {},
    }
    status = 0
    with tempfile.TemporaryDirectory(prefix="sft-peer-") as tmp:
        root = Path(tmp)
        folder, chat = make_folder(args, root)
        for side, work in (("recipes_lib", run_recipes_lib), ("trl", run_trl)):
            if side not in args.sides.split(","):
                continue
            reset_memory(device)
            try:
                result["sides"][side] = work(args, folder, chat, root, device)
            except Exception as err:  # recorded; the other side still runs
                result["sides"][side] = {"error": f"{type(err).__name__}: {err}"[:1000]}
                status = 1
    ours, theirs = result["sides"].get("recipes_lib", {}), result["sides"].get("trl", {})
    if "tokens_per_sec" in ours and "tokens_per_sec" in theirs:
        result["recipes_lib/trl"] = round(ours["tokens_per_sec"] / theirs["tokens_per_sec"], 3)
    emit(result, args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
