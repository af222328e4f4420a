"""Next-token prediction as a LightningModule: the base module of every objective.

Pretraining uses it as it is; every other objective (:mod:`recipes_lib.objectives`)
subclasses it and overrides :meth:`CausalLMModule.compute_loss` (and, when its batches
carry tokens under other keys, :meth:`CausalLMModule.count_tokens`); what objectives
share beyond this module they compose from shared parts, never by subclassing another
objective.

Set-up order under a Trainer: ``configure_model`` builds the model (on the strategy's
device, seeded by the run's seed), the strategy wraps it, ``configure_optimizers``
builds the optimizer from the wrapped model, a resumed checkpoint restores weights, optimizer,
``tokens_seen`` and RNG states, and ``on_fit_start`` checks that the attention kernel
supports the device, dtype and document masking before the first step. Each optimizer
step, accumulation and clipping included, runs in :meth:`CausalLMModule.training_step`.

One concept: the LightningModule every objective shares, with the optimizer step it
owns; the step stays here because Lightning's manual optimization runs in the module's
own hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.types import LRScheduler, OptimizerLRSchedulerConfig
from torch import Tensor

from recipes_lib.checkpoint.rng import collect_rng_states, restore_rng_states
from recipes_lib.config.schema import (
    AdapterConfig,
    GuardConfig,
    KernelsConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    SchedulerConfig,
    StrategyConfig,
)
from recipes_lib.config.store import as_config
from recipes_lib.errors import ConfigError
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.losses import causal_lm_loss
from recipes_lib.models import Transformer
from recipes_lib.models.hf_fallback import model_shapes
from recipes_lib.optim import build_lr_lambda
from recipes_lib.optim.batch_ramp import BatchSchedule
from recipes_lib.parallel.context import holding_shard, sharded_loss, split_rows
from recipes_lib.parallel.precision import compute_dtype
from recipes_lib.parallel.strategy import get_strategy
from recipes_lib.training.build import ModelBuild, build_model
from recipes_lib.training.experts import ExpertLoad
from recipes_lib.training.guard import StepGuard, resolve_policy
from recipes_lib.training.optimization import configure_optimization, free_gradients
from recipes_lib.training.rollback import scale_lr_in_window

Batch = Mapping[str, Tensor]


class CausalLMModule(L.LightningModule):
    """Trains a :class:`~recipes_lib.models.Transformer` to predict the next token.

    Batches are mappings with ``input_ids`` ``(B, T)``, ``labels`` ``(B, T)`` (the next
    token, ``-100`` where no loss applies) and, for packed rows, ``doc_ids`` ``(B, T)``
    (used only when ``document_mask``).

    Args:
        model, kernels, optim, scheduler: the decoder's shape; the attention backend,
            per-block compilation and chunked loss; the optimizer; the learning-rate schedule.
        total_steps: Optimizer steps of the run (the schedule's length).
        tokens_per_step: Tokens per optimizer step over all ranks and accumulated
            micro-batches (for token-denominated schedules).
        document_mask: Attend only within each document of a packed row.
        init_from: Weights to start from (see :func:`load_model_weights`); a resumed
            checkpoint overrides them.
        init_optimizer: Also take the AdamW moments of ``init_from`` (a Lightning
            checkpoint); learning rates and schedule stay this run's.
        upcycle: ``init_from`` is a dense model; each expert starts as its layer's MLP.
        adapter, precision, strategy: how the model is built (:mod:`.build`): LoRA or
            QLoRA (only the adapters train), float8 layers, sharding.
        guard: what a non-finite or spiking update does (:mod:`.guard`).
        lr_window: ``(start, end, factor)``: the learning rate times ``factor`` for those
            steps (after a rollback).
        batch_schedule: micro-batches per step under a batch ramp (token lengths of the
            schedule and the square-root learning-rate rule follow it).
        varying_shapes: the batches vary in shape (pairs, padded rows, rollouts):
            compiled blocks keep a graph per shape kind (the objective's spec says).
        gradient_clip_val: the gradient norm (or value) each optimizer step clips to;
            ``None``: no clipping. Under an engine that steps (DeepSpeed) the Trainer clips.
        gradient_clip_algorithm: ``"norm"`` (the default) or ``"value"``.
    """

    def __init__(
        self,
        model: ModelConfig,
        kernels: KernelsConfig,
        optim: OptimConfig,
        scheduler: SchedulerConfig,
        *,
        total_steps: int,
        tokens_per_step: int,
        document_mask: bool = False,
        init_from: str | None = None,
        init_optimizer: bool = False,
        upcycle: bool = False,
        adapter: AdapterConfig | None = None,
        precision: PrecisionConfig | None = None,
        strategy: StrategyConfig | None = None,
        guard: GuardConfig | None = None,
        lr_window: tuple[int, int, float] | None = None,
        batch_schedule: BatchSchedule | None = None,
        varying_shapes: bool = False,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ):
        super().__init__()
        self.varying_shapes = varying_shapes
        self.model_config: ModelConfig = as_config(ModelConfig, model, "model")
        self.kernels_config: KernelsConfig = as_config(KernelsConfig, kernels, "kernels")
        self.optim_config: OptimConfig = as_config(OptimConfig, optim, "optim")
        self.scheduler_config: SchedulerConfig = as_config(SchedulerConfig, scheduler, "scheduler")
        # a missing (None) or empty one: the defaults
        self.adapter_config = as_config(AdapterConfig, adapter or AdapterConfig(), "adapter")
        self.precision_config = as_config(
            PrecisionConfig, precision or PrecisionConfig(), "precision"
        )
        self.strategy_config = as_config(StrategyConfig, strategy or StrategyConfig(), "strategy")
        self.context_parallel = self.strategy_config.context_parallel  # ranks sharing a row
        guard_config = as_config(GuardConfig, guard or GuardConfig(), "guard")
        self.guard_config = resolve_policy(guard_config, self.strategy_config.name)
        self.guard = StepGuard(self.guard_config)
        self.lr_window: tuple[int, int, float] | None = None
        if lr_window is not None:  # a tuple also when given a list
            start, end, factor = lr_window
            self.lr_window = (start, end, factor)
        self.total_steps = int(total_steps)
        self.tokens_per_step = int(tokens_per_step)
        self.batch_schedule = batch_schedule
        self.document_mask = document_mask
        self.init_from = init_from
        self.init_optimizer = init_optimizer
        self.upcycle = upcycle
        chunk = self.kernels_config.loss_chunk_size
        if chunk is not None and chunk < 1:
            raise ConfigError(f"kernels.loss_chunk_size={chunk} must be positive or null")
        # a bad schedule fails here, not at the first step
        build_lr_lambda(self.scheduler_config, total_steps, tokens_per_step, batch_schedule)
        self.save_hyperparameters(
            {
                "model": asdict(self.model_config),
                "kernels": asdict(self.kernels_config),
                "optim": asdict(self.optim_config),
                "scheduler": asdict(self.scheduler_config),
                "total_steps": self.total_steps,
                "tokens_per_step": self.tokens_per_step,
                "document_mask": document_mask,
                "init_from": init_from,
                "init_optimizer": init_optimizer,
                "upcycle": upcycle,
                "adapter": asdict(self.adapter_config),
                "precision": asdict(self.precision_config),
                "strategy": asdict(self.strategy_config),
                "guard": asdict(self.guard_config),
            }
        )
        self.model: Transformer | None = None
        self._loss_fn = causal_lm_loss
        self.tokens_seen = 0  # tokens trained on, all ranks
        self._rng_states_to_restore: Mapping[str, Any] | None = None
        self._val_loss_sum: Tensor | None = None
        self._val_batches: Tensor | None = None
        self.expert_load = ExpertLoad(self.model_config)  # a mixture of experts' routing
        # The module runs each optimizer step itself (see training_step), unless the
        # strategy's engine steps (DeepSpeed): then Lightning's automatic loop does.
        self.automatic_optimization = get_strategy(self.strategy_config.name).steps_in_engine
        self.gradient_clip: tuple[float | None, str | None] = (
            gradient_clip_val,
            gradient_clip_algorithm,
        )
        self._clipping = False

    @classmethod
    def from_run_config(
        cls, cfg: RunConfig, *, total_steps: int, tokens_per_step: int, **extra: Any
    ) -> CausalLMModule:
        """The module of a typed run config; ``extra``: further arguments (an
        objective's ``settings``, ``varying_shapes``, a rollback's ``lr_window``)."""
        module = cls(
            cfg.model,
            cfg.kernels,
            cfg.optim,
            cfg.scheduler,
            total_steps=total_steps,
            tokens_per_step=tokens_per_step,
            document_mask=cfg.data.document_mask,
            init_from=cfg.stage.init_from,
            init_optimizer=cfg.stage.init_optimizer,
            upcycle=cfg.stage.upcycle,
            adapter=cfg.adapter,
            precision=cfg.precision,
            strategy=cfg.strategy,
            guard=cfg.guard,
            gradient_clip_val=cfg.trainer.gradient_clip_val,
            **extra,
        )
        module.guard.checkpoint_every = cfg.run.checkpoint_every_n_steps
        return module

    # ----------------------------------------------------------------- model
    def configure_model(self) -> None:
        """Build the model once (:func:`~recipes_lib.training.build.build_model`), where
        :meth:`placement` says; later calls (a second ``fit``) keep it."""
        if self.model is not None:
            return
        device, mesh = self.placement()
        self.model = build_model(self.policy_build(), device=device, mesh=mesh)
        if self.kernels_config.compile:
            # fuses the fp32 upcast with log-softmax: the fp32 logits are never stored
            self._loss_fn = torch.compile(causal_lm_loss)

    def policy_build(self) -> ModelBuild:
        """How the trained model is built (see :mod:`recipes_lib.training.build`)."""
        return ModelBuild(
            model=self.model_config,
            kernels=self.kernels_config,
            precision=self.precision_config,
            strategy=self.strategy_config,
            init_from=self.init_from,
            adapter=self.adapter_config,
            upcycle=self.upcycle,
            varying_shapes=self.varying_shapes,
            document_mask=self.document_mask,
        )

    def placement(self) -> tuple[torch.device, Any]:
        """Where a model is built, and the data-parallel mesh under FSDP2 (else None): the
        context's default device; sharded, the root device (the CPU to offload)."""
        try:
            mesh = self.device_mesh
        except (AttributeError, RuntimeError):
            mesh = None
        if mesh is None:
            return torch.get_default_device(), None
        offload = self.strategy_config.cpu_offload
        device = torch.device("cpu") if offload else self.trainer.strategy.root_device
        return device, getattr(self, "sharding_mesh", None) or mesh["data_parallel"]  # hsdp: 2-D

    def forward(self, input_ids: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """Next-token logits ``(B, T, V)``."""
        return self.built_model()(input_ids, doc_ids)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (for throughput and MFU).

        With an adapter they are counted on the plain model's shape: the base matmuls
        run at full size whatever their storage (4-bit weights count half their
        elements), and the LoRA factors add little.
        """
        model = self.built_model()
        if self.adapter_config.kind != "none":
            return model_shapes(self.model_config).flops_per_token(seq_len)  # meta: no memory
        return model.flops_per_token(seq_len)

    def built_model(self) -> Transformer:
        """The trained model, once :meth:`configure_model` has built it."""
        if self.model is None:
            raise RuntimeError("the model is not built yet; call configure_model() first")
        return self.model

    def on_train_start(self) -> None:
        # a rollback's window, or a resumed one's, once the checkpoint is restored
        if self.lr_window is not None and self.trainer.lr_scheduler_configs:
            scale_lr_in_window(self.trainer.lr_scheduler_configs[0].scheduler, *self.lr_window)

    def on_fit_start(self) -> None:
        self.built_model().attention_backend.check(
            device=self.device,
            dtype=compute_dtype(self.trainer.precision),
            document_mask=self.document_mask,
        )

    # ------------------------------------------------------------------ loss
    def model_inputs(self, batch: Batch) -> tuple[Tensor, Tensor | None]:
        """``input_ids`` and, when document masking is on, ``doc_ids`` of ``batch``."""
        if not self.document_mask:
            return batch["input_ids"], None
        if batch.get("doc_ids") is None:
            raise ConfigError("data.document_mask is true but the batch carries no doc_ids")
        return batch["input_ids"], batch["doc_ids"]

    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The scalar loss of ``batch`` and extra metrics to log (as ``train/<name>`` and
        ``val/<name>``). The override point of every objective."""
        model = self.built_model()
        input_ids, doc_ids = self.model_inputs(batch)
        labels, token_mask = batch["labels"], self.expert_load.token_mask(batch)
        chunk = self.kernels_config.loss_chunk_size
        if (split := self.rows_share(input_ids, labels, doc_ids, token_mask)) is not None:
            shard, (ids, local, docs, mask) = split
            with holding_shard(model, shard):  # until the backward has run (training_step)
                logp = model(
                    ids, docs, labels=local, per_token=True, loss_chunk_size=chunk, token_mask=mask
                )
            return sharded_loss(-logp.sum(), (local != -100).sum(), shard), {}
        # a model whose loss holds more than its logits' cross-entropy computes it itself
        if chunk is None and not model.loss_beyond_logits:
            return self._loss_fn(model(input_ids, doc_ids, token_mask=token_mask), labels), {}
        # the head fused with the loss, inside the model's forward (a sharded head too)
        loss = model(
            input_ids, doc_ids, labels=labels, loss_chunk_size=chunk, token_mask=token_mask
        )
        return loss, {}

    def count_tokens(self, batch: Batch) -> int:
        """Tokens this rank trains on in ``batch`` (counted into ``tokens_seen``)."""
        return batch["input_ids"].numel()

    def rows_share(
        self,
        input_ids: Tensor,
        labels: Tensor,
        doc_ids: Tensor | None = None,
        token_mask: Tensor | None = None,
    ) -> tuple[ContextShard, tuple[Tensor, Tensor, Tensor | None, Tensor | None]] | None:
        """This rank's share of a batch's rows and its shard under
        ``strategy.context_parallel`` (:func:`~recipes_lib.parallel.context.split_rows`);
        None: whole rows (no context parallelism, or no trainer attached)."""
        trainer = self._attached()
        if trainer is None:
            return None
        return split_rows(trainer.strategy, input_ids, labels, doc_ids, token_mask)

    def _attached(self) -> L.Trainer | None:
        try:
            return self.trainer
        except RuntimeError:  # not attached to a Trainer
            return None

    # ------------------------------------------------------------ train / val
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """One optimizer step on ``batch``, the step's list of micro-batches (a single
        batch: a step of one): each micro-batch's loss divided by their count, as
        Lightning's accumulation divides it, gradients synchronised on the last only,
        then clipping and the guard's verdict (:meth:`on_before_optimizer_step`), the
        optimizer step, freed gradients and one scheduler step. Under an engine that
        steps (DeepSpeed) ``batch`` is one micro-batch and Lightning's loop steps."""
        if self.automatic_optimization:
            return self.micro_batch_loss(batch, batch_idx % self.trainer.accumulate_grad_batches)
        micro_batches = batch if isinstance(batch, list) else [batch]
        opt = cast(LightningOptimizer, self.optimizers())  # configure_optimizers builds one
        # data-parallel strategies offer it: no gradient all-reduce before the last backward
        block_sync = getattr(self.trainer.strategy, "block_backward_sync", None)
        count = len(micro_batches)
        opt.zero_grad()
        loss = None
        for index, micro in enumerate(micro_batches):
            last = index == count - 1
            with contextlib.nullcontext() if last or block_sync is None else block_sync():
                loss = self.micro_batch_loss(micro, index)
                self.manual_backward(loss / count)
            if self.context_parallel > 1:  # whole rows again (see compute_loss)
                self.built_model().set_context_shard(None)
        self._clipping = True
        try:
            opt.step()
        finally:
            self._clipping = False
        free_gradients(opt, self.strategy_config.name)
        scheduler = self.lr_schedulers()
        if scheduler is not None:  # one, stepped per optimizer step (LambdaLR)
            cast(LRScheduler, scheduler).step()
        return None if loss is None else loss.detach()

    def micro_batch_loss(self, batch: Batch, into_step: int) -> Tensor:
        """The loss of one micro-batch, ``into_step`` within its optimizer step, logged."""
        loss, metrics = self.compute_loss(batch)
        aux, moe_metrics = self.expert_load.after_forward(self.built_model())  # MoE losses
        metrics = {**metrics, **moe_metrics}
        loss = self.guard.inject(loss, self.trainer, batch["input_ids"].size(0), into_step)
        self.guard.add_loss(loss)
        # the ranks of a context-parallel group share their rows
        replicas = getattr(self._attached(), "world_size", 1) // self.context_parallel
        self.tokens_seen += self.count_tokens(batch) * replicas
        batch_size = batch["input_ids"].size(0)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch_size)
        # float64 keeps the count exact up to 2**53 tokens
        self.log(
            "train/tokens_seen", torch.tensor(self.tokens_seen, dtype=torch.float64), batch_size=1
        )
        for name, value in metrics.items():
            self.log(f"train/{name}", value, batch_size=batch_size)
        if self.guard.skipped is not None:
            self.log("guard/skipped_updates", self.guard.skipped.float(), batch_size=1)
        return loss if aux is None else loss + aux

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = getattr(self._attached(), "strategy", None)
        for name, value in self.expert_load.step(self.built_model(), strategy).items():
            self.log(name, value, batch_size=1)
        if self._clipping:  # where Lightning clips under automatic optimization
            self.configure_gradient_clipping(optimizer, *self.gradient_clip)

    def on_validation_epoch_start(self) -> None:
        self._val_loss_sum = torch.zeros((), device=self.device)
        self._val_batches = torch.zeros((), device=self.device)

    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, metrics = self.compute_loss(batch)
        batch_size = batch["input_ids"].size(0)
        self.log(
            "val/loss", loss, on_epoch=True, sync_dist=True, prog_bar=True, batch_size=batch_size
        )
        for name, value in metrics.items():
            self.log(f"val/{name}", value, on_epoch=True, sync_dist=True, batch_size=batch_size)
        if self._val_loss_sum is not None and self._val_batches is not None:
            self._val_loss_sum += loss.detach().float() * batch_size
            self._val_batches += batch_size
        return loss

    def on_validation_epoch_end(self) -> None:
        if self._val_loss_sum is None or self._val_batches is None:
            return
        totals = torch.stack([self._val_loss_sum, self._val_batches])
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        if totals[1] > 0:  # same batch-size-weighted mean as val/loss
            # already summed over ranks: every rank logs the same value
            self.log("val/ppl", torch.exp(totals[0] / totals[1]), on_epoch=True, sync_dist=True)
        self._val_loss_sum = self._val_batches = None

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by global norm (directly, without a gradient scaler: Lightning's path
        refuses the fused AdamW, a check meant for fp16 loss scaling), then let the run's
        guard judge the update with the norm that clipping computed."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = None
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        clip_val, clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        if clip_val and scaler is None and clip_algorithm in (None, "norm"):
            norm = torch.nn.utils.clip_grad_norm_(params, clip_val)
        elif clip_val:
            self.clip_gradients(optimizer, clip_val, clip_algorithm)
        if self.guard.enabled:
            trainer = self.trainer
            self.guard.after_backward(
                optimizer, params, norm, trainer.strategy, trainer.global_step
            )

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        free_gradients(optimizer, self.strategy_config.name)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        target = getattr(self._attached(), "model", None)  # the strategy's wrapped model
        return configure_optimization(
            self if target is None else target,
            self.optim_config,
            self.scheduler_config,
            total_steps=self.total_steps,
            tokens_per_step=self.tokens_per_step,
            batch_schedule=self.batch_schedule,
            init_from=self.init_from,
            init_optimizer=self.init_optimizer,
        )

    # ----------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["guard"] = {**self.guard.state_dict(), "lr_window": self.lr_window}
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["rng_states"] = collect_rng_states(self.device)
        schedulers = self.trainer.lr_scheduler_configs
        if schedulers:  # where the schedule stands: what a next stage may start at
            checkpoint["last_lr"] = float(schedulers[0].scheduler.get_last_lr()[0])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if not self.automatic_optimization:
            self._count_steps_as_batches(checkpoint)
        guard = checkpoint.get("guard") or {}
        self.guard.load_state_dict(guard)
        if guard.get("lr_window") is not None and self.lr_window is None:
            self.lr_window = tuple(guard["lr_window"])
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        # Applied at the first training batch after the restore, where the saving run
        # stood when it wrote the checkpoint (after the step's batch end); restoring now
        # would let the loops' set-up draw from the restored streams first.
        self._rng_states_to_restore = checkpoint.get("rng_states")

    def _count_steps_as_batches(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint whose loops counted micro-batches as batches and optimizer steps
        under Lightning's automatic optimization, counted as this module's loops count:
        one batch per optimizer step, the steps as manual optimization's."""
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        auto = loop.get("epoch_loop.automatic_optimization.optim_progress")
        manual = loop.get("epoch_loop.manual_optimization.optim_step_progress")
        if auto is None or manual is None or manual["total"]["completed"] > 0:
            return
        steps = auto["optimizer"]["step"]
        for scope in ("total", "current"):
            manual[scope] = {k: steps[scope][k] for k in ("ready", "completed")}
        schedule = self.batch_schedule
        if schedule is None:
            return
        batches = loop["epoch_loop.batch_progress"]
        for scope in ("total", "current"):
            batches[scope] = {k: schedule.step_of(v) for k, v in batches[scope].items()}

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> int | None:
        if self._rng_states_to_restore is not None:
            restore_rng_states(self._rng_states_to_restore, self.device)
            self._rng_states_to_restore = None
        # on the last step's flags, once the host has them; -1 ends the fit for a rollback
        return -1 if self.guard.act(self.trainer) else None

    def on_train_end(self) -> None:
        self.guard.act(self.trainer, wait=True)
        if self.trainer.global_step >= self.trainer.max_steps:
            release_training_state(self.trainer)  # no step follows


def release_training_state(trainer: L.Trainer) -> None:
    """Drop the optimizer state at a finished fit's end: its saves are all written (or
    staged to host memory) and no step follows, while Lightning's teardown would copy
    the state to the CPU only to drop it (13 s of a 1B run's end on an H100)."""
    for optimizer in trainer.optimizers:
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.state.clear()
