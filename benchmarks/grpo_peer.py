r"""GRPO against transformers and TRL: rollouts, and whole steps, on the same folder and card.

The folder is :mod:`posttrain_peer`'s (a preset's shape, default ``llama_1b``, made by
transformers at random init, bf16, with a BPE tokenizer and a ChatML template); the
prompts are the built-in verifiable task's (``stdlib_grpo``: write a documented standard-
library function) as chat messages in ``prompts.jsonl``. Two cases, each side in a
process of its own:

- ``rollout``: sampling with the KV cache, ``--prompts`` prompts x ``--k`` completions of
  exactly ``--new-tokens`` tokens (no stop token; temperature 1, no top-p/top-k) from
  left-padded prompts, in bf16. ``recipes_lib``:
  :func:`recipes_lib.models.sampling.sample_completions` (each step a CUDA graph;
  ``recipes_lib_eager``: the same without the graph); ``transformers``:
  ``model.generate(do_sample=True, min_new_tokens=max_new_tokens, num_return_sequences=k)``
  with its default SDPA attention and dynamic cache. Completion tokens/s over
  ``--repeats`` calls after one warm-up call.
- ``grpo_step``: whole GRPO steps (sampling, rewards, one update): ``recipes_lib``'s
  ``recipe=grpo/full`` against TRL's ``GRPOTrainer`` without vLLM (its generation is
  transformers' ``generate``), with the same prompts per step, group size, completion
  limit, reward (a completion earns 1 when it parses as Python and defines a function),
  loss (GRPO's per-sequence normalisation, rewards scaled by the group's std, no KL),
  one update per batch, bf16 autocast over fp32 weights, gradient checkpointing and
  AdamW. Completion tokens/s and step time over the steps after ``--warmup-steps``,
  CUDA's peak, time to first step.

Prints one JSON object::

    python benchmarks/grpo_peer.py --out $OUT/grpo_peer.json
    python benchmarks/grpo_peer.py --cases rollout --prompts 32 --k 8

``--smoke`` runs a tiny shape on CPU in fp32 (TRL's side is skipped without trl).
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
    add_peer_arguments,
    check_choices,
    figures,
    lightning_clock,
    report_header,
    spawn,
    sync,
    trainer_clock,
)
from posttrain_peer import make_inputs as make_folder  # noqa: E402

CASES = ("rollout", "grpo_step")
SIDES = {
    "rollout": ("recipes_lib", "recipes_lib_eager", "transformers"),
    "grpo_step": ("recipes_lib", "trl"),
}
REWARD = {
    "function": {
        "weight": 1.0,
        "fn": {"_target_": "recipes_lib.rewards.defines_function", "field": None},
    }
}


def make_inputs(args, root: Path) -> None:
    """The model folder (posttrain_peer's) and ``prompts.jsonl``."""
    from recipes_lib.data.prompts.stdlib_task import stdlib_task_records

    make_folder(args, root)
    with open(root / "prompts.jsonl", "w") as f:
        for r in stdlib_task_records(args.records):
            prompt = [{"role": "user", "content": r["prompt"]}]
            f.write(json.dumps({"prompt": prompt, "name": r["name"]}) + "\n")


# ------------------------------------------------------------------------ rollout
def _prompt_ids(root: Path, tokenizer, n: int, max_len: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in rows[:n]
    ]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [list(i)[-max_len:] for i in ids]


def run_rollout(args, side: str, root: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    prompts = _prompt_ids(root, tokenizer, args.prompts, args.max_prompt)
    n, k = args.new_tokens, args.k
    if side.startswith("recipes_lib"):
        from recipes_lib.checkpoint.hf import load_hf_checkpoint
        from recipes_lib.models.sampling import sample_completions

        model, _ = load_hf_checkpoint(root / "model", dtype=dtype, device=device)
        generator = torch.Generator(device=device).manual_seed(args.seed)

        def draw() -> int:
            out = sample_completions(
                model,
                prompts,
                n,
                completions_per_prompt=k,
                temperature=1.0,
                generator=generator,
                graphed=None if side == "recipes_lib" else False,
            )
            return sum(len(t) for t in out.tokens)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=dtype).to(device).eval()
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
        ids, mask = ids.to(device), mask.to(device)

        def draw() -> int:
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    num_return_sequences=k,
                    pad_token_id=tokenizer.pad_token_id,
                )
            return int((out.shape[1] - width) * out.shape[0])

    draw()  # warm-up: allocator, kernels
    started = sync()
    tokens = sum(draw() for _ in range(args.repeats))
    seconds = sync() - started
    return {
        "tokens_per_sec": round(tokens / seconds, 1),
        "seconds_per_call": round(seconds / args.repeats, 3),
        "rows": len(prompts) * k,
        "new_tokens": n,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
    }


# ---------------------------------------------------------------------- grpo steps
def run_recipes_lib_step(args, root: Path, start: float) -> dict:
    from recipes_lib.config import compose_config
    from recipes_lib.train import run

    overrides = [
        "recipe=grpo/full",
        f"stage.init_from={root / 'model'}",
        f"data.path={root / 'prompts.jsonl'}",
        f"data.seq_len={args.max_prompt + args.new_tokens}",
        f"data.batch_size={args.prompts}",
        f"stage.grpo.completions_per_prompt={args.k}",
        f"stage.grpo.max_new_tokens={args.new_tokens}",
        "stage.grpo.updates_per_batch=1",
        "stage.grpo.loss_norm=sequence",
        "stage.grpo.kl_coef=0",
        f"trainer.max_steps={args.warmup_steps + args.steps + 1}",
        "trainer.val_check_interval=null",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "data.val_fraction=0",
        f"optim.lr={args.lr}",
        "scheduler.warmup=1",
        "run.checkpoint_every_n_steps=0",
        f"run.dir={root / 'runs' / 'grpo'}",
        f"data.cache_dir={root / 'cache'}",
        "callbacks=minimal",
        f"kernels.activation_checkpointing={str(args.checkpointing).lower()}",
        *(["trainer=cpu"] if args.smoke else []),
        *args.override,
    ]
    cfg = compose_config(overrides)
    cfg.stage.grpo.rewards = REWARD
    clock = lightning_clock()
    result = run(cfg, callbacks=[clock])
    report = figures(clock.ends, clock.tokens, args.warmup_steps, start)
    return {**report, "final_reward": result.metrics.get("train/reward"), "overrides": overrides}


def defines_a_function(completions, **kwargs) -> list[float]:
    """TRL's reward: the same check as ``recipes_lib.rewards.defines_function``."""
    from recipes_lib.rewards import defines_function

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [defines_function(t, {}, field=None) for t in texts]


def run_trl_step(args, root: Path, start: float) -> dict:
    try:
        import trl
    except ImportError as err:
        return {"skipped": f"trl is not installed ({err})"}
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer

    cuda = torch.cuda.is_available() and not args.smoke
    config = trl.GRPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=args.prompts * args.k,
        num_generations=args.k,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        max_steps=args.warmup_steps + args.steps + 1,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=1,
        bf16=cuda,
        use_cpu=not cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        dataloader_num_workers=0,
        seed=args.seed,
        gradient_checkpointing=args.checkpointing,
        use_vllm=False,
    )
    clock = trainer_clock()

    class Counted(trl.GRPOTrainer):  # completion tokens of each step's batch
        def _prepare_inputs(self, generation_batch):  # where it samples, in each step
            inputs = super()._prepare_inputs(generation_batch)
            clock.tokens.append(int(inputs["completion_mask"].sum()))
            return inputs

    trainer = Counted(
        model=str(root / "model"),
        reward_funcs=defines_a_function,
        args=config,
        train_dataset=load_dataset("json", data_files=str(root / "prompts.jsonl"))["train"],
        processing_class=AutoTokenizer.from_pretrained(root / "model"),
        callbacks=[clock],
    )
    trainer.train()
    report = figures(clock.ends, clock.tokens, args.warmup_steps, start)
    return {**report, "trl": trl.__version__}


# ------------------------------------------------------------------------ driver
def worker(args) -> int:
    start = float(os.environ.get("PEER_START", time.time()))
    root = Path(args.root)
    try:
        if args.case == "rollout":
            result = run_rollout(args, args.side, root)
        elif args.side == "recipes_lib":
            result = run_recipes_lib_step(args, root, start)
        else:
            result = run_trl_step(args, root, start)
        status = 0
    except Exception as err:  # recorded; the other sides still run
        result, status = {"error": f"{type(err).__name__}: {err}"[:2000]}, 1
    Path(args.worker_out).write_text(json.dumps(result))
    return status


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama_1b", help="a preset of conf/model/")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--prompts", type=int, default=16, help="prompts per call or step")
    p.add_argument("--k", type=int, default=8, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=256, help="prompt tokens kept (the last)")
    p.add_argument("--repeats", type=int, default=3, help="timed rollout calls")
    p.add_argument("--records", type=int, default=400)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    add_peer_arguments(p)
    args = p.parse_args(argv)
    # what posttrain_peer's folder maker reads
    args.pairs, args.seq_len = 1, args.max_prompt + args.new_tokens
    if args.smoke:
        args.prompts, args.k, args.new_tokens, args.max_prompt = 2, 2, 8, 64
        args.records, args.vocab_size, args.repeats = 40, 512, 1
        args.warmup_steps, args.steps = 1, 1
        args.seq_len = args.max_prompt + args.new_tokens
    check_choices(p, args, cases=CASES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from _common import emit

    result = report_header(args, "trl", "lightning")
    status = 0
    with tempfile.TemporaryDirectory(prefix="grpo-peer-") as tmp:
        root = Path(tmp)
        make_inputs(args, root)
        for case in args.cases.split(","):
            sides = {side: spawn(args, case, side, root, __file__) for side in SIDES[case]}
            status |= any("error" in figures for figures in sides.values())
            ours = sides["recipes_lib"].get("tokens_per_sec")
            theirs = sides[SIDES[case][-1]].get("tokens_per_sec")
            speed = {"speed": round(ours / theirs, 3)} if ours and theirs else {}
            result["cases"][case] = {"sides": sides, **speed}
    emit(result, args.out)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
