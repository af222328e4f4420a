r"""How long a run goes on after its last optimizer step, and where that time goes.

Runs ``recipes-train`` as a user would (a subprocess, the library's own CLI) with a
clock callback added through the config (``+callbacks.end_clock``), and prints one JSON
object. Per run:

- ``step_s``: the median time of the timed steps (the figure the tail is set beside);
- ``after_last_step_s``: from the end of the last optimizer step to the process's exit,
  as the parent process sees it;
- ``writes_s``: the part of it spent writing what the run is configured to write (the
  final step checkpoint and its checksum, ``last.ckpt``, the output weights, tokenizer
  and manifest), and ``beyond_writes_s`` the rest: the target is at most 5 s;
- ``phases_s``: the tail split by what the main thread was doing, from its stack
  sampled every ``--sample-ms`` after the last step (validation, checkpoint save,
  weights export, Lightning's teardown, interpreter exit, other; a sample counts the
  time since the one before), and ``top_frames``: per phase, the innermost library and
  framework frames the samples sat in. ``events_after_last_step_s``: when ``on_train_end`` and
  ``on_fit_end`` ran and the clock's exit handler (the first of them) began.

Two runs by default, on one GPU: ``pretrain`` (``recipe=pretrain/llama_1b``, the
built-in corpus, a 32k tokenizer) and ``sft``, which starts from the pretraining run's
output folder (``recipe=sft/full stage.init_from=...``, a Llama-3.2-1B shape). Usage::

    python benchmarks/end_of_run.py --out $OUT/end_of_run.json

``--smoke`` runs both on the tiny recipes on a CPU in about a minute.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

HERE = Path(__file__).resolve()
PHASES = (  # (phase, a function name on the stack that marks it), first match wins
    ("validation", "_run_validation"),
    ("weights export", "export_weights"),
    ("checkpoint save", "save_checkpoint"),
    ("teardown", "_teardown"),
    ("run() return", "_last_lr"),
)
WRITE_PHASES = ("checkpoint save", "weights export")
LIBRARIES = ("recipes_lib", "lightning", "torch", "safetensors", "hydra")


class EndClock(Callback):
    """Times steps and samples the main thread's stack after the last one.

    Written to ``path`` at interpreter exit (atexit): the wall time of each step end,
    the samples' phases and frames, and when ``on_train_end`` and ``on_fit_end`` ran.
    """

    def __init__(self, path: str, sample_ms: float = 50.0) -> None:
        self.path = path
        self.interval = sample_ms / 1000.0
        self.step_ends: list[float] = []
        self.events: dict[str, float] = {}
        self.samples: list[tuple[float, str, str]] = []
        self._main = threading.main_thread().ident
        self._sampling = False
        atexit.register(self._write)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.time()
        if not self.step_ends or trainer.global_step != len(self.step_ends):
            self.step_ends.append(now)
        if trainer.global_step >= trainer.max_steps and not self._sampling:
            self._sampling = True
            threading.Thread(target=self._sample, daemon=True).start()

    def on_train_end(self, trainer, pl_module) -> None:
        self.events["on_train_end"] = time.time()

    def on_fit_end(self, trainer, pl_module) -> None:
        self.events["on_fit_end"] = time.time()

    def _sample(self) -> None:
        while True:
            frame = sys._current_frames().get(self._main)
            stack = []
            while frame is not None:
                stack.append(frame)
                frame = frame.f_back
            names = {f.f_code.co_name for f in stack}
            phase = next((p for p, fn in PHASES if fn in names), "other")
            top = next(
                (
                    f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"
                    for f in stack
                    if any(lib in f.f_code.co_filename for lib in LIBRARIES)
                ),
                "?",
            )
            if not stack:
                phase, top = "interpreter exit", "-"
            self.samples.append((time.time(), phase, top))
            time.sleep(self.interval)

    def _write(self) -> None:
        self.events["atexit"] = time.time()
        record = {
            "step_ends": self.step_ends,
            "events": self.events,
            "samples": self.samples,
            "interval_s": self.interval,
        }
        Path(self.path).write_text(json.dumps(record))


def summarise(clock: dict, exited: float, timed_from: int) -> dict:
    """The figures of one run from its clock record and the parent's exit time."""
    ends = clock["step_ends"]
    steps = [b - a for a, b in zip(ends[timed_from:], ends[timed_from + 1 :], strict=False)]
    last = ends[-1]
    phases: Counter[str] = Counter()
    frames: dict[str, Counter[str]] = {}
    # each sample stands for the time since the one before it: where the main thread
    # holds the interpreter lock in C code (pickling, say) the sampler cannot run, and the
    # wait is counted to what it finds when it can
    previous = last
    for at, phase, top in clock["samples"]:
        phases[phase] += at - previous
        frames.setdefault(phase, Counter())[top] += at - previous
        previous = at
    tail = exited - last
    # after the last sample: the exit handlers registered before the clock, then the
    # interpreter's own teardown
    phases["interpreter exit"] += max(0.0, exited - previous)
    writes = sum(phases[p] for p in WRITE_PHASES)
    events = {k: round(v - last, 2) for k, v in clock["events"].items()}
    return {
        "steps": len(ends),
        "step_s": round(statistics.median(steps), 3) if steps else None,
        "after_last_step_s": round(tail, 2),
        "writes_s": round(writes, 2),
        "beyond_writes_s": round(tail - writes, 2),
        "phases_s": {k: round(v, 2) for k, v in phases.most_common()},
        "events_after_last_step_s": events,
        "top_frames": {
            phase: {k: round(v, 2) for k, v in counter.most_common(6)}
            for phase, counter in frames.items()
        },
    }


def tokenizer_of(work: Path) -> Path:
    """The tokenizer the pretraining run trained (in its data cache)."""
    found = sorted((work / "cache" / "tokenizers").glob("*/tokenizer.json"))
    if not found:
        raise FileNotFoundError(f"no tokenizer.json under {work / 'cache' / 'tokenizers'}")
    return found[0]


def run_one(name: str, overrides: list[str], work: Path, args) -> dict:
    clock = work / f"{name}.clock.json"
    if name == "sft":
        overrides = [*overrides, f"data.tokenizer.path={tokenizer_of(work)}"]
    argv = [
        str(Path(sys.executable).parent / "recipes-train"),
        *overrides,
        f"run.dir={work / name}",
        f"data.cache_dir={work / 'cache'}",
        "run.allowed_targets=[end_of_run.]",
        f"+callbacks.end_clock={{_target_: end_of_run.EndClock, path: '{clock}', "
        f"sample_ms: {args.sample_ms}}}",
        "trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), *sys.path])}
    started = time.time()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    exited = time.time()
    if proc.returncode != 0 or not clock.is_file():
        return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-4000:]}
    figures = summarise(json.loads(clock.read_text()), exited, args.warmup_steps)
    figures["wall_s"] = round(exited - started, 1)
    figures["command"] = " ".join(argv[1:])
    return figures


def configs(args, work: Path) -> dict[str, list[str]]:
    common = [
        f"trainer.max_steps={args.steps}",
        f"run.checkpoint_every_n_steps={args.steps // 2}",
        "trainer.val_check_interval=null",
        "scheduler.warmup=2",
    ]
    if args.smoke:
        pretrain = ["recipe=pretrain/tiny", "data.sources.stdlib.max_documents=120", *common]
        sft = ["recipe=sft/tiny", *common]
    else:
        pretrain = [
            "recipe=pretrain/llama_1b",
            "data.tokenizer.vocab_size=32000",
            "data.batch_size=4",
            "trainer.accumulate_grad_batches=1",
            *common,
        ]
        sft = [
            "recipe=sft/full",
            "data=stdlib_sft",
            "data.chat.chat_template=plain",  # the pretraining tokenizer has no chat tokens
            "data.seq_len=2048",
            "data.batch_size=4",
            *common,
        ]
    return {"pretrain": pretrain, "sft": [*sft, f"stage.init_from={work / 'pretrain'}"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps not timed")
    parser.add_argument("--sample-ms", type=float, default=50.0)
    parser.add_argument("--runs", default="pretrain,sft")
    parser.add_argument("--timeout-s", type=float, default=500)
    parser.add_argument("--work-dir", default=None, help="where the runs write (a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny recipes on a CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="end-of-run-"))
    result: dict[str, Any] = {"settings": vars(args), "runs": {}}
    try:
        import torch

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - the figures stand without it
        result["device"] = None
    wanted = args.runs.split(",")
    for name, overrides in configs(args, work).items():
        if name not in wanted:
            continue
        try:
            result["runs"][name] = run_one(name, overrides, work, args)
        except Exception as err:  # noqa: BLE001 - recorded, the next run still goes
            result["runs"][name] = {"error": repr(err), "trace": traceback.format_exc()[-2000:]}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    sys.exit(1 if any("error" in r for r in main()["runs"].values()) else 0)
