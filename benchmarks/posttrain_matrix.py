r"""Every post-training objective against TRL and TRL+Liger: one matrix, one file per card.

A cell is an objective on a data shape under one choice of settings; each cell runs
three sides, ours, TRL and TRL+Liger (``use_liger_kernel=True``), each side in a
process of its own on a GPU of its own. Sides run in parallel across the visible GPUs
(one process per GPU through ``CUDA_VISIBLE_DEVICES``, a shared work queue, longest
first); a side that fails is recorded and the others go on.

- objectives: ``sft_full``, ``sft_lora``, ``sft_qlora``, ``dpo_live`` (a reference in
  memory), ``dpo_precomputed`` (its log-probs computed before training), ``orpo``,
  ``simpo``, ``kto``, ``reward``, ``distill`` (forward KL to a teacher on the records'
  answers) and ``grpo`` (sampling, rewards, one update per step). TRL's trainers:
  ``SFTTrainer`` (with PEFT, and bitsandbytes for QLoRA), ``DPOTrainer``,
  ``experimental.orpo.ORPOTrainer``, ``experimental.cpo.CPOTrainer`` (``loss_type=
  "simpo"``), ``KTOTrainer``, ``RewardTrainer``, ``experimental.gkd.GKDTrainer``
  (``lmbda=0``: no student sampling; ``beta=0``: forward KL) and ``GRPOTrainer``.
- data: synthetic records of ``_peer.synthetic_records`` on one model folder
  (``llama_1b``'s shape at random init, bf16, a BPE tokenizer with a ChatML template):
  ``short`` (answers near 100 tokens), ``long`` (prompts and answers near 300) and
  ``heavy`` (heavy-tailed lengths up to the sequence length).
- settings: ``defaults`` runs each side as it comes (our recipe; TRL's config with its
  defaults: 8 unpacked examples of at most 1024 tokens, checkpointing on, the folder's
  bf16 weights); ``matched`` gives every side the same batch shape (``--batch-size``
  packed rows for SFT, ``--pair-batch`` pairs or examples otherwise), the same maximum
  length (``--seq-len``), gradient checkpointing on, bf16 autocast over fp32 weights and
  fused AdamW. What defines the objective is the same under both: LoRA's rank, alpha and
  targets, the losses' beta and margins, GRPO's group size.

Each side reports ``tokens_per_sec`` (real, non-padding input tokens of the
``--steps`` steps after ``--warmup-steps``; both sequences of a pair, KTO's mismatched
twins too; GRPO: completion tokens), ``peak_gib`` (``torch.cuda.max_memory_allocated``
over the whole process, for every side), ``first_step_s`` (from the process's start to
the end of its first optimizer step), ``recompiles`` (graphs dynamo compiled in the run:
ours is the run summary's ``RunResult.compiled``, a peer's dynamo's own counters, 0 when
it compiles nothing) and ``recompile_limit_hits``. A worker also counts the graphs
dynamo compiled between the end of the warmup and the last timed step (a batch of a new
shape late in the run), whose compile time the tokens/s then include: a cell with any
names the most of its runs in its notes. With ``--repeats N`` each side runs N times: each figure
is the mean and the cell's ``spread`` holds its [min, max].

The result, ``<out-dir>/posttrain_matrix_<card>.json``, is
``{"card", "date", "command", "cases": [{"objective", "data", "settings", "ours", "trl",
"trl_liger", "date", "command", ...}]}`` (each cell's date and command are those of the
call that measured it; the file's, the latest call's); a side that failed or has no peer
is ``null`` with a line in the cell's ``notes``. Cells already in the file from another
call are kept, the ones run now replaced, so the matrix can be filled a part at a time::

    python benchmarks/posttrain_matrix.py --objectives sft_full,dpo_live --data short
    python benchmarks/posttrain_matrix.py --dry-run            # the plan, no GPU needed
    python benchmarks/matrix_table.py benchmarks/results/posttrain_matrix_h100.json

One module over 500 lines: the plan, both sides' runners and the file they fill are one
matrix; most of its length is TRL's side, one trainer per objective.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _peer import (  # noqa: E402
    add_peer_arguments,
    check_choices,
    compile_counts,
    figures,
    last_line,
    lightning_clock,
    make_folder,
    prime_imports,
    real_tokens,
    spawn,
    synthetic_records,
    trainer_clock,
    write_records,
)

OBJECTIVES = (
    "sft_full",
    "sft_lora",
    "sft_qlora",
    "dpo_live",
    "dpo_precomputed",
    "orpo",
    "simpo",
    "kto",
    "reward",
    "distill",
    "grpo",
)
DATA = ("short", "long", "heavy")
SETTINGS = ("defaults", "matched")
SIDES = ("ours", "trl", "trl_liger")
FIGURES = ("tokens_per_sec", "peak_gib", "first_step_s", "recompiles", "recompile_limit_hits")

# the records file each objective trains on (``_peer.write_records``'s kinds)
RECORDS = {
    "sft_full": "chat",
    "sft_lora": "chat",
    "sft_qlora": "chat",
    "distill": "chat",
    "dpo_live": "pairs",
    "dpo_precomputed": "pairs",
    "orpo": "pairs",
    "simpo": "pairs",
    "reward": "pairs",
    "kto": "unpaired",
    "grpo": "prompts",
}
# our recipe for each objective, and what makes it that objective
RECIPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sft_full": ("sft/full", ()),
    "sft_lora": ("sft/lora", ()),
    "sft_qlora": ("sft/qlora", ()),
    "dpo_live": ("dpo/full", ()),
    "dpo_precomputed": ("dpo/full", ("stage.dpo.precompute_reference=true",)),
    "orpo": ("dpo/full", ("stage.objective=orpo", "stage.orpo.odds_ratio_weight=0.1")),
    "simpo": (
        "dpo/full",
        ("stage.objective=simpo", "stage.simpo.beta=2.0", "stage.simpo.gamma=1.0"),
    ),
    "kto": ("kto/full", ()),
    "reward": ("reward/full", ()),
    "distill": ("distill/full", ()),
    "grpo": ("grpo/full", ("stage.grpo.kl_coef=0",)),
}
# a side that cannot run an objective: (side, objective) -> why. TRL 1.16 has a trainer
# for each (some under trl.experimental); with Liger, its reward trainer fails on a
# sequence-classification model, so a reward cell is compared with TRL alone
NO_PEER: dict[tuple[str, str], str] = {
    ("trl_liger", "reward"): (
        "TRL 1.16.0's RewardTrainer with use_liger_kernel=True fails on a "
        "sequence-classification model (AttributeError: 'LlamaForSequenceClassification' "
        "object has no attribute 'lm_head', liger-kernel 0.8.5); compare with trl"
    ),
}
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
HF_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIMPO = {"beta": 2.0, "gamma": 1.0}
FORMAT = r".*answer:\s*\S.*"  # GRPO's reward on both sides: an answer line, 0 or 1
# rough seconds one side's process takes on an H100 (start, compile, 14 steps), for the
# queue's order and the dry run's estimate; not measurements
SECONDS = {
    "sft_full": 80,
    "sft_lora": 70,
    "sft_qlora": 90,
    "dpo_live": 110,
    "dpo_precomputed": 150,
    "orpo": 90,
    "simpo": 90,
    "kto": 110,
    "reward": 80,
    "distill": 110,
    "grpo": 150,
}


@dataclass(frozen=True)
class Cell:
    """One row of the matrix: an objective on a data shape under one choice of settings."""

    objective: str
    data: str
    settings: str

    @property
    def name(self) -> str:
        return f"{self.objective}.{self.data}.{self.settings}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        objective, data, settings = name.split(".")
        return cls(objective, data, settings)


@dataclass(frozen=True)
class Job:
    """One side of one cell, one repeat: one process on one GPU."""

    cell: Cell
    side: str
    repeat: int

    @property
    def tag(self) -> str:
        return f"{self.cell.name}.{self.side}.{self.repeat}"

    @property
    def seconds(self) -> int:
        return SECONDS[self.cell.objective]


def plan(
    objectives=OBJECTIVES, data=DATA, settings=SETTINGS, sides=SIDES, repeats: int = 1
) -> tuple[list[Cell], list[Job]]:
    """Every cell of the selection, in the matrix's order, and the jobs that fill it
    (a side with no peer for the objective has none), longest first."""
    cells = [Cell(o, d, s) for o in objectives for d in data for s in settings]
    jobs = [
        Job(cell, side, r)
        for cell in cells
        for side in sides
        if (side, cell.objective) not in NO_PEER
        for r in range(repeats)
    ]
    jobs.sort(key=lambda j: -j.seconds)  # longest first: the queue ends evenly
    return cells, jobs


def estimate_s(jobs: list[Job], gpus: int) -> float:
    """The wall time a queue of ``jobs`` takes on ``gpus`` GPUs, by ``SECONDS``."""
    ends = [0.0] * max(1, gpus)
    for job in jobs:  # longest first onto the GPU that frees first, as the queue does
        ends[ends.index(min(ends))] += job.seconds
    return max(ends)


# ---------------------------------------------------------------------------- inputs
def make_inputs(args, root: Path, shapes: list[str]) -> None:
    """One model folder, and each shape's records in every file kind, under ``root``."""
    texts: list[str] = []
    for shape in shapes:
        records = synthetic_records(shape, args.records, args.seq_len, args.seed)
        (root / shape).mkdir(parents=True)
        for kind in ("chat", "pairs", "unpaired", "prompts"):
            write_records(kind, root / shape / f"{kind}.jsonl", records)
        texts += [r["prompt"] + r["response"] for r in records[:500]]
    make_folder(
        root / "model",
        texts,
        model=args.model,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        seed=args.seed,
        smoke=args.smoke,
    )


def batch_size(args, objective: str) -> int:
    """The matched batch: rows of packed conversations for SFT, else examples."""
    return args.batch_size if objective.startswith("sft") else args.pair_batch


def steps(args, objective: str) -> tuple[int, int]:
    """Warm-up and timed steps of ``objective`` (GRPO's steps are long: fewer)."""
    if objective == "grpo":
        return args.grpo_warmup_steps, args.grpo_steps
    return args.warmup_steps, args.steps


# ------------------------------------------------------------------------------ ours
def our_overrides(args, cell: Cell, root: Path) -> list[str]:
    """The recipe's overrides for one cell: the folder, the records, the run's length;
    under ``matched`` the batch shape, length and checkpointing too."""
    recipe, objective_overrides = RECIPES[cell.objective]
    warmup, timed = steps(args, cell.objective)
    folder = root / "model"
    overrides = [
        f"recipe={recipe}",
        *objective_overrides,
        f"stage.init_from={folder}",
        f"data.path={root / cell.data / (RECORDS[cell.objective] + '.jsonl')}",
        f"trainer.max_steps={warmup + timed + 1}",
        "trainer.val_check_interval=null",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "data.val_fraction=0",
        "run.checkpoint_every_n_steps=0",
        f"run.dir={root / 'runs' / cell.name}",
        f"data.cache_dir={root / 'cache' / cell.name}",
        "callbacks=minimal",
        *(["trainer=cpu"] if args.smoke else []),
    ]
    if cell.objective == "distill":
        overrides.append(f"stage.distill.teacher_from={folder}")
    if cell.settings == "matched":
        overrides.append("kernels.activation_checkpointing=true")
        if cell.objective != "grpo":
            overrides.append(f"data.batch_size={batch_size(args, cell.objective)}")
        if cell.objective == "grpo":  # as TRL's matched GRPO: one update per batch
            overrides += [
                f"data.batch_size={args.prompts}",
                f"data.seq_len={args.max_prompt + args.new_tokens}",
                f"stage.grpo.completions_per_prompt={args.k}",
                f"stage.grpo.max_new_tokens={args.new_tokens}",
                "stage.grpo.updates_per_batch=1",
            ]
        else:
            overrides.append(f"data.seq_len={args.seq_len}")
        if cell.objective == "distill":  # TRL's GKD pads conversations: so do we here
            overrides.append("data.chat.packing=false")
    if args.smoke and cell.objective == "grpo":
        overrides += [
            f"data.batch_size={args.prompts}",
            f"data.seq_len={args.max_prompt + args.new_tokens}",
            f"stage.grpo.completions_per_prompt={args.k}",
            f"stage.grpo.max_new_tokens={args.new_tokens}",
        ]
    elif args.smoke:
        overrides += [f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}"]
    return overrides + list(args.override)


def run_ours(args, cell: Cell, root: Path, start: float) -> dict:
    from recipes_lib.config import compose_config
    from recipes_lib.train import run

    cfg = compose_config(our_overrides(args, cell, root))
    if cell.objective == "grpo":
        fn = {"_target_": "recipes_lib.rewards.format_match", "pattern": FORMAT}
        cfg.stage.grpo.rewards = {"format": {"weight": 1.0, "fn": fn}}
    clock = lightning_clock()
    result = run(cfg, callbacks=[clock])
    warmup = steps(args, cell.objective)[0]
    report = figures(clock.ends, clock.tokens, warmup, start, clock.graphs)
    compiled = result.compiled or {}
    return {
        **report,
        "recompiles": int(compiled.get("graphs", 0)),
        "recompile_limit_hits": int(compiled.get("recompile_limit_hits", 0)),
        # what kernels.activation_checkpointing=auto chose (with --override
        # run.memory_budget_gib=N: the peak above against N)
        "memory_fit": result.memory_fit,
    }


# ------------------------------------------------------------------------------- TRL
def trl_trainer(args, cell: Cell, root: Path, side: str, clock, cuda: bool):
    """The TRL trainer of one cell and side, ready to ``train()``, counting the real
    tokens of each step into ``clock``."""
    import torch
    import trl
    from datasets import load_dataset
    from transformers import AutoTokenizer

    objective, matched = cell.objective, cell.settings == "matched"
    warmup, timed = steps(args, objective)
    common: dict = {
        "output_dir": str(root / "trl" / cell.name / side),
        "max_steps": warmup + timed + 1,
        "save_strategy": "no",
        "report_to": [],
        "seed": args.seed,
        "use_liger_kernel": side == "trl_liger",
        "use_cpu": not cuda,
        "bf16": cuda,
    }
    if matched:
        common.update(
            per_device_train_batch_size=batch_size(args, objective),
            gradient_checkpointing=True,
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        )
        if objective != "grpo":
            common["max_length"] = args.seq_len
    if args.smoke:
        common["per_device_train_batch_size"] = 2
        if objective != "grpo":
            common["max_length"] = args.seq_len
    folder = str(root / "model")
    kind = RECORDS[objective]
    dataset = load_dataset("json", data_files=str(root / cell.data / f"{kind}.jsonl"))["train"]
    extra: dict = {}
    if objective in ("sft_lora", "sft_qlora"):
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules=HF_LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
    if objective == "sft_qlora":
        from transformers import BitsAndBytesConfig

        extra["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    if objective.startswith("sft"):
        packed = {"packing": True} if matched else {}
        config, trainer_class = trl.SFTConfig(**packed, **common), trl.SFTTrainer
    elif objective.startswith("dpo"):
        precompute = objective == "dpo_precomputed"
        config = trl.DPOConfig(beta=0.1, precompute_ref_log_probs=precompute, **common)
        trainer_class = trl.DPOTrainer
    elif objective == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        config, trainer_class = ORPOConfig(beta=0.1, **common), ORPOTrainer
    elif objective == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        config = CPOConfig(
            loss_type="simpo",
            cpo_alpha=0.0,
            beta=SIMPO["beta"],
            simpo_gamma=SIMPO["gamma"],
            **common,
        )
        trainer_class = CPOTrainer
    elif objective == "kto":
        config, trainer_class = trl.KTOConfig(beta=0.1, **common), trl.KTOTrainer
    elif objective == "reward":
        config, trainer_class = trl.RewardConfig(**common), trl.RewardTrainer
    elif objective == "distill":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        teacher = {"teacher_model_init_kwargs": {"dtype": "bfloat16"}} if matched else {}
        config = GKDConfig(lmbda=0.0, beta=0.0, temperature=1.0, **teacher, **common)
        trainer_class = GKDTrainer
        extra["teacher_model"] = folder
    else:
        config = trl_grpo_config(args, trl, common, matched)
        trainer_class = trl.GRPOTrainer
        extra["reward_funcs"] = answer_line

    class Counted(trainer_class):  # type: ignore[valid-type,misc]
        """Counts each step's real tokens (GRPO: its completion tokens)."""

        def training_step(self, model, inputs, *a, **kw):
            if objective != "grpo":
                clock.tokens.append(real_tokens(inputs))
            return super().training_step(model, inputs, *a, **kw)

        def _prepare_inputs(self, inputs):
            prepared = super()._prepare_inputs(inputs)
            if objective == "grpo":
                clock.tokens.append(int(prepared["completion_mask"].sum()))
            return prepared

    return Counted(
        model=folder,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(folder),
        callbacks=[clock],
        **extra,
    )


def trl_grpo_config(args, trl, common: dict, matched: bool):
    """GRPO's config: no KL term as ours; matched, the same group and completion length,
    one update per batch (one generation per step)."""
    grpo = {"beta": 0.0, "use_vllm": False}
    if matched:
        grpo.update(
            per_device_train_batch_size=args.prompts * args.k,
            num_generations=args.k,
            max_completion_length=args.new_tokens,
            num_iterations=1,
            steps_per_generation=1,
        )
    if args.smoke:
        grpo.update(per_device_train_batch_size=4, num_generations=2, max_completion_length=8)
    return trl.GRPOConfig(**{**common, **grpo})


def answer_line(completions, **kwargs) -> list[float]:
    """TRL's GRPO reward: ours (``recipes_lib.rewards.format_match`` of ``FORMAT``)."""
    from recipes_lib.rewards import format_match

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [format_match(t, {}, pattern=FORMAT) for t in texts]


def run_trl(args, cell: Cell, root: Path, side: str, start: float) -> dict:
    import torch

    try:
        import trl  # noqa: F401

        if side == "trl_liger":
            import liger_kernel  # noqa: F401
    except ImportError as err:
        return {"skipped": f"not installed: {err}"}
    cuda = torch.cuda.is_available() and not args.smoke
    clock = trainer_clock()
    before = compile_counts()
    trl_trainer(args, cell, root, side, clock, cuda).train()
    warmup = steps(args, cell.objective)[0]
    report = figures(clock.ends, clock.tokens, warmup, start, clock.graphs)
    graphs, hits = (now - then for now, then in zip(compile_counts(), before, strict=True))
    return {**report, "recompiles": graphs, "recompile_limit_hits": hits}


def side_figures(report: dict) -> dict:
    """The five figures of a worker's report, under the matrix's names, and the graphs
    compiled during its timed steps where it counted them."""
    out = {
        "tokens_per_sec": report["tokens_per_sec"],
        "peak_gib": report["peak_memory_gib"],
        "first_step_s": report["time_to_first_step_s"],
        "recompiles": report["recompiles"],
        "recompile_limit_hits": report["recompile_limit_hits"],
    }
    if "graphs_in_timed_steps" in report:
        out["graphs_in_timed_steps"] = report["graphs_in_timed_steps"]
    return out


def worker(args) -> int:
    """One side of one cell, in this process; its figures to ``--worker-out``."""
    start = float(os.environ.get("PEER_START", time.time()))
    cell, root = Cell.parse(args.case), Path(args.root)
    try:
        if args.side == "ours":
            report = run_ours(args, cell, root, start)
        else:
            report = run_trl(args, cell, root, args.side, start)
        result = report if "skipped" in report else side_figures(report)
        status = 0
    except Exception as err:  # recorded; the other sides still run
        import traceback

        traceback.print_exc()
        result, status = {"error": last_line(f"{type(err).__name__}: {err}")[:500]}, 1
    Path(args.worker_out).write_text(json.dumps(result))
    return status


# ----------------------------------------------------------------------------- report
def card_name(device_name: str) -> str:
    """``h100`` or ``h200`` from a CUDA device's name; else its name in lower case,
    letters and digits only (``cpu`` without one)."""
    lowered = device_name.lower()
    for card in ("h200", "h100", "a100", "l40s", "b200"):
        if card in lowered:
            return card
    return "".join(c for c in lowered if c.isalnum()) or "cpu"


def _mean(values: list) -> float | None:
    """The mean of a figure over repeats (``None`` where it has none: peaks on a CPU)."""
    known = [v for v in values if v is not None]
    return round(statistics.fmean(known), 3) if known else None


def _range(values: list) -> list | None:
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if known else None


def settings_label(settings: str, overrides: list[str]) -> str:
    """A cell's ``settings`` with the ``--override`` our side ran under: a cell run
    with overrides is a cell of its own, never the plain one's replacement."""
    return ", ".join([settings, *overrides])


def summarise(
    cell: Cell, runs: dict[str, list[dict]], sides=SIDES, overrides: list[str] = ()
) -> dict:
    """The matrix's entry for ``cell`` from each side's reports (one per repeat): the
    mean of each figure, ``null`` with a note for a side that has none, and the
    [min, max] of each figure under ``spread`` when a side ran more than once."""
    label = settings_label(cell.settings, list(overrides))
    entry: dict = {"objective": cell.objective, "data": cell.data, "settings": label}
    notes: list[str] = []
    spread: dict = {}
    for side in SIDES:
        reports = runs.get(side, [])
        good = [r for r in reports if r.get("tokens_per_sec") is not None]
        if (side, cell.objective) in NO_PEER:
            notes.append(f"{side}: {NO_PEER[side, cell.objective]}")
        elif side not in sides:
            notes.append(f"{side}: not run in this call")
        elif not good:
            why = next((r.get("error") or r.get("skipped") for r in reports), None)
            notes.append(f"{side}: {why or 'no figures'}")
        if not good:
            entry[side] = None
            continue
        entry[side] = {k: _mean([r[k] for r in good]) for k in FIGURES}
        late = max((r.get("graphs_in_timed_steps") or 0 for r in good), default=0)
        if late:  # its tokens/s include compiling: a figure not to compare as it is
            notes.append(f"{side}: {late} graph(s) compiled during the timed steps")
        if good[0].get("memory_fit"):  # ours under kernels.activation_checkpointing=auto
            entry[side]["memory_fit"] = good[0]["memory_fit"]
        if len(reports) > 1:
            spread[side] = {k: _range([r[k] for r in good]) for k in FIGURES}
            if len(good) < len(reports):
                notes.append(f"{side}: {len(reports) - len(good)} of {len(reports)} runs failed")
    if spread:
        entry["repeats"] = max(len(r) for r in runs.values())
        entry["spread"] = spread
    if notes:
        entry["notes"] = notes
    return entry


def merge(path: Path, card: str, command: str, entries: list[dict]) -> dict:
    """The file's matrix with ``entries`` in place of the cells they name (the others
    kept, from an earlier call on the same card), in the matrix's order; the file's
    other keys (a ``notes`` written by hand) kept too. Each entry carries the ``date``
    and ``command`` of the call that measured it; the file's own are the latest call's."""
    kept: dict = {}
    cases: dict[tuple, dict] = {}
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("card") == card:
            kept = old
            cases = {(c["objective"], c["data"], c["settings"]): c for c in old["cases"]}
    today = datetime.date.today().isoformat()
    for entry in entries:
        key = entry["objective"], entry["data"], entry["settings"]
        cases[key] = {**entry, "date": today, "command": command}
    order = {name: i for i, name in enumerate(OBJECTIVES + DATA + SETTINGS)}
    return {
        **kept,
        "card": card,
        "date": today,
        "command": command,
        "cases": sorted(cases.values(), key=lambda c: [order.get(c[k], 99) for k in KEY]),
    }


KEY = ("objective", "data", "settings")
NOT_STARTED = "not started"


def started(runs: dict[str, list[dict]]) -> bool:
    """Whether any side of a cell ran (was not held back by ``--budget-s``)."""
    reports = [r for side_runs in runs.values() for r in side_runs]
    return any(not r.get("error", "").startswith(NOT_STARTED) for r in reports)


def write_json(path: Path, result: dict) -> None:
    """Write ``result`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- driver
def run_queue(
    args, jobs: list[Job], root: Path, gpus: list[str | None], on_cell=None
) -> dict[Job, dict]:
    """Every job, one process per GPU at a time, from one queue; a job that would end
    past ``--budget-s`` is not started and recorded as such. ``on_cell(cell, results)``
    is called (one thread at a time) as soon as every job of a cell has its report, so
    a call cut short keeps the cells it finished."""
    todo: queue.Queue[Job] = queue.Queue()
    for job in jobs:
        todo.put(job)
    results: dict[Job, dict] = {}
    started = time.monotonic()
    pending = collections.Counter(job.cell for job in jobs)
    lock = threading.Lock()

    def finished(job: Job, report: dict) -> None:
        with lock:  # reports go in under the lock that a cell's copy is read under
            results[job] = report
            pending[job.cell] -= 1
            if pending[job.cell] == 0 and on_cell is not None:
                on_cell(job.cell, {j: r for j, r in results.items() if j.cell == job.cell})

    def drain(gpu: str | None) -> None:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            elapsed = time.monotonic() - started
            if args.budget_s and elapsed + job.seconds > args.budget_s:
                finished(job, {"error": f"{NOT_STARTED}: --budget-s={args.budget_s} s spent"})
                continue
            log = root / "logs" / f"{job.tag}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            report = spawn(
                args, job.cell.name, job.side, root, __file__, gpus=gpu, tag=job.tag, log=log
            )
            state = report.get("error") or report.get("skipped") or report.get("tokens_per_sec")
            print(f"[{gpu}] {job.tag}: {state}", file=sys.stderr, flush=True)
            finished(job, report)

    threads = [threading.Thread(target=drain, args=(gpu,)) for gpu in gpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--data", default=",".join(DATA))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--repeats", type=int, default=1, help="runs of each side; mean and spread")
    p.add_argument("--gpus", default=None, help="GPU indices to spread over (default: all)")
    p.add_argument("--budget-s", type=int, default=0, help="start no side past this (0: none)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and jobs; run none")
    p.add_argument(
        "--out-dir",
        default=str(Path(__file__).parent / "results"),
        help="where posttrain_matrix_<card>.json goes (--out: another file name)",
    )
    p.add_argument("--model", default="llama_1b", help="a preset of conf/model/")
    p.add_argument("--seq-len", type=int, default=2048, help="matched maximum length")
    p.add_argument("--batch-size", type=int, default=4, help="matched SFT rows of --seq-len")
    p.add_argument("--pair-batch", type=int, default=8, help="matched pairs or examples")
    p.add_argument("--records", type=int, default=2000, help="records of each data shape")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--grpo-warmup-steps", type=int, default=1)
    p.add_argument("--grpo-steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="matched GRPO prompts per step")
    p.add_argument("--k", type=int, default=8, help="GRPO completions per prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="GRPO completion length")
    p.add_argument("--max-prompt", type=int, default=768, help="matched GRPO prompt room")
    add_peer_arguments(p)
    p.set_defaults(side_timeout=300)
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_len, args.batch_size, args.pair_batch = 256, 2, 2
        args.records, args.vocab_size = 60, 512
        args.warmup_steps, args.steps, args.grpo_warmup_steps, args.grpo_steps = 1, 1, 1, 1
        args.prompts, args.k, args.new_tokens, args.max_prompt = 2, 2, 8, 128
    check_choices(p, args, objectives=OBJECTIVES, data=DATA, settings=SETTINGS, sides=SIDES)
    if args.repeats < 1:
        p.error("--repeats: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    pick = {name: getattr(args, name).split(",") for name in ("objectives", "data", "settings")}
    sides = args.sides.split(",")
    cells, jobs = plan(pick["objectives"], pick["data"], pick["settings"], sides, args.repeats)
    if args.dry_run:
        gpus = len(args.gpus.split(",")) if args.gpus else 4
        for cell in cells:
            print(cell.name)
        print(
            f"{len(cells)} cells, {len(jobs)} side processes; about "
            f"{estimate_s(jobs, gpus) / 60:.0f} min on {gpus} GPUs (a rough guess)"
        )
        return 0

    import torch
    from _common import command_line

    cuda = torch.cuda.is_available() and not args.smoke
    card = card_name(torch.cuda.get_device_name(0)) if cuda else "cpu"
    if args.gpus:
        gpus: list[str | None] = args.gpus.split(",")
    elif cuda:
        gpus = [str(i) for i in range(torch.cuda.device_count())]
    else:
        gpus = [None]
    path = Path(args.out or Path(args.out_dir) / f"posttrain_matrix_{card}.json")

    def write_cell(cell: Cell, cell_results: dict[Job, dict]) -> None:
        """The file with ``cell``'s entry merged in, written as soon as the cell is done;
        a cell none of whose sides started (the budget ran out) keeps an earlier call's."""
        runs: dict[str, list[dict]] = {}
        for job in sorted(cell_results, key=lambda j: j.tag):
            runs.setdefault(job.side, []).append(cell_results[job])
        if started(runs):
            entry = summarise(cell, runs, sides, args.override)
            write_json(path, merge(path, card, command_line(), [entry]))

    with tempfile.TemporaryDirectory(prefix="posttrain-matrix-") as tmp:
        root = Path(tmp)
        make_inputs(args, root, pick["data"])
        prime_imports(sides)  # whichever side starts first, no side imports cold
        results = run_queue(args, jobs, root, gpus, on_cell=write_cell)
    if not any(started({"-": [r]}) for r in results.values()):
        print(f"no side started within --budget-s; {path} unchanged", file=sys.stderr)
        return 1
    from matrix_table import matrix_table

    print(matrix_table(json.loads(path.read_text())))
    failed = any(r.get("error") for r in results.values())
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
