"""Helpers shared by the GPU tests: CSV metrics of a run, ``torchrun`` jobs, peak
training memory, the small QLoRA runs and a Gemma-like model on two attention backends."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from run_helpers import metric_series, read_metrics, torchrun
from tiny import family_overrides

__all__ = [
    "GEMMA_LIKE_SEQ",
    "WORKER",
    "PeakTrainingMemory",
    "gemma_like_pair",
    "metric_series",
    "qlora_overrides",
    "read_metrics",
    "torchrun",
]

WORKER = Path(__file__).with_name("multigpu_worker.py")


class PeakTrainingMemory(Callback):
    """The peak CUDA memory allocated from the start of fit to the end of training."""

    def __init__(self) -> None:
        self.peak = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()


def qlora_overrides(recipe: str, source: str, run_dir: Path, cache_dir: Path, *extra: str):
    """A 1B QLoRA recipe (``sft/qlora_1b``, ``dpo/qlora_1b``) shrunk to 4 steps on a
    randomly initialised Qwen2-0.5B shape: the memory and the code path are what count."""
    return [
        f"recipe={recipe}",
        "model=qwen2_0_5b",
        f"run.dir={run_dir}",
        f"data.cache_dir={cache_dir}",
        f"data.sources.{source}.max_documents=200",
        "data.tokenizer.vocab_size=8192",
        "data.seq_len=512",
        "data.batch_size=4",
        "trainer.max_steps=4",
        "trainer.accumulate_grad_batches=1",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "scheduler.warmup=1",
        "run.checkpoint_every_n_steps=4",
        "run.save_top_k=0",  # last.ckpt only: a 0.5B model's checkpoint is several GB
        "callbacks=minimal",
        *extra,
    ]


GEMMA_LIKE_SEQ = 512
# the `small` decoder (6 layers, dim 384, 6:2 heads) as Gemma 3: five local layers of a
# 128-key window, one global layer
GEMMA_LIKE = (
    "model=small",
    *family_overrides("gemma3"),
    "model.query_pre_attn_scalar=64",
    "model.sliding_window=128",
    "model.window_layers=[0,1,2,3,4]",
    "model.local_rope_theta=10000",
    f"model.max_seq_len={GEMMA_LIKE_SEQ}",
)


def gemma_like_pair(attention, *, compiled: bool, varying: bool = False):
    """A Gemma-like model on ``attention`` (a backend's name or an AttentionChoice) and
    the same weights on flex in every layer, both bf16 on CUDA, their blocks compiled
    when ``compiled`` (for batches of varying shape with ``varying``)."""
    from recipes_lib.config import compose_config, to_run_config
    from recipes_lib.kernels.compiled import compile_blocks
    from recipes_lib.models import Transformer

    config = to_run_config(compose_config(list(GEMMA_LIKE))).model
    torch.manual_seed(0)
    flex = Transformer(config, "flex")
    other = Transformer(config, attention)
    other.load_state_dict(flex.state_dict())
    models = []
    for model in (other, flex):
        model = model.cuda().to(torch.bfloat16)
        if compiled:
            compile_blocks(model.layers, varying_shapes=varying)
        models.append(model)
    return models[0], models[1]
