"""Next-token prediction as a LightningModule: the base module of every objective.

Pretraining uses it as it is; supervised fine-tuning and preference optimisation
subclass it and override only :meth:`CausalLMModule.compute_loss` (and, when their
batches carry tokens under other keys, :meth:`CausalLMModule.count_tokens`).

Set-up order under a Trainer: ``configure_model`` builds the model (on the strategy's
device, seeded by the run's seed), the strategy wraps it, ``configure_optimizers``
builds AdamW from the wrapped model, a resumed checkpoint restores weights, optimizer,
``tokens_seen`` and RNG states, and ``on_fit_start`` checks that the attention kernel
supports the device, dtype and document masking before the first step.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import Any, get_type_hints

import lightning as L
import numpy as np
import torch
from torch import Tensor

from recipes_lib.adapters import apply_adapter, check_adapter_config
from recipes_lib.checkpoint.hf import is_hf_folder, load_hf_weights_into
from recipes_lib.checkpoint.weights import load_state_into, load_weights, read_checkpoint
from recipes_lib.config.schema import (
    AdapterConfig,
    KernelsConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    SchedulerConfig,
    StrategyConfig,
)
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.kernels import get_attention_backend
from recipes_lib.losses import causal_lm_loss, chunked_cross_entropy
from recipes_lib.models import Transformer
from recipes_lib.optim import build_lr_lambda, build_optimizer, build_scheduler

Batch = Mapping[str, Tensor]


def _as_config(cls: type, value: Any, key: str) -> Any:
    """``value`` as a ``cls`` dataclass; mappings (saved hyperparameters) are converted."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{key} must be a {cls.__name__} or a mapping, got {type(value).__name__}"
        )
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ConfigError(f"{key} has unknown keys {unknown}; {cls.__name__} takes {sorted(names)}")
    kwargs = {}
    for name, item in value.items():
        hint = hints.get(name)
        if isinstance(hint, type) and is_dataclass(hint) and isinstance(item, Mapping):
            item = _as_config(hint, item, f"{key}.{name}")
        kwargs[name] = item
    return cls(**kwargs)


def compute_dtype(precision: str | int | None) -> torch.dtype:
    """The dtype matmuls run in under a Lightning ``precision`` setting."""
    text = str(precision)
    if "bf16" in text:
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    if text.startswith("64"):
        return torch.float64
    return torch.float32


def collect_rng_states(device: torch.device) -> dict[str, Any]:
    """Python, NumPy, torch CPU and (on a CUDA device) CUDA generator states.

    Stored as tensors and plain Python values so a checkpoint loads with
    ``torch.load(weights_only=True)``.
    """
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: Mapping[str, Any], device: torch.device) -> None:
    """Inverse of :func:`collect_rng_states`; a missing entry is left alone."""
    if "python" in states:
        version, internal, gauss_next = states["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in states:
        n = states["numpy"]
        keys = np.asarray(n["keys"].numpy() if isinstance(n["keys"], Tensor) else n["keys"])
        np.random.set_state(
            (n["algorithm"], keys.astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def load_model_weights(
    model: torch.nn.Module, path: str | os.PathLike, label: str | None = None
) -> None:
    """Load weights into ``model`` from ``path``.

    ``path`` is a ``.safetensors`` file, a directory holding ``model.safetensors``, a
    torch file (a Lightning checkpoint of this module, whose ``model.`` prefix is
    stripped, or a plain state dict), or a Hugging Face model folder (``config.json``
    with ``model.safetensors`` or its shards), whose config must match the model's.
    ``label`` names the source in errors (default ``stage.init_from='<path>'``).

    Raises:
        CheckpointError: the path is missing or unreadable, a Hugging Face config
            differs from the model's, or its tensors do not fit the model (the first
            mismatches are listed).
    """
    label = label or f"stage.init_from={str(path)!r}"
    if is_hf_folder(path):
        load_hf_weights_into(model, path, label)  # type: ignore[arg-type]
        return
    try:
        state = load_weights(path)
    except CheckpointError as err:
        raise CheckpointError(f"{label}: {err}") from err
    load_state_into(model, state, label)


def load_optimizer_moments(
    optimizer: torch.optim.Optimizer, path: str | os.PathLike
) -> torch.optim.Optimizer:
    """Load the per-parameter state (AdamW moments and step counts) of a Lightning
    checkpoint into ``optimizer``, keeping ``optimizer``'s own hyperparameters.

    Every group's ``lr``, ``initial_lr``, betas, epsilon and weight decay stay as the
    new run configured them, so a schedule built afterwards starts from the new peak
    learning rate instead of where the earlier run left off.

    Raises:
        CheckpointError: the checkpoint holds no optimizer state, or its groups or
            moment shapes do not match ``optimizer``.
    """
    label = f"stage.init_from={str(path)!r}"
    try:
        checkpoint = read_checkpoint(path, mmap=False)  # the moments outlive the file
    except CheckpointError as err:
        raise CheckpointError(f"{label}: {err}") from err
    saved_states = checkpoint.get("optimizer_states") or []
    if len(saved_states) != 1:
        raise CheckpointError(
            f"{label} holds {len(saved_states)} optimizer states; stage.init_optimizer=true "
            "needs a Lightning checkpoint of a run with one optimizer"
        )
    saved = saved_states[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        raise CheckpointError(
            f"{label}: its optimizer has parameter groups of sizes {saved_sizes}, this run's "
            f"has {sizes} (a different model or optim.decay_embeddings)"
        )
    index_order = [i for g in saved["param_groups"] for i in g["params"]]
    for position, (index, param) in enumerate(zip(index_order, params, strict=True)):
        moment = saved["state"].get(index, {}).get("exp_avg")
        if moment is not None and tuple(moment.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{label}: optimizer state of parameter {position} has shape "
                f"{tuple(moment.shape)}, the parameter {tuple(param.shape)}"
            )
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, settings in zip(optimizer.param_groups, configured, strict=True):
        group.update(settings)
        group["initial_lr"] = settings["lr"]
    return optimizer


class CausalLMModule(L.LightningModule):
    """Trains a :class:`~recipes_lib.models.Transformer` to predict the next token.

    Batches are mappings with ``input_ids`` ``(B, T)``, ``labels`` ``(B, T)`` (the next
    token, ``-100`` where no loss applies) and, for packed rows, ``doc_ids`` ``(B, T)``
    (used only when ``document_mask``).

    Args:
        model: The decoder's shape.
        kernels: Attention backend, per-block compilation and the chunked loss.
        optim: AdamW settings.
        scheduler: Learning-rate schedule.
        total_steps: Optimizer steps of the run (the schedule's length).
        tokens_per_step: Tokens per optimizer step over all ranks and accumulated
            micro-batches (for token-denominated schedules).
        document_mask: Attend only within each document of a packed row.
        init_from: Weights to start from (see :func:`load_model_weights`); a resumed
            checkpoint overrides them.
        init_optimizer: Also start from the optimizer state of ``init_from`` (a Lightning
            checkpoint): AdamW moments carry over, learning rates and the schedule come
            from ``optim`` and ``scheduler`` (see :func:`load_optimizer_moments`).
        adapter: LoRA or QLoRA applied to the built model after ``init_from`` is loaded
            (:func:`recipes_lib.adapters.apply_adapter`); only the adapters train.
        precision: ``fp8`` converts the large Linear layers to float8 training; under
            FSDP the mixed precisions set its mixed-precision policy.
        strategy: with ``fsdp`` (a ``ModelParallelStrategy`` Trainer), each block is
            sharded with ``fully_shard`` (offload and resharding from here).
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
        adapter: AdapterConfig | None = None,
        precision: PrecisionConfig | None = None,
        strategy: StrategyConfig | None = None,
    ):
        super().__init__()
        self.model_config: ModelConfig = _as_config(ModelConfig, model, "model")
        self.kernels_config: KernelsConfig = _as_config(KernelsConfig, kernels, "kernels")
        self.optim_config: OptimConfig = _as_config(OptimConfig, optim, "optim")
        self.scheduler_config: SchedulerConfig = _as_config(SchedulerConfig, scheduler, "scheduler")
        self.adapter_config: AdapterConfig = _as_config(
            AdapterConfig, adapter if adapter is not None else AdapterConfig(), "adapter"
        )
        check_adapter_config(self.adapter_config)
        self.precision_config: PrecisionConfig = _as_config(
            PrecisionConfig, precision if precision is not None else PrecisionConfig(), "precision"
        )
        self.strategy_config: StrategyConfig = _as_config(
            StrategyConfig, strategy if strategy is not None else StrategyConfig(), "strategy"
        )
        self.total_steps = int(total_steps)
        self.tokens_per_step = int(tokens_per_step)
        self.document_mask = document_mask
        self.init_from = init_from
        self.init_optimizer = init_optimizer
        if init_optimizer and init_from is None:
            raise ConfigError("stage.init_optimizer=true needs stage.init_from (a .ckpt)")
        chunk = self.kernels_config.loss_chunk_size
        if chunk is not None and chunk < 1:
            raise ConfigError(f"kernels.loss_chunk_size={chunk} must be positive or null")
        # Fail at construction, not at the first step, on a bad schedule.
        build_lr_lambda(self.scheduler_config, self.total_steps, self.tokens_per_step)
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
                "adapter": asdict(self.adapter_config),
                "precision": asdict(self.precision_config),
                "strategy": asdict(self.strategy_config),
            }
        )
        self.model: Transformer | None = None
        self._loss_fn = causal_lm_loss
        self.tokens_seen = 0  # tokens trained on, all ranks
        self._rng_states_to_restore: Mapping[str, Any] | None = None
        self._val_loss_sum: Tensor | None = None
        self._val_batches: Tensor | None = None

    @classmethod
    def from_run_config(
        cls, cfg: RunConfig, *, total_steps: int, tokens_per_step: int, **extra: Any
    ) -> CausalLMModule:
        """The module of a typed run config; ``extra`` adds a subclass's own arguments."""
        return cls(
            cfg.model,
            cfg.kernels,
            cfg.optim,
            cfg.scheduler,
            total_steps=total_steps,
            tokens_per_step=tokens_per_step,
            document_mask=cfg.data.document_mask,
            init_from=cfg.stage.init_from,
            init_optimizer=cfg.stage.init_optimizer,
            adapter=cfg.adapter,
            precision=cfg.precision,
            strategy=cfg.strategy,
            **extra,
        )

    # ----------------------------------------------------------------- model
    def configure_model(self) -> None:
        """Build the model once; later calls (e.g. a second ``fit``) keep it.

        The model is built on the default device of the surrounding context (a Trainer
        makes that its root device; under FSDP, the root device, or the CPU when
        offloading) and initialised under the run's seed (``PL_GLOBAL_SEED``, set by
        ``lightning.seed_everything``), in a forked RNG so the global streams are left
        as they were; every strategy starts from the same weights. Then, in this order:
        ``init_from`` weights, adapter, float8, activation checkpointing, per-block
        compilation, and FSDP sharding.
        """
        if self.model is not None:
            return
        mesh = self._data_parallel_mesh()
        with torch.device(self._build_device(sharded=mesh is not None)):
            model = self._build_model()
        self._apply_transforms(model, sharded=mesh is not None)
        if mesh is not None:
            from recipes_lib.parallel.fsdp import shard_model

            shard_model(model, mesh, self.strategy_config, self.precision_config)
        self.model = model

    def _build_device(self, *, sharded: bool) -> torch.device:
        """Where a model is built: the context's default device; when it will be sharded,
        the strategy's root device, or the CPU when offloading."""
        if not sharded:
            return torch.get_default_device()
        if self.strategy_config.cpu_offload:
            return torch.device("cpu")
        return self.trainer.strategy.root_device

    def _data_parallel_mesh(self):
        """The data-parallel device mesh under an FSDP2 (``ModelParallelStrategy``)
        Trainer, else None."""
        try:
            mesh = self.device_mesh
        except (AttributeError, RuntimeError):
            return None
        return mesh["data_parallel"] if mesh is not None else None

    def _build_model(self) -> Transformer:
        """The decoder with its initial weights (seeded init, then ``init_from``) and its
        adapter."""
        backend = get_attention_backend(self.kernels_config.attention)
        seed = os.environ.get("PL_GLOBAL_SEED")
        device = torch.get_default_device()
        cuda_devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(int(seed))
            model = Transformer(self.model_config, attention=backend)
        if self.init_from is not None:
            if any(p.is_meta for p in model.parameters()):
                raise CheckpointError(
                    f"stage.init_from={self.init_from!r} cannot load into a model built on the "
                    "meta device (deferred sharded init); use a strategy that builds it on device"
                )
            load_model_weights(model, self.init_from)
        # after the base weights are in place; before compilation, which must see the
        # adapted modules
        return apply_adapter(model, self.adapter_config)

    def _apply_transforms(self, model: Transformer, *, sharded: bool) -> None:
        """float8 Linear layers (``sharded``: ready for FSDP's float8 all-gather),
        activation checkpointing and per-block compilation, in that order (compilation
        must see the final modules)."""
        if self.precision_config.name == "fp8":
            from recipes_lib.parallel.fp8 import convert_to_fp8

            convert_to_fp8(model, self.precision_config, fsdp=sharded)
        if self.kernels_config.activation_checkpointing:
            model.set_activation_checkpointing(True)
        if self.kernels_config.compile:
            for block in model.layers:
                block.compile()  # in place: parameter names stay as they are
            # fuses the fp32 upcast with log-softmax: the fp32 logits are never stored
            self._loss_fn = torch.compile(causal_lm_loss)

    def forward(self, input_ids: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """Next-token logits ``(B, T, V)``."""
        return self._built_model()(input_ids, doc_ids)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (for throughput and MFU).

        With an adapter they are counted on the plain model's shape: the base matmuls
        run at full size whatever their storage (4-bit weights count half their
        elements), and the LoRA factors add little.
        """
        model = self._built_model()
        if self.adapter_config.kind != "none":
            with torch.device("meta"):  # shapes only, no memory
                model = Transformer(self.model_config, attention=model.attention_backend)
        return model.flops_per_token(seq_len)

    def _built_model(self) -> Transformer:
        if self.model is None:
            raise RuntimeError("the model is not built yet; call configure_model() first")
        return self.model

    def on_fit_start(self) -> None:
        precision = self.trainer.precision
        self._built_model().attention_backend.check(
            device=self.device, dtype=compute_dtype(precision), document_mask=self.document_mask
        )
        strategy = type(self.trainer.strategy).__name__
        if self.kernels_config.loss_chunk_size is not None and (
            "FSDP" in strategy or "ModelParallel" in strategy
        ):
            raise ConfigError(
                f"kernels.loss_chunk_size={self.kernels_config.loss_chunk_size} reads the output "
                f"weight outside the model's forward, which {strategy} shards; set it to null"
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
        model = self._built_model()
        input_ids, doc_ids = self.model_inputs(batch)
        labels = batch["labels"]
        chunk = self.kernels_config.loss_chunk_size
        if chunk is None:
            return self._loss_fn(model(input_ids, doc_ids), labels), {}
        hidden = model.forward_hidden(input_ids, doc_ids)  # (B, T, C)
        loss = chunked_cross_entropy(
            hidden.flatten(0, 1), model.output.weight, labels.flatten(), chunk_size=chunk
        )
        return loss, {}

    def count_tokens(self, batch: Batch) -> int:
        """Tokens this rank trains on in ``batch`` (counted into ``tokens_seen``)."""
        return batch["input_ids"].numel()

    def _world_size(self) -> int:
        try:
            return self.trainer.world_size
        except RuntimeError:  # not attached to a Trainer
            return 1

    # ------------------------------------------------------------ train / val
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, metrics = self.compute_loss(batch)
        self.tokens_seen += self.count_tokens(batch) * self._world_size()
        batch_size = batch["input_ids"].size(0)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch_size)
        # float64 keeps the count exact up to 2**53 tokens
        self.log(
            "train/tokens_seen", torch.tensor(self.tokens_seen, dtype=torch.float64), batch_size=1
        )
        for name, value in metrics.items():
            self.log(f"train/{name}", value, batch_size=batch_size)
        return loss

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
        """Clip by global norm; without a gradient scaler, clip directly.

        Lightning's own path refuses optimizers that unscale gradients themselves (the
        fused AdamW used on CUDA), a check meant for fp16 loss scaling; in bf16 and fp32
        there is no scaler and nothing to unscale, so the norm is clipped here.
        """
        if not gradient_clip_val:
            return
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is None and gradient_clip_algorithm in (None, "norm"):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        try:
            target = self.trainer.model
        except RuntimeError:  # not attached to a Trainer
            target = None
        if target is None:
            target = self
        optimizer = build_optimizer(target, self.optim_config)
        if self.init_optimizer and self.init_from is not None:
            # before the scheduler: it reads each group's initial_lr when it is built
            load_optimizer_moments(optimizer, self.init_from)
        scheduler = build_scheduler(
            optimizer, self.scheduler_config, self.total_steps, self.tokens_per_step
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    # ----------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["rng_states"] = collect_rng_states(self.device)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        # Applied at the first training batch after the restore, where the saving run
        # stood when it wrote the checkpoint (after the step's batch end); restoring now
        # would let the loops' set-up draw from the restored streams first.
        self._rng_states_to_restore = checkpoint.get("rng_states")

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        if self._rng_states_to_restore is not None:
            restore_rng_states(self._rng_states_to_restore, self.device)
            self._rng_states_to_restore = None
