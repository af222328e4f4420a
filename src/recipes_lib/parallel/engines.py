"""The Lightning strategies that the ``strategy`` specs build where Lightning's own do
not fit as they are: :class:`FSDP2Strategy` (pure data-parallel FSDP2, HSDP's 2-D mesh,
verified sharded checkpoints written in the background) and :class:`ZeroStrategy`
(DeepSpeed ZeRO over a model built whole). What each strategy supports is declared in
:mod:`recipes_lib.parallel.strategy`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recipes_lib.checkpoint.io import VerifiedCheckpointIO
from recipes_lib.checkpoint.resume import check_checkpoint
from recipes_lib.checkpoint.sharded_save import ShardedSaver
from recipes_lib.config.schema import StrategyConfig
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.parallel.context import new_context_group

log = logging.getLogger(__name__)


def strategy_timeout(config: StrategyConfig) -> timedelta:
    """How long a collective may wait (``strategy.timeout_minutes``)."""
    return timedelta(minutes=config.timeout_minutes)


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
    parallel size 1). With ``strategy.context_parallel=N`` the parameters are still
    sharded over every rank, while groups of ``N`` consecutive ranks share each row
    (``context_group``, :mod:`recipes_lib.parallel.context`): the split attention
    gathers keys and values within the group, the data module gives the group one
    replica's rows, and the reduce-scatter's average over the world, of losses scaled
    by ``N``, sums a group's partial gradients and averages over the replicas.

    Sharded checkpoints are folders written with ``torch.distributed.checkpoint``, one
    shard per rank, by a :class:`~recipes_lib.checkpoint.sharded_save.ShardedSaver`:
    under a hidden name, renamed once every rank is done, with every file's SHA-256
    inside; in the background with ``strategy.async_checkpoint``. A folder is verified
    before it loads.

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
        self.context_parallel = config.context_parallel  # ranks sharing each row
        self.context_group: ProcessGroup | None = None
        self.checkpoint_writer = ShardedSaver(strategy_timeout(config), on_landed=self._retain)

    def _retain(self, path: Path) -> None:
        if isinstance(self.checkpoint_io, VerifiedCheckpointIO):  # the run's retention
            self.checkpoint_io.retain(path)

    def setup_environment(self) -> None:
        # Lightning's "auto" means one data-parallel group per node (for tensor
        # parallelism inside it); here every process is a data-parallel rank.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        if self.context_parallel > 1:  # the processes are connected now
            self.context_group = new_context_group(self.context_parallel)
        if self.config.name == "hsdp":  # the mesh the model shards over: 2-D
            assert self.lightning_module is not None  # connected before the environment
            # torch types a module's attributes as tensors or modules: a mesh is neither
            self.lightning_module.sharding_mesh = hsdp_mesh(  # type: ignore[assignment]
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
        assert self.model is not None  # a checkpoint is saved from a connected model
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if not self.config.async_checkpoint:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        options = StateDictOptions(cpu_offload=False)
        assert self.model is not None  # a checkpoint is saved from a connected model
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
        assert self.lightning_module is not None  # a checkpoint is saved from a connected model
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

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        yield

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        # DeepSpeed writes its own folders (no checksums); the run's retention still applies
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.is_global_zero and isinstance(self.checkpoint_io, VerifiedCheckpointIO):
            self.checkpoint_io.retain(Path(filepath))
