"""What the peer benchmarks (``posttrain_peer.py``, ``grpo_peer.py``, ``eval_peer.py``,
``posttrain_matrix.py``) share: the inputs every side trains on (a model folder and
synthetic records of a chosen shape), the step figures, the clocks that record each
side's steps, what dynamo compiled, and the process each side runs in."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------- inputs
DATA_SHAPES = ("builtin", "short", "long", "heavy")
# a word list for synthetic text: the BPE learns each word, so words are about tokens
_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an "
    "model data train loss token layer value step batch memory speed error function "
    "return list index item name path file result output input weight gradient sample "
    "reason answer question because therefore first second then finally each every"
).split()


def _words(rng, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def synthetic_records(shape: str, n: int, seq_len: int, seed: int) -> list[dict]:
    """``n`` prompt/response/rejected records of synthetic text, their lengths in words
    (about tokens) by ``shape``: ``short`` prompts of 20-80 and answers near 100;
    ``long`` prompts and answers near 300; ``heavy`` Pareto-distributed lengths, most
    short and some up to the sequence length."""
    import random

    rng = random.Random(seed)

    def lengths() -> tuple[int, int, int]:
        if shape == "short":
            return rng.randint(20, 80), rng.randint(60, 140), rng.randint(60, 140)
        if shape == "long":
            return rng.randint(250, 350), rng.randint(250, 350), rng.randint(250, 350)
        budget = seq_len // 2 - 8  # a pair's prompt and longer answer fit one row
        tail = [min(budget // 2, int(rng.paretovariate(1.2) * 30)) for _ in range(3)]
        return tuple(tail)  # type: ignore[return-value]

    records = []
    for _ in range(n):
        p, c, r = lengths()
        records.append(
            {"prompt": _words(rng, p), "response": _words(rng, c), "rejected": _words(rng, r)}
        )
    return records


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def write_records(kind: str, path: Path, records: list[dict]) -> None:
    """``records`` (prompt, response, rejected) as chat messages in the file ``kind``
    needs: ``chat`` (a conversation), ``pairs`` (prompt, chosen, rejected), ``unpaired``
    (prompt, completion and label: each record twice, its answer desirable and its
    rejected answer not) or ``prompts`` (a prompt alone)."""
    rows: list[dict] = []
    for r in records:
        if kind == "chat":
            rows.append({"messages": _user(r["prompt"]) + _assistant(r["response"])})
        elif kind == "pairs":
            chosen, rejected = _assistant(r["response"]), _assistant(r["rejected"])
            rows.append({"prompt": _user(r["prompt"]), "chosen": chosen, "rejected": rejected})
        elif kind == "unpaired":
            for answer, label in ((r["response"], True), (r["rejected"], False)):
                rows.append(
                    {"prompt": _user(r["prompt"]), "completion": _assistant(answer), "label": label}
                )
        elif kind == "prompts":
            rows.append({"prompt": _user(r["prompt"])})
        else:
            raise ValueError(f"unknown record file kind {kind!r}")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def make_folder(
    folder: Path,
    texts: list[str],
    *,
    model: str,
    vocab_size: int,
    seq_len: int,
    seed: int,
    smoke: bool,
) -> Path:
    """A Hugging Face folder of the preset ``model``'s shape at random init (bf16; fp32
    and tiny under ``smoke``), with a BPE tokenizer trained on ``texts`` (with the
    ChatML tokens) and a ChatML chat template: what a user's downloaded folder holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from recipes_lib.checkpoint.hf_export import hf_config_from_model
    from recipes_lib.config import compose_config, to_run_config
    from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer

    folder.mkdir(parents=True)
    tokenizer = train_bpe_tokenizer(texts, vocab_size - 2, PAD)
    tokenizer.add_special_tokens([IM_START, IM_END])
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": PAD,
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    shape = to_run_config(compose_config([f"model={model}"])).model
    if smoke:
        shape = replace(shape, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
        shape = replace(shape, ffn_dim=128)
    shape = replace(shape, vocab_size=vocab_size, max_seq_len=max(seq_len, 2048))
    fields = hf_config_from_model(shape, eos_token_id=tokenizer.token_to_id(IM_END))
    for key in ("architectures", "torch_dtype", "dtype"):
        fields.pop(key, None)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config)
    hf.to(torch.float32 if smoke else torch.bfloat16).save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- figures
def real_tokens(inputs: dict) -> int:
    """Non-padding tokens of a TRL batch: both sequences of preference pairs (their
    attention masks), else the attention mask with KTO's mismatched twins', else every
    id (padding-free packing)."""

    def masked(*keys: str) -> list:
        return [inputs[k] for k in keys if inputs.get(k) is not None]

    masks = masked("chosen_attention_mask", "rejected_attention_mask")
    masks = masks or masked("attention_mask", "KL_attention_mask")
    if masks:
        return int(sum(int(mask.sum()) for mask in masks))
    return int(inputs["input_ids"].numel())


def compile_counts() -> tuple[int, int]:
    """Dynamo's graphs compiled and recompile-limit hits so far in this process, read
    here rather than from a run's result so that any version of the library, and any
    peer, is measured the same way."""
    from torch._dynamo.utils import counters

    hits = sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason)
    return int(counters["stats"].get("unique_graphs", 0)), int(hits)


def figures(
    ends: list[float],
    tokens: list[int],
    warmup: int,
    start: float,
    graphs: list[int] | None = None,
) -> dict:
    """Tokens/s and step time over the steps after ``warmup``; time to the first step;
    with ``graphs`` (dynamo's count at each step's end), the graphs compiled during the
    timed steps, whose compile time the tokens/s then includes."""
    import torch

    timed = len(ends) - warmup - 1
    if timed < 1:
        raise RuntimeError(f"only {len(ends)} steps ran; {warmup + 2} needed")
    seconds = ends[-1] - ends[warmup]
    counted = sum(tokens[warmup + 1 :])
    cuda = torch.cuda.is_available()
    return {
        "tokens_per_sec": round(counted / seconds, 1),
        "step_time_ms": round(seconds / timed * 1000, 2),
        "timed_steps": timed,
        "tokens_per_step": round(counted / timed, 1),
        "time_to_first_step_s": round(ends[0] - start, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        **({"graphs_in_timed_steps": graphs[-1] - graphs[warmup]} if graphs else {}),
    }


def sync() -> float:
    """The time, once the GPU has finished its queued work."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.time()


def lightning_clock():
    """A Lightning callback that records each step's end and the tokens it trained on."""
    from lightning.pytorch.callbacks import Callback

    class Clock(Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.tokens: list[int] = []
            self.graphs: list[int] = []  # dynamo's graphs compiled so far, at each end

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(sync())
            self.graphs.append(compile_counts()[0])
            # a step's micro-batches come as one list
            batches = batch if isinstance(batch, list) else [batch]
            self.tokens.append(sum(pl_module.count_tokens(b) for b in batches))

    return Clock()


def trainer_clock():
    """A transformers callback that records each step's end (the caller counts tokens)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.tokens: list[int] = []
            self.graphs: list[int] = []  # dynamo's graphs compiled so far, at each end

        def on_step_end(self, targs, state, control, **kwargs):
            self.ends.append(sync())
            self.graphs.append(compile_counts()[0])

    return Clock()


# what each side's process imports before its first step; imported once, untimed, before
# any side starts, so no side pays for writing another's bytecode (a package installed
# without compiling it) or reading cold files the other then finds in the page cache
SIDE_IMPORTS = {
    "ours": "import recipes_lib.train, recipes_lib.config, peft",
    "trl": "import trl, transformers, accelerate, peft",
    "trl_liger": "import trl, transformers, accelerate, peft, liger_kernel.transformers",
}


def prime_imports(sides) -> None:
    """Import every side's packages once in a throwaway process (failures ignored: a side
    that cannot import reports that itself)."""
    lines = [f"try:\n    {SIDE_IMPORTS[s]}\nexcept Exception:\n    pass" for s in sides]
    subprocess.run([sys.executable, "-c", "\n".join(lines)], check=False, capture_output=True)


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` (an error's, a log's), or ``""``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def spawn(
    args,
    case: str,
    side: str,
    root: Path,
    script: str,
    *,
    gpus: str | None = None,
    tag: str | None = None,
    log: Path | None = None,
) -> dict:
    """Run one side of one case in a process of the benchmark ``script`` (its
    ``--worker`` mode) and read back its figures. ``gpus`` sets the process's
    ``CUDA_VISIBLE_DEVICES``; ``tag`` names its files (``case.side`` by default). With
    ``log``, its output goes there and a process that leaves no figures is recorded with
    the log's last line; without, it goes to this process's own."""
    tag = tag or f"{case}.{side}"
    out = root / f"{tag}.json"
    command = [sys.executable, script, *args.argv, "--worker"]
    command += ["--case", case, "--side", side, "--root", str(root), "--worker-out", str(out)]
    env = {**os.environ, "PEER_START": repr(time.time())}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    # compile caches of its own: no side starts from kernels another side compiled
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[name] = str(root / "caches" / tag / name.lower())
    sink = open(log, "w") if log is not None else None  # noqa: SIM115 (closed below)
    try:
        done = subprocess.run(
            command, env=env, timeout=args.side_timeout, check=False, stdout=sink, stderr=sink
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the {side} process ran past --side-timeout={args.side_timeout} s"}
    finally:
        if sink is not None:
            sink.close()
    if out.is_file():
        return json.loads(out.read_text())
    tail = f": {last_line(log.read_text(errors='replace'))}" if log is not None else ""
    status = done.returncode
    return {"error": f"the {side} process exited with status {status} and no figures{tail}"}


# what a side's worker process is told, left out of the reported settings
WORKER_ONLY = ("out", "worker", "case", "side", "root", "worker_out", "argv")


def add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every peer benchmark takes: the seed, gradient checkpointing, each
    side's time limit, further overrides of the library's side, the smoke mode and the
    output, and the hidden ones of a side's worker process."""
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--checkpointing", type=lambda s: s.lower() in ("1", "true", "on"), default=True)
    p.add_argument("--side-timeout", type=int, default=900)
    p.add_argument("--override", action="append", default=[], help="a further recipes_lib override")
    p.add_argument("--smoke", action="store_true", help="a tiny shape on CPU, fp32")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)


def check_choices(p: argparse.ArgumentParser, args: argparse.Namespace, **allowed) -> None:
    """Refuse (``p.error``) a comma-separated option naming what it does not allow:
    ``check_choices(p, args, sides=SIDES)`` checks ``--sides``."""
    for name, known in allowed.items():
        unknown = set(getattr(args, name).split(",")) - set(known)
        if unknown:
            p.error(f"--{name}: unknown {sorted(unknown)}; choose from {list(known)}")


def report_header(args: argparse.Namespace, *packages: str) -> dict:
    """The start of a peer benchmark's report: its settings, the card and the versions of
    torch and ``packages``; its ``cases`` to fill."""
    import torch
    from _common import package_versions

    cuda = torch.cuda.is_available() and not args.smoke
    return {
        "settings": {k: v for k, v in vars(args).items() if k not in WORKER_ONLY},
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": package_versions("torch", "transformers", *packages),
        "cases": {},
    }
