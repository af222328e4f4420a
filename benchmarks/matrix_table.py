"""The post-training matrix as a Markdown table, from ``posttrain_matrix_<card>.json``.

One row per objective, data shape and settings: each side's tokens/s, ours against
TRL+Liger, and each side's peak GiB, time to first step and graphs compiled (ours /
TRL / TRL+Liger). A side without figures shows ``-``; the cells' notes follow the
table. The docs build calls :func:`matrix_table` on a loaded file, or
:func:`matrix_table_from_file` on a path::

    python benchmarks/matrix_table.py benchmarks/results/posttrain_matrix_h100.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SIDES = ("ours", "trl", "trl_liger")
HEADER = (
    "| objective | data | settings | ours tok/s | TRL tok/s | TRL+Liger tok/s "
    "| vs TRL+Liger | peak GiB | first step s | recompiles |"
)


def _figure(side: dict | None, key: str, digits: int) -> str:
    if not side or side.get(key) is None:
        return "-"
    value = side[key]
    return f"{value:,.{digits}f}" if digits else f"{round(value):,}"


def _each(case: dict, key: str, digits: int) -> str:
    """``key`` of every side, ours / TRL / TRL+Liger."""
    return " / ".join(_figure(case.get(side), key, digits) for side in SIDES)


def _ratio(case: dict) -> str:
    ours, theirs = case.get("ours") or {}, case.get("trl_liger") or {}
    if ours.get("tokens_per_sec") and theirs.get("tokens_per_sec"):
        return f"{ours['tokens_per_sec'] / theirs['tokens_per_sec']:.2f}x"
    return "-"


def matrix_table(result: dict) -> str:
    """The Markdown table of a loaded ``posttrain_matrix_<card>.json``, with a line
    naming its card and date before it and the cells' notes after it."""
    lines = [
        f"Card: {result.get('card', '?').upper()}, {result.get('date', '?')}. Peak GiB, first "
        "step and recompiles read ours / TRL / TRL+Liger.",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    notes: list[str] = []
    for case in result.get("cases", []):
        row = (
            case["objective"],
            case["data"],
            case["settings"],
            *(_figure(case.get(side), "tokens_per_sec", 0) for side in SIDES),
            _ratio(case),
            _each(case, "peak_gib", 2),
            _each(case, "first_step_s", 1),
            _each(case, "recompiles", 0),
        )
        lines.append("| " + " | ".join(row) + " |")
        name = f"{case['objective']} / {case['data']} / {case['settings']}"
        notes += [f"- {name}: {note}" for note in case.get("notes", [])]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def matrix_table_from_file(path: str | Path) -> str:
    """:func:`matrix_table` of the JSON file at ``path``."""
    return matrix_table(json.loads(Path(path).read_text()))


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(matrix_table_from_file(name))
