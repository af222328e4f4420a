"""The ``strategy`` config group: each strategy declared once, with what it supports.

=================  ==========================================================
``single``         one device; Lightning's own choice of plain strategy
``ddp``            weights replicated, gradients all-reduced (``DDPStrategy``)
``fsdp``           FSDP2 through :class:`FSDP2Strategy`; the module shards each
                   block with ``fully_shard`` when it is built
                   (:func:`recipes_lib.parallel.fsdp.shard_model`)
``deepspeed_*``    ZeRO stage 2 or 3 through :class:`ZeroStrategy`
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

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.strategy import Strategy
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recipes_lib.checkpoint.io import VerifiedCheckpointIO
from recipes_lib.checkpoint.resume import check_checkpoint
from recipes_lib.checkpoint.sharded_save import ShardedSaver
from recipes_lib.config.schema import RunConfig, StrategyConfig
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.parallel.fsdp import full_state_dict, shard_model

log = logging.getLogger(__name__)

BuildStrategy = Callable[[StrategyConfig, int | None], "str | Strategy"]


def hsdp_mesh(replicas: int, world_size: int, device: torch.device) -> DeviceMesh:
    """FSDP2's 2-D mesh for hybrid sharding: ``replicas`` copies of the model (the
    ``replicate`` dimension, gradients all-reduced across), each sharded over
    ``world_size / replicas`` consecutive ranks (``shard``: one node's GPUs).

    Raises:
        ConfigError: ``replicas`` does not divide the world size.
    """
    if replicas < 1 or world_size % replicas:
        raise ConfigError(
            f"strategy.replicas={replicas} does not divide the {world_size} ranks of strategy=hsdp"
        )
    shape = (replicas, world_size // replicas)
    log.info("hsdp: %d copies of the model, each sharded over %d ranks", *shape)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as pure data-parallel FSDP2.

    All processes form one data-parallel mesh dimension (``data_parallel``; tensor
    parallel size 1). Sharded checkpoints are folders written with
    ``torch.distributed.checkpoint``, one shard per rank, by a
    :class:`~recipes_lib.checkpoint.sharded_save.ShardedSaver`: under a hidden name,
    renamed once every rank is done, with every file's SHA-256 inside; in the
    background with ``strategy.async_checkpoint``. A folder is verified before it loads.

    Args:
        config: the ``strategy`` group (offload and resharding are read when the model
            is sharded, see :func:`recipes_lib.parallel.fsdp.shard_model`).
    """

    def __init__(self, config: StrategyConfig):
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            timeout=timedelta(minutes=config.timeout_minutes),
        )
        self.config = config
        self.checkpoint_writer = ShardedSaver(_timeout(config), on_landed=self._retain)

    def _retain(self, path: Path) -> None:
        if isinstance(self.checkpoint_io, VerifiedCheckpointIO):  # the run's retention
            self.checkpoint_io.retain(path)

    def setup_environment(self) -> None:
        # Lightning's "auto" means one data-parallel group per node (for tensor
        # parallelism inside it); here every process is a data-parallel rank.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        if self.config.name == "hsdp":  # the mesh the model shards over: 2-D
            self.lightning_module.sharding_mesh = hsdp_mesh(
                self.config.replicas or self.num_nodes, self.world_size, self.root_device
            )

    def model_to_device(self) -> None:
        # With CPU offload, FSDP2 keeps the sharded parameters on the CPU by design.
        if not self.config.cpu_offload:
            super().model_to_device()

    # Asynchronous saves take the state where it lives: DCP's staging makes the one copy
    # to host memory (Lightning's own would offload to the CPU first, a second copy).
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.config.async_checkpoint:
            return super().lightning_module_state_dict()
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if not self.config.async_checkpoint:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        options = StateDictOptions(cpu_offload=False)
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(str(filepath)))  # every rank writes to rank 0's path
        state = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{index}"] = optimizer_state
        # The run's last save lands before fit() returns, so what reads it next (the
        # pipeline's final checkpoint, the export, the next stage) finds it in place.
        max_steps = self.lightning_module.trainer.max_steps
        last = max_steps > 0 and checkpoint.get("global_step", 0) >= max_steps
        background = self.config.async_checkpoint and not last
        self.checkpoint_writer.save(state, checkpoint, path, asynchronous=background)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        self.checkpoint_writer.wait()
        path = Path(self.broadcast(str(checkpoint_path)))
        check_checkpoint(path)  # a folder that differs from its checksums is refused
        return super().load_checkpoint(path, weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoint_writer.wait()
        super().remove_checkpoint(filepath)

    def on_train_end(self) -> None:
        self.checkpoint_writer.wait()  # a background save that failed fails the run
        super().on_train_end()

    def teardown(self) -> None:
        try:
            self.checkpoint_writer.close()
        except CheckpointError as err:  # fit is over (or failed): report, and tear down
            log.error("%s", err)
        super().teardown()


class ZeroStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` at ZeRO stage 2 or 3.

    The model is built whole on each rank (``deepspeed.zero.Init`` is not used), so
    ``init_weights`` and ``stage.init_from`` see real tensors; DeepSpeed partitions
    the parameters when it wraps the model.
    """

    def model_sharded_context(self) -> AbstractContextManager[None]:
        return nullcontext()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        # DeepSpeed writes its own folders (no checksums); the run's retention still applies
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.is_global_zero and isinstance(self.checkpoint_io, VerifiedCheckpointIO):
            self.checkpoint_io.retain(Path(filepath))


def _timeout(config: StrategyConfig) -> timedelta:
    return timedelta(minutes=config.timeout_minutes)


def _single(config: StrategyConfig, micro_batch_size: int | None) -> str:
    return "auto"


def _ddp(config: StrategyConfig, micro_batch_size: int | None) -> Strategy:
    return DDPStrategy(
        find_unused_parameters=config.find_unused_parameters,
        gradient_as_bucket_view=True,
        timeout=_timeout(config),
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
            timeout=_timeout(config),
        )
        if config.cpu_offload:
            # the module's own AdamW steps on the CPU copy; DeepSpeed otherwise insists
            # on its compiled CPU Adam
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
            (:func:`recipes_lib.stages.optimization.free_gradients`), so the next forward
            pass runs without them; not where they outlive the step anyway (DDP keeps
            them as views of its communication buckets, DeepSpeed's engine its own).
        async_checkpoint: it writes checkpoints in the background
            (``strategy.async_checkpoint``; FSDP2's sharded folders, through DCP).
        expert_parallel: it can spread a mixture's experts over the ranks
            (``strategy.expert_parallel``).
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
_ZERO = dict(
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
_REPLICATED = dict(
    shards=False, cpu_offload=False, float8=True, float8_all_gather=False, quantized_weights=True
)
STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec(name="single", multi_device=False, build=_single, **_REPLICATED),
        StrategySpec(
            name="ddp", multi_device=True, build=_ddp, frees_gradients=False, **_REPLICATED
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
