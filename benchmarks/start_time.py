r"""Time to the first optimizer step, cold and warm: each objective's recipe runs twice in
fresh processes on one machine, the second with the compile caches the first left
(inductor's FX graph and AOTAutograd caches, Triton's kernels), and each run reports
where its start went (``RunResult.start``: import, data, load, compile, first_step).

The inputs are the post-training matrix's (``posttrain_matrix.py``: the ``llama_1b``-shaped
folder at random init and its synthetic records), at the recipe defaults. The first run
starts from empty caches, as a user's first run on a machine does. Each peer of
``--sides`` (``trl``, ``trl_liger``: TRL at its defaults, Liger's Triton kernels with
caches of their own) runs cold and warm the same way, on the same GPU, one process at a
time: no run shares the host's CPUs with another, so compile and data times compare.

    python benchmarks/start_time.py --objectives dpo_live --data heavy --sides ours,trl_liger

writes ``benchmarks/results/start_time_<card>.json``: ``{"card", "date", "cases":
[{"objective", "data", "date", "command", "cold": {...}, "warm": {...}}]}`` (a case run now
replaces the file's case of the same objective and data on the same card, unless every
side of it failed; the others are kept), each side holding
``first_step_s`` (process start to the end of the first step) and the run's ``start``;
each peer's cold and warm ``first_step_s`` under ``<side>_cold`` and ``<side>_warm``.
Our runs also keep ``compile_phases``: the seconds of each of dynamo's timed phases. With
``START_PROFILE=PREFIX`` in the environment our cold run runs under cProfile, and
``PREFIX.<cell>.txt`` gets its 80 costliest functions by cumulative time (and
``PREFIX.<cell>.prof`` the whole profile, for ``pstats``' callers); a profiled case
is not a figure, and replaces no case in the file.
Objectives run one after another on GPU 0 unless ``--gpus`` spreads them. With
``--repeats N`` the sides run N rounds, every other round in reverse order (a cost of
going first in a call would otherwise fall on one side), each cold run with empty caches
of its own; each side's figure is then the mean, with its ``spread`` and every round's
``runs``. The file is written again as each side finishes, so a call cut short keeps the
sides it ran; a run past ``--side-timeout`` seconds is stopped and recorded with its
log's last line.

``--variant OVERRIDE`` (repeatable) runs our side once more per variant with that override
added, cold and warm with caches of its own, right after our plain side and in the same
call, on the same inputs (one folder and one set of records for all): its figures go
under ``ours+OVERRIDE_cold`` and ``ours+OVERRIDE_warm``. Two choices of ours are thus
compared within one call::

    python benchmarks/start_time.py --objectives sft_lora --data long --sides ours \
        --variant kernels.attention_global=flex
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import posttrain_matrix as matrix  # noqa: E402


def worker(args) -> int:
    """One run of one cell in this process; its start to ``--worker-out``."""
    start = float(os.environ["PEER_START"])
    cell, root = matrix.Cell.parse(args.case), Path(args.root)
    if args.side != "ours":  # a peer: only its time to the first step, without our imports
        report = matrix.run_trl(args, cell, root, args.side, start)
        first = report.get("time_to_first_step_s")
        figures = {"first_step_s": first} if first is not None else report
        Path(args.worker_out).write_text(json.dumps(figures))
        return 0
    from recipes_lib.config import compose_config
    from recipes_lib.train import run

    # a folder of its own: the warm run must not resume the cold one's
    overrides = matrix.our_overrides(args, cell, root)
    overrides += [f"run.dir={root / 'runs' / cell.name / os.environ['START_TAG']}"]
    clock = matrix.lightning_clock()
    profile_to = os.environ.get("START_PROFILE") if os.environ["START_TAG"] == "cold" else None
    if profile_to:  # one file a cell
        profile_to = f"{profile_to}.{cell.name}.txt"
    if profile_to:  # where the cold run's time goes, function by function
        import cProfile
        import pstats

        with cProfile.Profile() as profiler:
            result = run(compose_config(overrides), callbacks=[clock])
        with open(profile_to, "w") as sink:
            pstats.Stats(profiler, stream=sink).sort_stats("cumulative").print_stats(80)
        profiler.dump_stats(profile_to.removesuffix(".txt") + ".prof")  # callers, elsewhere
    else:
        result = run(compose_config(overrides), callbacks=[clock])
    report = {
        "first_step_s": round(clock.ends[0] - start, 1),
        "start": result.start,
        "compiled": result.compiled,
        "compile_phases": compile_phases(),
        **({"profiled": True} if profile_to else {}),  # slowed by cProfile: not a figure
    }
    Path(args.worker_out).write_text(json.dumps(report))
    return 0


def compile_phases() -> dict[str, float]:
    """Seconds of each of dynamo's timed compile phases in this process (dynamo's
    tracing, AOTAutograd, inductor's lowering and code generation, Triton's kernels),
    summed over the run's graphs, the longest first."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: round(sum(values), 2) for name, values in compilation_time_metrics.items()}
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def one_run(
    args,
    cell,
    root: Path,
    cache: Path,
    gpu: str | None,
    tag: str,
    side: str = "ours",
    variant: str | None = None,
) -> dict:
    """One fresh process of ``side`` on ``cell`` (ours with ``variant``'s override added,
    when given), its compile caches under ``cache``; what it reported."""
    name = side if variant is None else f"{side}.{_file_safe(variant)}"
    out = root / f"{cell.name}.{name}.{tag}.json"
    env = {**os.environ, "PEER_START": repr(time.time())}
    env["START_TAG"] = tag if variant is None else f"{_file_safe(variant)}.{tag}"  # its run.dir
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    command = [sys.executable, __file__, *args.argv, "--worker", "--case", cell.name]
    command += ["--side", side, "--root", str(root), "--worker-out", str(out)]
    if variant is not None:
        command += ["--override", variant]
    log = root / f"{cell.name}.{name}.{tag}.log"
    with open(log, "w") as sink:
        try:
            done = subprocess.run(
                command, env=env, stdout=sink, stderr=sink, check=False, timeout=args.side_timeout
            )
        except subprocess.TimeoutExpired:  # subprocess.run killed it
            return {"error": f"past --side-timeout={args.side_timeout} s: {_last(log)}"}
    if out.is_file():
        return json.loads(out.read_text())
    return {"error": f"status {done.returncode}: {_last(log)}"}


def _last(log: Path) -> str:
    return matrix.last_line(log.read_text(errors="replace"))


def rounds(order: list[tuple[str, str | None]], repeats: int) -> list[tuple[int, tuple]]:
    """``order`` ``repeats`` times, every other round reversed: a side that runs first in
    one round runs last in the next, so a cost of going first in a call (a GPU's first
    process, a cold page cache) does not fall on one side alone."""
    out: list[tuple[int, tuple]] = []
    for round_ in range(repeats):
        out += [(round_, job) for job in (order if round_ % 2 == 0 else order[::-1])]
    return out


def summary(reports: list[dict]) -> dict:
    """One side's runs of a kind (cold or warm) as one figure: the run itself when there
    is one; else the mean ``first_step_s`` with its ``spread`` [min, max], every run's
    figure in ``runs`` (None for a failed one), and the mean of each part of ``start``."""
    if len(reports) == 1:
        return reports[0]
    good = [r for r in reports if r.get("first_step_s") is not None]
    if not good:
        return {"error": reports[-1].get("error", "no figures"), "runs": [None] * len(reports)}
    firsts = [r["first_step_s"] for r in good]
    out: dict = {
        "first_step_s": matrix._mean(firsts),
        "spread": matrix._range(firsts),
        "runs": [r.get("first_step_s") for r in reports],
    }
    starts = [r["start"] for r in good if r.get("start")]
    if starts:
        out["start"] = {k: matrix._mean([s[k] for s in starts]) for k in starts[0]}
    if good[-1].get("compiled") is not None:
        out["compiled"] = good[-1]["compiled"]
    return out


def _file_safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def run_order(sides: list[str], variants: list[str]) -> list[tuple[str, str | None]]:
    """``(side, variant)`` in the order they run: each variant of ours right after our
    plain side (first when ours is not among ``sides``)."""
    variants_of_ours: list[tuple[str, str | None]] = [("ours", v) for v in variants]
    order: list[tuple[str, str | None]] = [] if "ours" in sides else variants_of_ours
    for side in sides:
        order.append((side, None))
        if side == "ours":
            order += variants_of_ours
    return order


def parse_variants(argv: list[str]) -> tuple[list[str], list[str]]:
    """``--variant OVERRIDE`` values out of ``argv``, and the rest of it."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--variant", action="append", default=[])
    known, rest = parser.parse_known_args(argv)
    return known.variant, rest


def merged(path: Path, card: str, cases: list[dict], earlier: dict | None = None) -> dict:
    """The file's ``cases`` with these replacing those of the same objective and data; the
    others, from earlier calls on the same card, kept with the date and command they were
    measured by. A new case that has no figure (every side failed) or was profiled
    replaces nothing: it is written beside the kept one under ``not_kept``. ``earlier``:
    the file as read before (default: read now)."""
    key = ("objective", "data")
    if earlier is None:
        earlier = json.loads(path.read_text()) if path.is_file() else {}
    if earlier.get("card", card) != card:
        earlier = {}  # another card's file: none of its cases is this card's

    def usable(case: dict) -> bool:
        sides = [v for k, v in case.items() if k.endswith(("cold", "warm"))]
        figures = any("first_step_s" in side for side in sides)
        return figures and not any(side.get("profiled") for side in sides)

    new = {tuple(c[k] for k in key): c for c in cases if usable(c)}
    kept = [
        {"date": earlier.get("date"), "command": earlier.get("command"), **case}
        for case in earlier.get("cases", [])
        if tuple(case[k] for k in key) not in new
    ]
    result = {k: v for k, v in earlier.items() if k not in ("card", "date", "command", "cases")}
    result["date"] = max([c["date"] for c in cases] + [earlier.get("date") or ""])
    result["cases"] = kept + list(new.values())
    if unusable := [c for c in cases if not usable(c)]:
        result["not_kept"] = unusable
    return result


class CaseFile:
    """The result file, written again each time a side finishes (:meth:`put`): a call
    cut short by its time limit keeps every side it ran. Each write merges this call's
    cases so far into the file as it was before the call (:func:`merged`)."""

    def __init__(self, path: Path, card: str, date: str, command: str) -> None:
        self.path, self.card, self.date, self.command = path, card, date, command
        self.before = json.loads(path.read_text()) if path.is_file() else {}
        self.cases: dict[int, dict] = {}
        self.lock = threading.Lock()  # cells run in threads, one per GPU

    def put(self, index: int, case: dict) -> None:
        """Case ``index`` of this call, as it stands now, into the file."""
        with self.lock:
            self.cases[index] = dict(case)
            cases = [self.cases[i] for i in sorted(self.cases)]
            stamped = [{**c, "date": self.date, "command": self.command} for c in cases]
            result = merged(self.path, self.card, stamped, earlier=self.before)
            matrix.write_json(self.path, {"card": self.card, **result})  # whole or not at all


def main() -> int:
    variants, argv = parse_variants(sys.argv[1:])
    args = matrix.parse_args(argv)
    if args.worker:
        return worker(args)
    args.argv = argv
    import torch
    from _common import command_line

    cuda = torch.cuda.is_available() and not args.smoke
    card = matrix.card_name(torch.cuda.get_device_name(0)) if cuda else "cpu"
    cells = [
        matrix.Cell(objective, data, "defaults")
        for objective in args.objectives.split(",")
        for data in args.data.split(",")
    ]
    gpus = args.gpus.split(",") if args.gpus else ["0" if cuda else None]
    with tempfile.TemporaryDirectory(prefix="start-time-") as tmp:
        root = Path(tmp)
        matrix.make_inputs(args, root, sorted({c.data for c in cells}))
        # cold means empty compile caches, not one side writing the bytecode of packages
        # both import (installed without it) for the side after it
        matrix.prime_imports([side for side, _ in run_order(args.sides.split(","), variants)])

        out = Path(args.out or Path(args.out_dir) / f"start_time_{card}.json")
        record = CaseFile(out, card, time.strftime("%Y-%m-%d"), command_line())

        def both(i_cell):
            i, cell = i_cell
            gpu = gpus[i % len(gpus)]
            case: dict = {"objective": cell.objective, "data": cell.data}
            if args.repeats > 1:
                case["repeats"] = args.repeats
            reports: dict[str, dict[str, list[dict]]] = {}  # label: cold and warm runs
            for round_, (side, variant) in rounds(
                run_order(args.sides.split(","), variants), args.repeats
            ):
                label = side if variant is None else f"{side}+{variant}"
                cache = root / "caches" / cell.name / _file_safe(label) / str(round_)
                suffix = "" if round_ == 0 else f".{round_}"  # each round's own run.dir
                cold = one_run(args, cell, root, cache, gpu, "cold" + suffix, side, variant)
                warm = one_run(args, cell, root, cache, gpu, "warm" + suffix, side, variant)
                print(
                    f"{cell.name} {label} (round {round_}): cold {cold.get('first_step_s')} s,"
                    f" warm {warm.get('first_step_s')} s",
                    flush=True,
                )
                runs = reports.setdefault(label, {"cold": [], "warm": []})
                runs["cold"].append(cold)
                runs["warm"].append(warm)
                names = ("cold", "warm") if label == "ours" else (f"{label}_cold", f"{label}_warm")
                case.update(zip(names, (summary(runs["cold"]), summary(runs["warm"])), strict=True))
                record.put(i, case)

        with ThreadPoolExecutor(len(gpus)) as pool:
            list(pool.map(both, enumerate(cells)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
