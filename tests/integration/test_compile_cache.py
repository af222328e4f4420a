"""A run's compiled kernels outlive it: the second run of a recipe on a machine reads
them from ``kernels.compile_cache`` instead of compiling them again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes_lib.kernels.compiled import CACHE_VARIABLES, keep_compile_caches

RUN = """
import json, sys
from recipes_lib.config import compose_config
from recipes_lib.train import run
result = run(compose_config(sys.argv[1:]))
print("RESULT " + json.dumps(result.compiled))
"""


def test_cache_folders_go_under_the_key(monkeypatch, tmp_path):
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    chosen = keep_compile_caches(str(tmp_path / "compile"))
    assert chosen == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "compile" / "triton"),
    }
    assert all(os.environ[name] == folder for name, folder in chosen.items())


def test_a_users_own_cache_folders_win(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    chosen = keep_compile_caches(str(tmp_path / "compile"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert list(chosen) == ["TRITON_CACHE_DIR"]
    assert keep_compile_caches(None) == {}


def test_a_later_run_in_the_process_moves_the_folders_an_earlier_one_set(monkeypatch, tmp_path):
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    keep_compile_caches(str(tmp_path / "first"))
    chosen = keep_compile_caches(str(tmp_path / "second"))  # a pipeline's next stage
    assert chosen == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "second" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "second" / "triton"),
    }
    assert all(os.environ[name] == folder for name, folder in chosen.items())


def _compiled_run(tmp_path: Path, cache: Path, name: str) -> dict:
    overrides = [
        "model=tiny",
        "trainer=cpu",
        "kernels.compile=true",
        f"kernels.compile_cache={cache}",
        f"run.dir={tmp_path / name}",
        f"data.cache_dir={tmp_path / 'data'}",
        "data.sources.stdlib.max_documents=120",  # a slice of the corpus is enough
        "trainer.max_steps=2",
        "trainer.limit_val_batches=0",  # the training graphs are enough to cache
        "scheduler.warmup=1",
        "data.seq_len=64",
        "data.batch_size=2",
        "model.vocab_size=512",
        "data.tokenizer.vocab_size=512",
        "run.checkpoint_every_n_steps=0",
        "trainer.enable_progress_bar=false",
    ]
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    done = subprocess.run(
        [sys.executable, "-c", RUN, *overrides],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_a_second_run_reads_the_first_runs_kernels(tmp_path):
    """Fresh processes (dynamo's in-memory caches die with each), one cache folder: the
    first run compiles into it, the second takes its graphs from it."""
    cache = tmp_path / "compile"
    first = _compiled_run(tmp_path, cache, "first")
    assert first["graphs"] > 0 and first["cache_hits"] == 0
    assert any((cache / "inductor").iterdir())
    second = _compiled_run(tmp_path, cache, "second")
    assert second["graphs"] == first["graphs"]
    assert second["cache_hits"] > 0
