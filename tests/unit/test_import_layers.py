"""Nothing imports upward: every import between the package's rooms (its folders and
top-level modules) points to a lower floor, as docs/contributing.md draws them.

Every import counts, at module level, inside a function or under ``TYPE_CHECKING``: an
upward import, even a lazy one, makes two rooms that can only be understood together.
A new room fails here until it is given its floor.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# lowest first; a room may import only rooms on lower floors
FLOORS: list[set[str]] = [
    {"errors", "conf", "console", "trackers", "lazy"},
    {"files", "losses", "kernels"},
    {"config"},
    {"models", "data", "optim"},
    {"adapters", "checkpoint"},
    {"generate", "export", "rewards"},
    {"evaluation"},
    {"callbacks"},
    {"parallel"},
    {"training"},
    {"objectives"},
    {"preflight"},
    {"assembly"},
    {"launch_check"},
    {"train"},
    {"pipeline"},
    {"sweep"},
    {"cli", "__init__"},
]
FLOOR = {room: number for number, rooms in enumerate(FLOORS) for room in rooms}


def _sources() -> dict[str, list[Path]]:
    """Each room's source files: ``src/recipes_lib/<room>`` and ``callbacks/``."""
    package = ROOT / "src" / "recipes_lib"
    rooms: dict[str, list[Path]] = {"callbacks": sorted((ROOT / "callbacks").glob("*.py"))}
    for path in sorted(package.iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            rooms[path.name] = sorted(path.rglob("*.py"))
        elif path.suffix == ".py":
            rooms[path.stem] = [path]
    return rooms


def _imported_rooms(path: Path) -> set[str]:
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "recipes_lib":
                rooms.add(parts[1] if len(parts) > 1 else "__init__")
    return rooms


def test_every_room_has_a_floor() -> None:
    missing = sorted(set(_sources()) - set(FLOOR))
    assert not missing, f"rooms without a floor in FLOORS (and docs/contributing.md): {missing}"


def test_no_import_runs_upward_or_sideways() -> None:
    wrong = []
    for room, files in _sources().items():
        for path in files:
            for target in _imported_rooms(path) - {room}:
                if FLOOR.get(target, -1) >= FLOOR.get(room, len(FLOORS)):
                    wrong.append(f"{path.relative_to(ROOT)} ({room}) imports {target}")
    assert not wrong, "imports that run upward or sideways:\n" + "\n".join(sorted(wrong))


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    upward = tmp_path / "m.py"
    upward.write_text("def f():\n    from recipes_lib.train import run\n")
    assert _imported_rooms(upward) == {"train"}
    assert FLOOR["train"] > FLOOR["assembly"]
