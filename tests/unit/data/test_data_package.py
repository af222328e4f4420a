import ast
from pathlib import Path

import recipes_lib.data

DATA_DIR = Path(recipes_lib.data.__file__).parent


def test_data_never_imports_models_or_stages():
    forbidden = ("recipes_lib.models", "recipes_lib.stages")
    for path in DATA_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not name.startswith(forbidden), f"{path.name} imports {name}"


def test_public_api_is_exported():
    for name in ("PretrainDataModule", "prepare", "PreparedData", "ResumableSampler"):
        assert name in recipes_lib.data.__all__
        assert getattr(recipes_lib.data, name) is not None
