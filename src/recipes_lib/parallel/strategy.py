"""The ``strategy`` config group: one Lightning strategy per name, checked before training.

=================  ==========================================================
``single``         one device; Lightning's own choice of plain strategy
``ddp``            weights replicated, gradients all-reduced (``DDPStrategy``)
``fsdp``           FSDP2 through :class:`FSDP2Strategy`; the module shards each
                   block with ``fully_shard`` in ``configure_model``
                   (:func:`recipes_lib.parallel.fsdp.shard_model`)
``deepspeed_*``    ZeRO stage 2 or 3 through :class:`ZeroStrategy`
=================  ==========================================================

Multi-GPU runs are started once per process by ``torchrun`` (or SLURM's ``srun``);
Lightning reads the launcher's environment, and ``trainer.devices`` is the number of
processes per node.
"""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.strategy import Strategy
from torch import Tensor, nn

from recipes_lib.config.schema import RunConfig, StrategyConfig
from recipes_lib.errors import ConfigError
from recipes_lib.parallel.fsdp import full_state_dict
from recipes_lib.parallel.precision import device_type

STRATEGIES = ("single", "ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3")
SHARDED = ("fsdp", "deepspeed_zero2", "deepspeed_zero3")


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as pure data-parallel FSDP2.

    All processes form one data-parallel mesh dimension (``data_parallel``; tensor
    parallel size 1). Sharded checkpoints are folders written with
    ``torch.distributed.checkpoint``, one shard per rank.

    Args:
        config: the ``strategy`` group (offload and resharding are read by the module
            when it shards itself, see :func:`recipes_lib.parallel.fsdp.shard_model`).
    """

    def __init__(self, config: StrategyConfig):
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            timeout=timedelta(minutes=config.timeout_minutes),
        )
        self.config = config

    def setup_environment(self) -> None:
        # Lightning's "auto" means one data-parallel group per node (for tensor
        # parallelism inside it); here every process is a data-parallel rank.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def model_to_device(self) -> None:
        # With CPU offload, FSDP2 keeps the sharded parameters on the CPU by design.
        if not self.config.cpu_offload:
            super().model_to_device()


class ZeroStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` at ZeRO stage 2 or 3.

    The model is built whole on each rank (``deepspeed.zero.Init`` is not used), so
    ``init_weights`` and ``stage.init_from`` see real tensors; DeepSpeed partitions
    the parameters when it wraps the model.
    """

    def model_sharded_context(self) -> AbstractContextManager[None]:
        return nullcontext()


def build_strategy(config: StrategyConfig, micro_batch_size: int | None = None) -> str | Strategy:
    """The Lightning strategy (object, or ``"auto"``) of ``strategy.name``.

    ``micro_batch_size`` (sequences per device per step) is what DeepSpeed's config
    records as its micro-batch; without it Lightning reads it off the data loader."""
    name = config.name
    timeout = timedelta(minutes=config.timeout_minutes)
    if name == "single":
        return "auto"
    if name == "ddp":
        return DDPStrategy(
            find_unused_parameters=config.find_unused_parameters,
            gradient_as_bucket_view=True,
            timeout=timeout,
        )
    if name == "fsdp":
        return FSDP2Strategy(config)
    if name in ("deepspeed_zero2", "deepspeed_zero3"):
        stage = 2 if name == "deepspeed_zero2" else 3
        strategy = ZeroStrategy(
            stage=stage,
            offload_optimizer=config.cpu_offload,
            offload_parameters=config.cpu_offload and stage == 3,
            logging_batch_size_per_gpu=micro_batch_size or "auto",
            timeout=timeout,
        )
        if config.cpu_offload:
            # the module's own AdamW steps on the CPU copy; DeepSpeed otherwise insists
            # on its compiled CPU Adam
            strategy.config["zero_force_ds_cpu_optimizer"] = False
        return strategy
    raise ConfigError(f"strategy.name={name!r} is not one of: {', '.join(STRATEGIES)}")


def gather_full_state_dict(model: nn.Module, strategy: Strategy) -> dict[str, Tensor]:
    """The whole state dict of ``model`` on global rank 0 (others may get an empty or
    partial dict). A collective under sharded strategies: every rank must call it."""
    if isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if not strategy.is_global_zero:
                return {}
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return full_state_dict(model)


def trainer_devices(cfg: RunConfig) -> Any:
    """``trainer.devices`` as the strategy needs it: ``single`` runs on one device."""
    if cfg.strategy.name == "single" and cfg.trainer.devices in ("auto", -1, "-1"):
        return 1
    return cfg.trainer.devices


def _device_count(devices: Any) -> int | None:
    """How many devices ``trainer.devices`` names, when that is known without hardware."""
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return None


def check_strategy(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` naming the keys of a strategy that cannot run as set."""
    strategy = cfg.strategy
    name = strategy.name
    if name not in STRATEGIES:
        raise ConfigError(f"strategy.name={name!r} is not one of: {', '.join(STRATEGIES)}")
    count = _device_count(cfg.trainer.devices)
    if name == "single" and (count is not None and count > 1 or cfg.trainer.num_nodes > 1):
        raise ConfigError(
            f"strategy=single runs on one device, but trainer.devices={cfg.trainer.devices} "
            f"and trainer.num_nodes={cfg.trainer.num_nodes}; use strategy=ddp or strategy=fsdp"
        )
    if strategy.cpu_offload and name not in SHARDED:
        raise ConfigError(
            f"strategy.cpu_offload=true needs a sharded strategy (fsdp, deepspeed_zero2, "
            f"deepspeed_zero3); strategy={name} keeps everything on the device"
        )
    if name.startswith("deepspeed"):
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                f"strategy={name} needs DeepSpeed, which is not installed: "
                "pip install 'recipes-lib[deepspeed]'"
            )
        if device_type(cfg.trainer.accelerator, torch.cuda.is_available()) == "cpu":
            raise ConfigError(f"strategy={name} needs CUDA GPUs (trainer.accelerator=gpu)")
        if cfg.adapter.kind == "qlora":
            raise ConfigError(
                f"adapter.kind=qlora with strategy={name}: DeepSpeed cannot partition 4-bit "
                "weights; use strategy=single, ddp or fsdp"
            )
    if name in SHARDED:
        if cfg.kernels.loss_chunk_size is not None:
            raise ConfigError(
                f"kernels.loss_chunk_size={cfg.kernels.loss_chunk_size} reads the output weight "
                f"outside the model's forward, which strategy={name} shards; set it to null"
            )
        for key, value in (
            ("stage.average_last_k", cfg.stage.average_last_k),
            ("stage.ema_decay", cfg.stage.ema_decay),
        ):
            if value is not None:
                raise ConfigError(
                    f"{key}={value} averages whole weights on one process; with strategy={name} "
                    "they are sharded: run the averaging stage with strategy=single or ddp"
                )
