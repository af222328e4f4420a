"""Training throughput: tokens per second, model TFLOP/s and model FLOPs utilisation."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from recipes_lib.callbacks.monitors import is_logging_step
from recipes_lib.callbacks.step import OptimizerStepCallback

# Dense (no structured sparsity) tensor-core peaks per device in TFLOP/s, by the
# arithmetic the run computes in. Matched against torch.cuda.get_device_name(), first
# hit wins, so more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h100 nvl", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("h100 pcie", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("h100", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),  # SXM
    ("h200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("gh200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("h800", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("a100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("a800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("l40s", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("l4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("a10g", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    ("v100", {"fp16": 125.0, "fp32": 15.7}),
    ("rtx 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("rtx 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
)


def precision_arithmetic(precision: str | int | None) -> str | None:
    """The arithmetic matmuls use under a Lightning ``precision`` setting.

    ``bf16``/``fp16`` for the mixed and true half precisions; for 32-bit, ``tf32`` when
    PyTorch may use TF32 tensor cores for float32 matmuls, else ``fp32``; None otherwise.
    """
    text = str(precision)
    if "bf16" in text:
        return "bf16"
    if text.startswith("16"):
        return "fp16"
    if text.startswith("32"):
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return "tf32" if tf32 else "fp32"
    return None


def peak_tflops_for(device_name: str, arithmetic: str | None) -> float | None:
    """Dense peak TFLOP/s of one ``device_name`` GPU in ``arithmetic``, or None if unknown."""
    if arithmetic is None:
        return None
    name = device_name.lower()
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            return peaks.get(arithmetic)
    return None


class ThroughputMonitor(OptimizerStepCallback):
    """Logs ``perf/tokens_per_sec``, ``perf/tflops`` and ``perf/mfu`` while training.

    Wall time is measured over windows of ``window`` optimizer steps with
    :func:`time.perf_counter` (CUDA is synchronised only at a window's edges, so the
    measurement does not stall the GPU in between). Each window's figures are logged
    at every logging step until the next window closes::

        tokens_per_sec = tokens trained on by all ranks in the window / window seconds
        tflops         = tokens_per_sec * flops_per_token(seq_len) / 1e12
        mfu            = tflops / (peak_tflops per device * world_size)

    ``flops_per_token(seq_len)`` comes from the LightningModule (training FLOPs, i.e.
    forward and backward, per token at the batch's sequence length); tokens come from
    the module's ``tokens_seen`` counter when it has one, else from the batch's
    ``input_ids`` times the data-parallel replicas (the world size, over the
    context-parallel degree: a group's ranks share their rows). The time spent in
    validation is left out.

    Args:
        window: Optimizer steps per measurement.
        peak_tflops: Dense peak TFLOP/s of one device. None: looked up from the CUDA
            device's name and the trainer's precision (bf16/fp16, TF32 or fp32 peaks);
            on CPU or an unknown GPU the MFU is not logged.
    """

    def __init__(self, window: int = 20, peak_tflops: float | None = None):
        super().__init__()
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self.peak_tflops = peak_tflops
        self._peak: float | None = None
        self._start_time: float | None = None
        self._start_step = 0
        self._start_tokens = 0
        self._tokens = 0  # fallback count when the module keeps none
        self._seq_len: int | None = None
        self._batch_step = 0  # the optimizer step the current batch works toward
        self.latest: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._peak = self.peak_tflops
        if self._peak is None and pl_module.device.type == "cuda":
            name = torch.cuda.get_device_name(pl_module.device)
            self._peak = peak_tflops_for(name, precision_arithmetic(trainer.precision))

    def _synchronize(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _tokens_seen(self, pl_module: L.LightningModule) -> int:
        counted = getattr(pl_module, "tokens_seen", None)
        return int(counted) if counted is not None else self._tokens

    def _restart_window(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._synchronize(pl_module)
        self._start_time = time.perf_counter()
        self._start_step = trainer.global_step
        self._start_tokens = self._tokens_seen(pl_module)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_step = trainer.global_step + 1
        if self._start_time is None:
            self._restart_window(trainer, pl_module)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # a step's micro-batches (a list) when the module runs the step, else one batch
        for micro in batch if isinstance(batch, list) else [batch]:
            input_ids = micro.get("input_ids") if isinstance(micro, dict) else None
            if isinstance(input_ids, torch.Tensor):
                self._seq_len = input_ids.shape[-1]
                # the ranks of a context-parallel group share their rows
                degree = getattr(trainer.strategy, "context_parallel", 1)
                self._tokens += input_ids.numel() * (trainer.world_size // degree)
        # the batch's tokens are counted first: a window that closes now includes them
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not is_logging_step(trainer, self._batch_step):
            return  # logging a float copies it to the device: a sync
        for name, value in self.latest.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def on_optimizer_step_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int
    ) -> None:
        if self._start_time is None or step - self._start_step < self.window:
            return
        self._synchronize(pl_module)
        elapsed = time.perf_counter() - self._start_time
        tokens = self._tokens_seen(pl_module) - self._start_tokens
        self.latest = self._figures(pl_module, tokens / elapsed if elapsed > 0 else 0.0)
        self._restart_window(trainer, pl_module)

    def _figures(self, pl_module: L.LightningModule, tokens_per_sec: float) -> dict[str, float]:
        figures = {"perf/tokens_per_sec": tokens_per_sec}
        flops_per_token = getattr(pl_module, "flops_per_token", None)
        if callable(flops_per_token) and self._seq_len is not None:
            tflops = tokens_per_sec * float(flops_per_token(self._seq_len)) / 1e12
            figures["perf/tflops"] = tflops
            if self._peak:
                world_size = pl_module.trainer.world_size
                figures["perf/mfu"] = tflops / (self._peak * world_size)
        return figures

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_time = None  # the next training batch opens a new window
