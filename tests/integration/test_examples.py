"""The examples run end to end on the public API (shrunk with overrides)."""

from __future__ import annotations

from pathlib import Path

from integration_helpers import tiny_overrides
from run_helpers import run_script

ROOT = Path(__file__).resolve().parents[2]


def _run_example(name: str, *args: str, cwd: Path) -> str:
    """``python examples/<name> <args>`` in ``cwd``, run in this process as its command
    line runs it (:func:`run_helpers.run_script`); what it printed."""
    proc = run_script(ROOT / "examples" / name, *args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_pretrain_tiny_example(tmp_path, shared_cache):
    overrides = [o for o in tiny_overrides(tmp_path, shared_cache) if not o.startswith("recipe=")]
    out = _run_example("pretrain_tiny.py", *overrides, cwd=tmp_path)
    assert "trained 16 steps" in out
    assert "validation loss" in out
    assert out.strip().splitlines()[-1].startswith("'def ")


def test_train_on_my_files_example(tmp_path, shared_cache):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(12):
        (folder / f"note{i}.txt").write_text(f"note {i}: " + "the quick brown fox jumps. " * 40)
    overrides = [
        o
        for o in tiny_overrides(tmp_path, shared_cache, "data=local_text")
        if not o.startswith(("recipe=", "data="))
    ]
    out = _run_example(
        "train_on_my_files.py", str(folder), *overrides, "data.val_fraction=0.2", cwd=tmp_path
    )
    assert "checkpoint:" in out and "last.ckpt" in out
