"""The pre-flight's checks of what a stage starts from, writes and reads: the weights
``stage.init_from`` holds, the stage's inputs and outputs, the data against the model
and the attention kernel, the adapter, the guard and the batch ramp."""

from __future__ import annotations

from pathlib import Path

import torch

from recipes_lib.adapters import check_adapter_config
from recipes_lib.adapters.frozen_base import check_base_dtype
from recipes_lib.adapters.lora import EXPERTS_TARGET, check_expert_target, native_targets
from recipes_lib.checkpoint.source import init_model_mismatches, read_init_source
from recipes_lib.checkpoint.upcycle import upcycle_mismatches
from recipes_lib.config.schema import KernelsConfig, RunConfig
from recipes_lib.errors import ConfigError
from recipes_lib.kernels import AttentionBackend, AttentionChoice
from recipes_lib.models.hf_fallback import ATTENTION_IMPLEMENTATIONS, is_fallback
from recipes_lib.models.moe import check_expert_path
from recipes_lib.models.windows import attention_choice
from recipes_lib.objectives import objective_of
from recipes_lib.optim.batch_ramp import check_batch_ramp as check_ramp_config
from recipes_lib.parallel.context import check_context_parallel
from recipes_lib.parallel.strategy import (
    STRATEGIES,
    get_strategy,
    hsdp_shard_group_size,
    planned_world_size,
)
from recipes_lib.training.guard import check_guard_config


def check_init_source(cfg: RunConfig) -> None:
    """Read what ``stage.init_from`` holds and refuse a model that does not fit it, with
    every difference named at once."""
    if cfg.stage.init_from is None:
        return
    source = read_init_source(cfg.stage.init_from)
    if cfg.stage.upcycle:
        differences = upcycle_mismatches(cfg.model, source.model)
        if differences:
            raise ConfigError(
                f"stage.upcycle=true from stage.init_from={cfg.stage.init_from!r}: "
                + "; ".join(differences)
            )
        return
    differences = init_model_mismatches(cfg.model, source)
    if differences:
        raise ConfigError(
            f"stage.init_from={cfg.stage.init_from!r}: the configured model does not fit it "
            f"({len(differences)} difference(s)): {'; '.join(differences)}; set those model "
            "keys to its values, or take its whole shape with model=from_init"
        )


def check_stage_io(cfg: RunConfig) -> None:
    """What a stage starts from and what it writes as its output weights."""
    stage = cfg.stage
    if stage.average_last_k is not None and stage.ema_decay is not None:
        raise ConfigError(
            f"stage.average_last_k={stage.average_last_k} and stage.ema_decay={stage.ema_decay} "
            "both choose the stage's output weights; set one of them"
        )
    if stage.upcycle and (stage.init_from is None or stage.init_optimizer):
        raise ConfigError(
            "stage.upcycle=true starts a mixture of experts from a dense model's weights: "
            "it needs stage.init_from and no stage.init_optimizer (the moments do not fit)"
        )
    if stage.init_optimizer:
        source = stage.init_from
        if source is None:
            raise ConfigError(
                "stage.init_optimizer=true needs stage.init_from, a Lightning .ckpt whose "
                "optimizer state starts this stage"
            )
        if Path(source).suffix == ".safetensors" or Path(source).expanduser().is_dir():
            raise ConfigError(
                f"stage.init_optimizer=true needs a Lightning .ckpt as stage.init_from; "
                f"{source!r} holds weights only"
            )
    if cfg.run.ckpt_path is not None and stage.init_from is not None:
        raise ConfigError(
            "run.ckpt_path (resume this stage) and stage.init_from (start from other weights) "
            "are both set; choose one"
        )


def check_data_and_kernels(cfg: RunConfig) -> None:
    """The sequences against the model, a new tokenizer against the vocabulary, and the
    document mask against the attention kernel."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is above model.max_seq_len={cfg.model.max_seq_len}"
        )
    # a stage that starts from weights uses their tokenizer (checked against the model
    # when it is loaded); vocab_size only sizes a tokenizer trained from scratch
    trains_tokenizer = cfg.data.tokenizer.path is None and cfg.stage.init_from is None
    if trains_tokenizer and cfg.data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer.vocab_size={cfg.data.tokenizer.vocab_size} does not fit "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
    check_expert_path(cfg.kernels.experts)
    kernels = cfg.kernels
    if is_fallback(cfg.model):
        _check_one_attention(kernels)
    # every kind of layer the model has, on the backend its key names
    choice = attention_choice(kernels, cfg.model, document_mask=cfg.data.document_mask)
    for kind in choice.kinds:
        backend, key = choice.backends[kind], choice.key(kind)
        if cfg.data.document_mask and not backend.capabilities.document_mask:
            raise ConfigError(
                f"data.document_mask=true needs an attention backend with document masking; "
                f"{key}={backend.name} has none (use {key}=flex)"
            )
        if cfg.model.attention_sinks and not backend.capabilities.sinks:
            raise ConfigError(
                f"{key}={backend.name} takes no attention sinks, which "
                f"model.family={cfg.model.family} has (model.attention_sinks=true); use "
                f"{key}=sdpa or flex"
            )


def _check_one_attention(kernels: KernelsConfig) -> None:
    """The transformers fallback runs one attention of its own in every layer (``auto``
    takes its flex attention): refuse a backend per kind of layer, and a backend transformers has
    none of, naming the key."""
    for key, value in (
        ("kernels.attention_local", kernels.attention_local),
        ("kernels.attention_global", kernels.attention_global),
    ):
        if value is not None:
            raise ConfigError(
                f"{key}={value}: a backend per kind of layer needs a native model family "
                "(model.family=hf runs transformers' one attention in every layer); set "
                "kernels.attention=sdpa, flex, flash_attn or auto"
            )
    if kernels.attention not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(
            f"kernels.attention={kernels.attention}: transformers has no such attention "
            "(model.family=hf); set kernels.attention=" + ", ".join(ATTENTION_IMPLEMENTATIONS)
        )


def check_adapter(cfg: RunConfig) -> None:
    """The adapter's own settings, and QLoRA's CUDA GPU."""
    adapter = cfg.adapter
    check_adapter_config(adapter)
    if adapter.kind == "lora":
        check_base_dtype(adapter.base_dtype, cfg.precision.name)
    check_expert_target(adapter, has_experts=bool(cfg.model.moe_experts))
    if adapter.kind != "none" and EXPERTS_TARGET in native_targets(adapter):
        if not get_strategy(cfg.strategy.name).expert_adapters:
            raise ConfigError(
                f"adapter.target_modules: {EXPERTS_TARGET} with strategy={cfg.strategy.name}: "
                "adapters on the experts are not supported under its engine (PEFT "
                "re-parametrizes their weights at every call); use strategy=fsdp or ddp, "
                "or adapt the attention only"
            )
        if cfg.strategy.expert_parallel:
            raise ConfigError(
                f"adapter.target_modules: {EXPERTS_TARGET} with strategy.expert_parallel=true: "
                "an expert's adapter would have to live on the rank that holds the expert, "
                "which is not built; gather the experts (strategy.expert_parallel=false)"
            )
        if cfg.kernels.compile:
            raise ConfigError(
                f"adapter.target_modules: {EXPERTS_TARGET} with kernels.compile=true (on by "
                "default on a GPU): PEFT adds the experts' update by re-parametrizing their "
                "weights at every call, which compiled blocks are not tested with; set "
                "kernels.compile=false"
            )
    if adapter.kind != "qlora":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "adapter.kind=qlora needs a CUDA GPU (bitsandbytes 4-bit kernels), and none is "
            "available; use adapter=lora on this machine"
        )
    if cfg.trainer.accelerator not in ("auto", "cuda", "gpu"):
        raise ConfigError(
            f"adapter.kind=qlora needs a CUDA GPU, but trainer.accelerator="
            f"{cfg.trainer.accelerator}"
        )


def check_guard(cfg: RunConfig) -> None:
    """The guard's own settings, and a strategy that lets it skip updates."""
    check_guard_config(cfg.guard)
    spec = get_strategy(cfg.strategy.name)
    if cfg.guard.policy not in ("off", "auto") and spec.steps_in_engine:
        raise ConfigError(
            f"guard.policy={cfg.guard.policy} with strategy={cfg.strategy.name}: DeepSpeed "
            "keeps the gradients and the optimizer step inside its engine, so bad updates "
            "cannot be judged or skipped; set guard.policy=off"
        )


def check_batch_ramp(cfg: RunConfig) -> None:
    """A batch ramp's own settings, and a strategy whose accumulation Lightning runs."""
    check_ramp_config(cfg.stage.batch_ramp, cfg.trainer.accumulate_grad_batches)
    if cfg.stage.batch_ramp.tokens and get_strategy(cfg.strategy.name).steps_in_engine:
        raise ConfigError(
            f"stage.batch_ramp.tokens with strategy={cfg.strategy.name}: DeepSpeed fixes "
            "its gradient accumulation when its engine is built; ramp the batch under "
            "ddp or fsdp, or set stage.batch_ramp.tokens=0"
        )


def check_head(cfg: RunConfig) -> None:
    """The model's head is the one the objective trains (its spec's ``head``: a score
    head is a reward model's); a score head has no vocabulary for the fused head loss."""
    head, objective = cfg.model.head, cfg.stage.objective
    wanted = objective_of(cfg).head
    if (head == "score") != (wanted == "score"):
        trains = "trains a score head" if wanted == "score" else "trains a language-model head"
        raise ConfigError(
            f"model.head={head} with stage.objective={objective}, which {trains} (a score "
            "head is trained by stage.objective=reward: set both, as recipe=reward/... does)"
        )
    if head == "score" and cfg.kernels.loss_chunk_size is not None:
        raise ConfigError(
            f"kernels.loss_chunk_size={cfg.kernels.loss_chunk_size} fuses the vocabulary "
            "head with the loss; model.head=score has no vocabulary: set it to null"
        )


def check_objective(cfg: RunConfig) -> None:
    """The objective's own cross-key rules (its spec's ``check``: GRPO's rollouts
    against the accumulation and the strategy, distillation's head against the
    strategy)."""
    spec = objective_of(cfg)
    spec.check(cfg, spec.settings_of(cfg))
    degree = cfg.strategy.context_parallel
    if degree != 1 and cfg.model.attention_sinks:
        raise ConfigError(
            f"strategy.context_parallel={degree}: its sharded attention takes no attention "
            f"sinks, which model.family={cfg.model.family} has (model.attention_sinks=true)"
        )
    if degree != 1:
        choice = attention_choice(cfg.kernels, cfg.model, document_mask=cfg.data.document_mask)
        for kind in choice.lacking("context_parallel"):  # the key that chose it is named
            backend, key = choice.backends[kind], choice.key(kind)
            if key != "kernels.attention":
                raise ConfigError(
                    f"{key}={backend.name} cannot run with rows split over ranks "
                    f"(strategy.context_parallel={degree}); use {key}=flex or sdpa"
                )
        check_context_parallel(
            degree,
            world_size=planned_world_size(cfg),
            seq_len=cfg.data.seq_len,
            strategy=cfg.strategy.name,
            strategy_supports=get_strategy(cfg.strategy.name).context_parallel,
            backend=_least_capable(choice),
            objective=spec.name,
            objective_supports=spec.context_parallel,
            supporting=tuple(name for name, s in STRATEGIES.items() if s.context_parallel),
            shard_group_size=hsdp_shard_group_size(cfg),
            expert_parallel=cfg.strategy.expert_parallel,
        )


def _least_capable(choice: AttentionChoice) -> AttentionBackend:
    """A backend in use that cannot split rows over ranks, else the global layers'."""
    lacking = [choice.backends[kind] for kind in choice.lacking("context_parallel")]
    return (lacking or [choice.for_window(None)])[0]
