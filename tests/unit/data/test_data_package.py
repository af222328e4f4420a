import ast
from pathlib import Path

import recipes_lib.data

DATA_DIR = Path(recipes_lib.data.__file__).parent
PIPELINES = ("text", "chat", "preference", "prompts")
# What each pipeline may import of the others: preference pairs and prompts are rendered
# as chats, and the built-in pairs and task extend the built-in instructions.
MAY_IMPORT = {"text": (), "chat": (), "preference": ("chat",), "prompts": ("chat",)}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_data_never_imports_models_or_stages():
    forbidden = ("recipes_lib.models", "recipes_lib.training", "recipes_lib.objectives")
    for path in DATA_DIR.rglob("*.py"):
        for name in _imports(path):
            assert not name.startswith(forbidden), f"{path.name} imports {name}"


def test_pipelines_build_on_the_shared_modules_not_on_each_other():
    for path in DATA_DIR.rglob("*.py"):
        parts = path.relative_to(DATA_DIR).parts
        home = parts[0] if len(parts) > 1 else None  # None: a shared module (or __init__)
        if path == DATA_DIR / "__init__.py":
            continue  # the public names come from every pipeline
        allowed = (home, *MAY_IMPORT[home]) if home else ()
        for name in _imports(path):
            for pipeline in PIPELINES:
                package = f"recipes_lib.data.{pipeline}"
                if name == package or name.startswith(f"{package}."):
                    assert pipeline in allowed, f"{path.relative_to(DATA_DIR)} imports {name}"


def test_public_api_is_exported():
    for name in ("PretrainDataModule", "prepare", "PreparedData", "ResumableSampler"):
        assert name in recipes_lib.data.__all__
        assert getattr(recipes_lib.data, name) is not None
