"""The CSV metrics a run logs, read back for tests (integration and GPU alike)."""

from __future__ import annotations

import csv
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """Rows of every CSV log version of a run (a resume starts a new version)."""
    rows: list[dict[str, str]] = []
    for path in sorted((Path(run_dir) / "logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            rows.extend(csv.DictReader(f))
    return rows


def metric_series(rows: list[dict[str, str]], name: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every row that logged ``name``."""
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]
