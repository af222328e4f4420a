"""Shared fixtures: a clean default dtype and process-group state around every test, and
a session's tiny Hugging Face folder. The builders the tests share sit beside this file
(``tests/`` is on ``sys.path``): ``tiny.py`` (a quiet CPU Trainer, a tiny model config, the
small-vocabulary and quiet overrides), ``hf_folders.py`` (tiny transformers models, their
folders and records) and ``run_helpers.py`` (a run's metrics, ``torchrun`` jobs)."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist, each worker takes its share of the cores, for itself and the
    commands its tests start: two workers of two threads each on two cores would spend
    their time switching."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _reset_torch_state():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` (or ``multigpu``) cleanly where CUDA is missing, and run
    the longest first (the README's demo pipeline, then the files with a ``slow`` test,
    each in their order), so that two workers (``-n 2 --dist worksteal``) do not end with
    one of them still in a long test. A file's tests stay together: pytest ends a
    module's fixtures when the next test is another file's, so a file split in two would
    build its module fixtures (a pipeline run, a pretrained model) twice."""
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: ("demo_pipeline" not in item.name, item.path not in slow_files))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 or more CUDA GPUs"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """A tiny Qwen2 saved by transformers with a tokenizer and chat template of its own
    (see ``tests/hf_folders.py``); read-only: copy it to change it."""
    from hf_folders import make_hf_folder

    return make_hf_folder(tmp_path_factory.mktemp("hf") / "tiny-qwen2")
