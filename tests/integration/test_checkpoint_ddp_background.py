"""Under DDP (two gloo processes) rank 0 writes the step checkpoints in the background
(``strategy.async_checkpoint``), and a run resumed from one of them reaches the
uninterrupted run's weights and optimizer state bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from integration_helpers import checkpoint_tensors, tiny_overrides
from run_helpers import torchrun

from recipes_lib.checkpoint.integrity import forget_verified, verify_checkpoint
from recipes_lib.checkpoint.weights import list_step_checkpoints, load_weights

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]

DDP_BACKGROUND = (
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "run.checkpoint_every_n_steps=3",
    "scheduler.warmup=2",
    "strategy=ddp",
    "strategy.async_checkpoint=true",
    "data.batch_size=2",
    "trainer.devices=2",
)

# the runs (their overrides separated by "+"), one after another in one process group,
# each process saying how its checkpoints are written and which thread wrote each file
# (the plugin's background thread, or the training loop's); a line of rank 0 starts each run
RUN_STARTS = "=== run"
TRAIN = """
import os, sys, threading
import recipes_lib.checkpoint.io as io
from lightning.pytorch.callbacks import Callback
from recipes_lib.config import compose_config
from recipes_lib.train import run

write = io.save_torch_checkpoint

def reporting_write(checkpoint, path):
    thread = threading.current_thread().name
    print(f"wrote {os.path.basename(path)} on {thread}", flush=True)
    return write(checkpoint, path)

class Plugin(Callback):
    def on_train_start(self, trainer, pl_module):
        plugin = trainer.strategy.checkpoint_io
        print(f"rank {trainer.global_rank}: {type(plugin).__name__} "
              f"asynchronous={plugin.asynchronous}", flush=True)

io.save_torch_checkpoint = reporting_write
runs, current = [], []
for arg in sys.argv[1:]:
    if arg == "+":
        runs.append(current)
        current = []
    else:
        current.append(arg)
for number, overrides in enumerate([*runs, current]):
    if os.environ["RANK"] == "0":  # the other rank prints only once the run has begun
        print(f"RUN_STARTS {number}", flush=True)
    run(compose_config(overrides), callbacks=[Plugin()])
""".replace("RUN_STARTS", RUN_STARTS)


def _overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    items = tiny_overrides(run_dir.parent, cache, *DDP_BACKGROUND, *extra)
    return [o if not o.startswith("run.dir=") else f"run.dir={run_dir}" for o in items]


def _ddp(script: Path, *runs: list[str]) -> list[str]:
    """``runs`` one after another in one two-process job; what each printed."""
    args = [arg for overrides in runs for arg in ("+", *overrides)][1:]
    stdout = torchrun(2, str(script), *args, omp_threads=1).stdout
    return [part.split("\n", 1)[1] for part in stdout.split(RUN_STARTS)[1:]]


def test_a_ddp_run_saved_in_the_background_resumes_to_the_uninterrupted_weights(
    tmp_path, shared_cache
):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    ckpts = first / "checkpoints"
    out, _ = _ddp(  # the run, then the same run resumed from its step-3 checkpoint
        script,
        _overrides(first, shared_cache),
        _overrides(resumed, shared_cache, f"run.ckpt_path={ckpts / 'step000003.ckpt'}"),
    )
    for rank in (0, 1):
        assert f"rank {rank}: VerifiedCheckpointIO asynchronous=True" in out
    # rank 0 alone writes: step 3 in the background, the final step before fit returns
    assert out.count("wrote step000003.ckpt") == 1
    assert "wrote step000003.ckpt on checkpoint_0" in out
    assert "wrote step000006.ckpt on MainThread" in out
    assert [s for s, _ in list_step_checkpoints(ckpts)] == [3, 6]
    forget_verified()
    for step in (3, 6):
        assert verify_checkpoint(ckpts / f"step{step:06d}.ckpt")
    assert not list(ckpts.glob(".*"))  # no temporary file left behind

    expected, found = (
        load_weights(first / "model.safetensors"),
        load_weights(resumed / "model.safetensors"),
    )
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name
    # the final checkpoint too: the same weights and optimizer state, bit for bit
    a = checkpoint_tensors(ckpts / "step000006.ckpt")
    b = checkpoint_tensors(resumed / "checkpoints" / "step000006.ckpt")
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
