"""The benchmark results page, generated from the JSON files in ``benchmarks/results/``.

Each file is the output of one benchmark command. The page gives, per file, the card it
ran on (its ``device`` or ``card``), the command (its ``command``), its ``date`` or else
the date the file was first committed (through renames), and one table of its headline
figures: every object in the file holding one of the ``METRICS`` keys becomes a row,
named by its path in the file (a listed case that names its ``objective``, by it and its
``data``). Values are printed as the file holds them, never rounded. A new result file
appears on the next build.

Run ``python docs/gen/benchmark_tables.py`` to print the page.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# the figures worth a column, in the order they are shown
METRICS = (
    "tokens_per_sec",
    "tokens_per_sec_per_gpu",
    "mfu",
    "step_time_ms",
    "step_time_ms_median",
    "step_ms_median",
    "ms_median",
    "peak_memory_gib",
    "scaling_efficiency",
    "speed_vs_trl_liger",
    "speed_vs_trl",
    "speed",
    "memory_vs_trl_liger",
    "memory_vs_trl",
    "examples_per_sec",
    "flex_causal/sdpa_causal",
    "flex_document_mean512/sdpa_causal",
    "flex_document_mean1024/sdpa_causal",
    "val_loss",
    "train_loss_last10_mean",
    "optimizer_state_bytes_per_param",
    "largest_model",
    "after_last_step_s",
    "first_step_s",
    "writes_s",
    "overhead_per_checkpoint_s",
    "save_blocked_s",
    "estimate_gib",
    "measured_gib",
    "error",
)
# parts of a file that describe a run rather than measure it
SKIPPED = {"config", "settings", "versions", "overrides", "top_frames", "phases_s", "definitions"}
# container names left out of a row's label
CONTAINERS = {"models", "trainers", "cases", "sides", "runs", "summary", "presets"}
CONTAINERS |= {"shapes", "masks", "backends"}


def render() -> str:
    lines = [
        "# All benchmark results",
        "",
        "Generated from the JSON files in `benchmarks/results/` each time the site is built:",
        "for each file, the card and command it records, its date (or the date it was first",
        "committed), and the headline figures it holds, exactly as written there. What",
        "limits each figure is in `benchmarks/results/NOTES.md`; the",
        "[Benchmarks](../benchmarks.md) page summarises them.",
        "",
    ]
    for path in sorted(RESULTS.glob("*.json")):
        lines += _section(path)
    return "\n".join(lines).rstrip() + "\n"


def _section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    if path.name.startswith("posttrain_matrix_"):  # its own table: sides side by side
        return [
            f"## `{path.name}`",
            "",
            f"- command: `{data.get('command')}`",
            "",
            _matrix_table(data),
            "",
        ]
    card = data.get("device") or data.get("card") or "not recorded"
    command = data.get("command")
    date = data.get("date") or f"first committed {_first_committed(path)}"
    lines = [
        f"## `{path.name}`",
        "",
        f"- card: {card}",
        f"- command: `{command}`" if command else "- command: not recorded in the file",
        f"- date: {date}",
        "",
    ]
    rows = list(_rows(data, ()))
    if not rows:
        return lines + ["No headline figures in this file; read it whole.", ""]
    columns = [m for m in METRICS if any(m in values for _, values in rows)]
    lines += ["| " + " | ".join(["what", *columns]) + " |", "|" + "---|" * (len(columns) + 1)]
    for label, values in rows:
        cells = [_cell(values.get(c, "")) for c in columns]
        lines.append("| " + " | ".join([label or "(the file)", *cells]) + " |")
    return lines + [""]


def _matrix_table(data: dict) -> str:
    """The post-training matrix as its own generator renders it (benchmarks/matrix_table.py)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from matrix_table import matrix_table

    return matrix_table(data)


def _rows(node: Any, path: tuple[str, ...]):
    """(label, {metric: value}) for every object holding a metric, outermost first."""
    if not isinstance(node, dict):
        return
    values = {k: v for k, v in node.items() if k in METRICS and _scalar(v)}
    if isinstance(node.get("step_time_ms"), dict) and "median" in node["step_time_ms"]:
        values["step_time_ms"] = node["step_time_ms"]["median"]
    if values:
        yield " / ".join(p for p in path if p not in CONTAINERS), values
    for key, child in node.items():
        if key in SKIPPED:
            continue
        if isinstance(child, dict):
            yield from _rows(child, (*path, key))
        elif isinstance(child, list):  # cases that name what they measured (not series)
            for item in child:
                if isinstance(item, dict) and "objective" in item:
                    name = " ".join(str(item[k]) for k in ("objective", "data") if k in item)
                    yield from _rows(item, (*path, key, name))


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str)) and not isinstance(value, bool)


def _first_committed(path: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "log", "--follow", "--format=%cs", "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git history)"
    return out[-1] if out else "not committed yet"  # the oldest, through renames


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("<", "&lt;")


if __name__ == "__main__":
    print(render(), end="")
