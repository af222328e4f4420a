"""The wheel ships the config groups, the recipes and the callbacks package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_contains_configs_recipes_and_callbacks(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("recipes_lib-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "recipes_lib/conf/config.yaml" in names
    assert "recipes_lib/conf/model/llama_1b.yaml" in names
    for recipe in (ROOT / "recipes").rglob("*.yaml"):
        assert f"recipes_lib/conf/recipe/{recipe.relative_to(ROOT / 'recipes')}" in names
    assert "recipes_lib/callbacks/__init__.py" in names
    assert "recipes_lib/callbacks/throughput.py" in names
    sources = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src").rglob("*.py")}
    assert sources <= names, sorted(sources - names)[:5]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "recipes-train" in text and "recipes-prepare" in text
