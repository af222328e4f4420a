"""The ``strategy`` config group: each strategy declared once, with what it supports.

=================  ==========================================================
``single``         one device; Lightning's own choice of plain strategy
``ddp``            weights replicated, gradients all-reduced (``DDPStrategy``)
``fsdp``           FSDP2 through :class:`~.engines.FSDP2Strategy`; the module shards each
                   block with ``fully_shard`` when it is built
                   (:func:`recipes_lib.parallel.fsdp.shard_model`) over every rank, the
                   ranks that share a row under context parallelism included
``deepspeed_*``    ZeRO stage 2 or 3 through :class:`~.engines.ZeroStrategy`
=================  ==========================================================

A :class:`StrategySpec` says what its strategy shards, what it composes with (CPU
offload, float8 and its all-gather, 4-bit weights), what it needs (a package, CUDA),
how it builds the Lightning strategy and how it shards a built model. The pre-flight
(:mod:`recipes_lib.preflight`) reads those declarations; nothing else compares
strategy names. Adding a strategy is one spec in :data:`STRATEGIES` and one
``conf/strategy/<name>.yaml``.

Multi-GPU runs are started once per process by ``torchrun`` (or SLURM's ``srun``);
Lightning reads the launcher's environment, and ``trainer.devices`` is the number of
processes per node.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import Strategy
from torch import Tensor, nn

from recipes_lib.config.schema import RunConfig, StrategyConfig
from recipes_lib.errors import ConfigError
from recipes_lib.parallel.context import ContextParallelDDP
from recipes_lib.parallel.engines import FSDP2Strategy, ZeroStrategy, strategy_timeout
from recipes_lib.parallel.fsdp import full_state_dict, shard_model
from recipes_lib.parallel.precision import device_type

BuildStrategy = Callable[[StrategyConfig, int | None], "str | Strategy"]


def _single(config: StrategyConfig, micro_batch_size: int | None) -> str:
    return "auto"


def _ddp(config: StrategyConfig, micro_batch_size: int | None) -> Strategy:
    if config.context_parallel > 1:  # groups of ranks that share each row
        return ContextParallelDDP(
            config.context_parallel,
            find_unused_parameters=config.find_unused_parameters,
            gradient_as_bucket_view=True,
            timeout=strategy_timeout(config),
        )
    return DDPStrategy(
        find_unused_parameters=config.find_unused_parameters,
        gradient_as_bucket_view=True,
        timeout=strategy_timeout(config),
    )


def _fsdp(config: StrategyConfig, micro_batch_size: int | None) -> Strategy:
    return FSDP2Strategy(config)


def _zero(stage: int) -> BuildStrategy:
    def build(config: StrategyConfig, micro_batch_size: int | None) -> Strategy:
        strategy = ZeroStrategy(
            stage=stage,
            offload_optimizer=config.cpu_offload,
            offload_parameters=config.cpu_offload and stage == 3,
            logging_batch_size_per_gpu=micro_batch_size or "auto",
            timeout=strategy_timeout(config),
        )
        if config.cpu_offload:
            # the module's own optimizer steps on the CPU copy; DeepSpeed otherwise insists
            # on its compiled CPU Adam (the config is made from the arguments above)
            assert strategy.config is not None
            strategy.config["zero_force_ds_cpu_optimizer"] = False
        return strategy

    return build


def _gather_zero3(model: nn.Module, strategy: Strategy) -> dict[str, Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        if not strategy.is_global_zero:
            return {}
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@dataclass(frozen=True)
class StrategySpec:
    """One strategy of the ``strategy`` group and what it supports.

    Attributes:
        name: ``strategy.name``.
        shards: parameters, gradients and optimizer state are split over ranks, so
            whole-weight operations (the chunked loss reading the head outside the
            forward, checkpoint averaging, EMA) cannot run on one process.
        multi_device: it may run on several devices.
        cpu_offload: ``strategy.cpu_offload`` means something to it.
        float8: ``precision=fp8`` composes with it (torchao's float8 layers).
        float8_all_gather: it all-gathers float8 weights (FSDP2, tensorwise scaling).
        quantized_weights: QLoRA's 4-bit base weights work under it.
        sharded_state: what it divides over the ranks, of ``parameters``, ``gradients``
            and ``optimizer`` (read by the memory estimate of the pre-launch check).
        steps_in_engine: its engine keeps the gradients, their accumulation and the
            optimizer step to itself (DeepSpeed): the training guard cannot judge or
            skip an update, nor a batch ramp vary the accumulation.
        frees_gradients: the gradients are released right after each optimizer step
            (:func:`recipes_lib.training.optimization.free_gradients`), so the next forward
            pass runs without them; not where they outlive the step anyway (DDP keeps
            them as views of its communication buckets, DeepSpeed's engine its own).
        async_checkpoint: it writes checkpoints in the background
            (``strategy.async_checkpoint``): FSDP2's sharded folders through DCP, a
            single device's or DDP's file from a host copy.
        expert_parallel: it can spread a mixture's experts over the ranks
            (``strategy.expert_parallel``).
        context_parallel: it can split each row over groups of ranks
            (``strategy.context_parallel``, :mod:`recipes_lib.parallel.context`).
        fused_head: the head's loss may be fused with it (``kernels.loss_chunk_size``),
            inside the head's forward, where FSDP has gathered the head's weight.
        expert_adapters: LoRA may adapt a mixture's experts (PEFT's per-call weights).
        needs_package: the package it imports, with its install hint.
        needs_cuda: it runs on CUDA GPUs only.
        build: the Lightning strategy (or ``"auto"``) for a ``strategy`` config and
            the micro-batch size.
        shard: shards a built model over the data-parallel mesh (None: the Lightning
            strategy shards, or nothing is sharded).
        gather: the whole state dict onto global rank 0 (None: ``full_state_dict``).
    """

    name: str
    shards: bool
    multi_device: bool
    cpu_offload: bool
    float8: bool
    float8_all_gather: bool
    quantized_weights: bool
    build: BuildStrategy
    sharded_state: tuple[str, ...] = ()
    steps_in_engine: bool = False
    frees_gradients: bool = True
    async_checkpoint: bool = False
    expert_parallel: bool = False
    context_parallel: bool = False
    fused_head: bool = True
    expert_adapters: bool = True
    needs_package: tuple[str, str] | None = None
    needs_cuda: bool = False
    shard: Callable[..., nn.Module] | None = None
    gather: Callable[[nn.Module, Strategy], dict[str, Tensor]] | None = None

    def gather_full_state_dict(self, model: nn.Module, strategy: Strategy) -> dict[str, Tensor]:
        """The whole state dict of ``model`` on global rank 0 (others may get an empty or
        partial dict). A collective under sharded strategies: every rank must call it."""
        if self.gather is not None:
            return self.gather(model, strategy)
        return full_state_dict(model)


_DEEPSPEED = ("deepspeed", "pip install 'recipes-lib[deepspeed]'")
_ZERO: dict[str, Any] = dict(
    shards=True,
    multi_device=True,
    cpu_offload=True,
    # torchao's float8 layers compose with FSDP2, not with DeepSpeed's partitioned
    # parameters and its own bf16 mode; DeepSpeed cannot partition 4-bit weights
    float8=False,
    float8_all_gather=False,
    quantized_weights=False,
    needs_package=_DEEPSPEED,
    needs_cuda=True,
    steps_in_engine=True,
    frees_gradients=False,
    fused_head=False,
    expert_adapters=False,
)
_ALL_STATE = ("parameters", "gradients", "optimizer")
_REPLICATED: dict[str, Any] = dict(
    shards=False,
    cpu_offload=False,
    float8=True,
    float8_all_gather=False,
    quantized_weights=True,
    async_checkpoint=True,  # rank 0's file, from a host copy (checkpoint/io.py)
)
STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec(name="single", multi_device=False, build=_single, **_REPLICATED),
        StrategySpec(
            name="ddp",
            multi_device=True,
            build=_ddp,
            frees_gradients=False,
            context_parallel=True,
            **_REPLICATED,
        ),
        StrategySpec(
            name="fsdp",
            shards=True,
            multi_device=True,
            cpu_offload=True,
            float8=True,
            float8_all_gather=True,  # with tensorwise scaling
            quantized_weights=True,  # 4-bit weights stay whole on every rank
            build=_fsdp,
            shard=shard_model,
            sharded_state=_ALL_STATE,
            async_checkpoint=True,
            expert_parallel=True,
            context_parallel=True,  # sharded over every rank, a row's group included
        ),
        StrategySpec(  # fsdp's sharding over a 2-D mesh; its checkpoints are fsdp's
            name="hsdp",
            shards=True,
            multi_device=True,
            cpu_offload=True,
            float8=True,
            float8_all_gather=True,
            quantized_weights=True,
            build=_fsdp,
            shard=shard_model,
            sharded_state=_ALL_STATE,
            async_checkpoint=True,
            context_parallel=True,  # a row's group inside one copy's shard group
        ),
        StrategySpec(
            name="deepspeed_zero2",
            build=_zero(2),
            sharded_state=("gradients", "optimizer"),
            **_ZERO,
        ),
        StrategySpec(
            name="deepspeed_zero3",
            build=_zero(3),
            gather=_gather_zero3,
            sharded_state=_ALL_STATE,
            **_ZERO,
        ),
    )
}


def get_strategy(name: str) -> StrategySpec:
    """The spec of ``strategy.name``.

    Raises:
        ConfigError: ``name`` is not one of :data:`STRATEGIES`.
    """
    if name not in STRATEGIES:
        raise ConfigError(f"strategy.name={name!r} is not one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def build_strategy(config: StrategyConfig, micro_batch_size: int | None = None) -> str | Strategy:
    """The Lightning strategy (object, or ``"auto"``) of ``strategy.name``.

    ``micro_batch_size`` (sequences per device per step) is what DeepSpeed's config
    records as its micro-batch; without it Lightning reads it off the data loader."""
    return get_strategy(config.name).build(config, micro_batch_size)


def trainer_devices(cfg: RunConfig) -> Any:
    """``trainer.devices`` as the strategy needs it: one device where it has no others."""
    spec = get_strategy(cfg.strategy.name)
    if not spec.multi_device and cfg.trainer.devices in ("auto", -1, "-1"):
        return 1
    return cfg.trainer.devices


def planned_world_size(cfg: RunConfig) -> int:
    """The processes the run will have: a launcher's ``WORLD_SIZE``, else
    ``trainer.devices`` (``auto``: every visible GPU, one process on a CPU) times
    ``trainer.num_nodes``."""
    launched = os.environ.get("WORLD_SIZE", "")
    if launched.isdigit():
        return int(launched)
    devices = trainer_devices(cfg)
    on_cuda = device_type(cfg.trainer.accelerator, torch.cuda.is_available()) == "cuda"
    if isinstance(devices, list | tuple):
        count = len(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    elif str(devices).strip().lstrip("-").isdigit() and int(devices) > 0:
        count = int(devices)
    else:  # auto, -1
        count = torch.cuda.device_count() if on_cuda else 1
    return max(1, count) * cfg.trainer.num_nodes


def hsdp_shard_group_size(cfg: RunConfig) -> int | None:
    """The ranks each copy of the model shards over under ``strategy=hsdp`` (the world
    over ``strategy.replicas``, one copy per node by default); None under any other
    strategy, whose sharding (if any) spans the whole world."""
    if cfg.strategy.name != "hsdp":
        return None
    replicas = cfg.strategy.replicas or cfg.trainer.num_nodes
    return max(1, planned_world_size(cfg) // max(1, replicas))
