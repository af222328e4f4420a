"""MkDocs hooks: the generated pages, made afresh on every ``mkdocs build`` or ``serve``.

``reference/config.md`` comes from the schema and ``conf/``; ``benchmarks/results.md``
from ``benchmarks/results/*.json``. Neither is written to ``docs/``: they exist only in
the built site, so they cannot go stale in the repository.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark_tables  # noqa: E402
import config_reference  # noqa: E402

GENERATED = {
    "reference/config.md": config_reference.render,
    "benchmarks/results.md": benchmark_tables.render,
}


def on_files(files: Files, config) -> Files:
    for uri, render in GENERATED.items():
        files.append(File.generated(config, uri, content=render()))
    return files
