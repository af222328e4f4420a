"""Knowledge distillation: the ``distill`` objective.

:class:`DistillModule` trains on SFT's conversations (and composes SFT's parts: its
data, its assistant-token count, the tokenizer written beside the outputs); its loss is a
divergence between a frozen teacher's next-token distributions and the student's, on the
assistant tokens of SFT data (:mod:`recipes_lib.losses.distill`: forward KL or GKD's
generalised Jensen-Shannon divergence, at a temperature). The teacher is any checkpoint
the library loads (``stage.distill.teacher_from``: a stage folder, a manifest, a Hugging Face
folder, a ``.ckpt``), of any shape, with the student's vocabulary. It is built as a
frozen model beside the student (same kernels and precision; no adapter or
compilation), outside the optimizer and the checkpoints, as DPO's reference is. Both
models' heads are applied a chunk of rows at a time inside the loss
(``kernels.loss_chunk_size``, default 256): neither's full logits exist. The loss is
computed inside the student's forward and its head's (``fused``), so that under FSDP the
student's head is gathered for it; the teacher is then whole on each rank (frozen, it has
nothing to reduce), which costs each GPU the teacher's weights.

Under ``strategy.context_parallel`` both models run on each rank's share of every row
(the teacher's attention sharded as the student's), and the ranks' sums of the divergence
make the group's mean.

Logged as ``train/...`` and ``val/...``: ``loss`` (the divergence).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recipes_lib.checkpoint.source import recorded_model_config
from recipes_lib.config.schema import RunConfig
from recipes_lib.data.chat.module import ChatDataModule, build_chat_data
from recipes_lib.errors import ConfigError
from recipes_lib.losses.cross_entropy import IGNORE_INDEX
from recipes_lib.losses.distill import DISTILL_LOSSES, chunked_distill_loss
from recipes_lib.models.transformer import context_parallel_refusal
from recipes_lib.models.windows import attention_choice
from recipes_lib.objectives.registry import FrozenModel, ObjectiveSpec, register_objective
from recipes_lib.objectives.settings import DistillSettings
from recipes_lib.objectives.sft import (
    assistant_tokens,
    chat_rows_vary,
    save_chat_tokenizer_beside_outputs,
)
from recipes_lib.parallel.context import holding_shard, sharded_loss
from recipes_lib.training.build import build_model
from recipes_lib.training.module import Batch, CausalLMModule

DEFAULT_CHUNK = 256
TEACHER_KEY = "stage.distill.teacher_from"


def check_distill(settings: DistillSettings, student_vocab: int) -> None:
    """``stage.distill`` on its own and the teacher against the student's vocabulary.

    Raises:
        ConfigError: no teacher, an unknown loss, a beta outside [0, 1], a non-positive
            temperature, or a teacher with another vocabulary size.
        CheckpointError: the teacher cannot be read or records no shape.
    """
    if settings.teacher_from is None:
        raise ConfigError(
            f"stage.objective=distill needs {TEACHER_KEY}: the teacher's weights (a "
            "stage folder, a Hugging Face folder, a manifest or a .ckpt)"
        )
    if settings.loss not in DISTILL_LOSSES:
        raise ConfigError(
            f"stage.distill.loss={settings.loss!r} is not one of {list(DISTILL_LOSSES)}"
        )
    if not 0.0 <= settings.beta <= 1.0:
        raise ConfigError(f"stage.distill.beta={settings.beta} must be in [0, 1]")
    if not settings.temperature > 0:
        raise ConfigError(f"stage.distill.temperature={settings.temperature} must be positive")
    teacher = recorded_model_config(settings.teacher_from, TEACHER_KEY)
    if teacher.vocab_size != student_vocab:
        raise ConfigError(
            f"{TEACHER_KEY}={settings.teacher_from!r} has a vocabulary of "
            f"{teacher.vocab_size} tokens and the student (model.vocab_size) {student_vocab}: "
            "distillation needs the same tokenizer"
        )


class DistillModule(CausalLMModule):
    """Distils a frozen teacher into the trained model on SFT data (settings:
    :class:`DistillSettings`). When fitting ends, the run's folder gets the tokenizer and
    chat template, as after SFT.

    Raises:
        ConfigError, CheckpointError: see :func:`check_distill`.
    """

    def __init__(self, *args: Any, settings: DistillSettings | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings if settings is not None else DistillSettings()
        check_distill(self.settings, self.model_config.vocab_size)
        self.hparams["distill"] = asdict(self.settings)
        self.teacher: Any = None  # set past nn.Module: no optimizer, state dict or broadcast

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        source = self.settings.teacher_from
        assert source is not None  # check_distill refuses a run without a teacher
        plan = dataclasses.replace(
            self.policy_build(),
            model=recorded_model_config(source, TEACHER_KEY),
            kernels=dataclasses.replace(self.kernels_config, compile=False),
            init_from=str(Path(source).expanduser()),
            init_label=f"{TEACHER_KEY}={source!r}",
            adapter=None,
            trains=False,
            upcycle=False,
        )
        device, mesh = self.placement()
        if mesh is not None:  # a sharded student: the frozen teacher whole on each rank
            device, mesh = self.trainer.strategy.root_device, None
        attention = self.built_model().attention_backend
        teacher = build_model(plan, device=device, mesh=mesh, attention=attention)
        # not a submodule: outside the state dict (checkpoints), DDP's broadcast and .to()
        object.__setattr__(self, "teacher", teacher.eval().requires_grad_(False))

    def on_fit_start(self) -> None:
        super().on_fit_start()
        dtype = next(self.built_model().parameters()).dtype  # the student's, under *-true
        if next(self.teacher.parameters()).dtype != dtype:
            self.teacher.to(dtype=dtype)

    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The divergence on the batch's assistant tokens. Under
        ``strategy.context_parallel`` each rank runs both models on its share of every
        row; the divergence is a mean over tokens, so each rank's share is its sum over
        the group's count (:func:`~recipes_lib.parallel.context.sharded_loss`)."""
        input_ids, doc_ids = self.model_inputs(batch)
        labels, token_mask = batch["labels"], self.expert_load.token_mask(batch)
        student = self.built_model()
        split = self.rows_share(input_ids, labels, doc_ids, token_mask)
        if split is None:
            loss = self._divergence(student, input_ids, doc_ids, labels, token_mask)
            return loss, {"assistant_tokens": assistant_tokens(batch)}
        shard, (ids, local, docs, mask) = split
        with holding_shard(student, shard):  # until the backward has run (training_step)
            try:
                self.teacher.set_context_shard(shard)
                mean = self._divergence(student, ids, docs, local, mask)
            finally:
                self.teacher.set_context_shard(None)
        counted = (local != IGNORE_INDEX).sum()
        loss = sharded_loss(mean * counted, counted, shard)
        return loss, {"assistant_tokens": assistant_tokens(batch)}

    def _divergence(
        self,
        student: Any,
        input_ids: Tensor,
        doc_ids: Tensor | None,
        labels: Tensor,
        token_mask: Tensor | None,
    ) -> Tensor:
        """The mean divergence over the tokens ``labels`` train, computed inside the
        student's forward so that a sharded student gathers its head for it."""
        with torch.no_grad():
            teacher_hidden = self.teacher.forward_hidden(input_ids, doc_ids)  # (B, T, Ct)
        settings = self.settings

        def divergence(hidden: Tensor, weight: Tensor) -> Tensor:  # inside the student's head
            return chunked_distill_loss(
                hidden.flatten(0, 1),
                weight,
                teacher_hidden.flatten(0, 1),
                self.teacher.output.weight,
                (labels != IGNORE_INDEX).flatten(),
                loss=settings.loss,
                beta=settings.beta,
                temperature=settings.temperature,
                chunk_size=self.kernels_config.loss_chunk_size or DEFAULT_CHUNK,
            )

        return student(input_ids, doc_ids, token_mask=token_mask, fused=divergence)

    def on_validation_epoch_end(self) -> None:
        # a divergence has no perplexity: drop the base module's running sums
        self._val_loss_sum = self._val_batches = None

    def on_fit_end(self) -> None:
        save_chat_tokenizer_beside_outputs(self)  # the tokenizer and template, as SFT's


def distill_data(cfg: RunConfig, *, total_train_samples: int) -> ChatDataModule:
    """SFT's conversations, tokenized with ``data.tokenizer.path``, else the tokenizer
    beside the student's starting weights, else the one beside the teacher, whose
    vocabulary the student must share.

    Raises:
        ConfigError: the weights the tokenizer is looked for beside have none.
    """
    if cfg.stage.init_from is not None:
        return build_chat_data(cfg, total_train_samples=total_train_samples)
    return build_chat_data(
        cfg,
        total_train_samples=total_train_samples,
        weights=DISTILL.settings_of(cfg).teacher_from,
        weights_key=TEACHER_KEY,
    )


def _teacher(cfg: RunConfig, settings: DistillSettings) -> tuple[FrozenModel, ...]:
    """The teacher, of its own shape, whole on each rank."""
    if not settings.teacher_from:
        return ()
    teacher = recorded_model_config(settings.teacher_from, TEACHER_KEY)
    return (FrozenModel("teacher", teacher, sharded=False),)


def _check_teacher_splits(
    teacher: Any, kernels: Any = None, *, document_mask: bool = False
) -> None:
    """A teacher whose attention context parallelism cannot shard, named before training
    (the student's is checked with the run's other choices): what the model itself
    refuses (:func:`~recipes_lib.models.transformer.context_parallel_refusal`), or a
    layer kind whose backend under ``kernels`` (the teacher runs the student's kernel
    choices) cannot split rows."""
    if (refused := context_parallel_refusal(teacher)) is not None:
        raise ConfigError(f"{TEACHER_KEY}: the teacher cannot split its rows: {refused}")
    if kernels is None:
        return
    choice = attention_choice(kernels, teacher, document_mask=document_mask)
    if lacking := choice.lacking("context_parallel"):
        backend, key = choice.backends[lacking[0]], choice.key(lacking[0])
        raise ConfigError(
            f"{TEACHER_KEY}: the teacher's {key}={backend.name} cannot run with rows "
            "split over ranks (strategy.context_parallel); use flex or sdpa"
        )


def _check(cfg: RunConfig, settings: DistillSettings) -> None:
    """The divergence is computed inside the student head's forward: a strategy must
    gather the head for it, and a head converted to float8 would be bypassed."""
    from recipes_lib.parallel.strategy import get_strategy

    name = cfg.strategy.name
    if cfg.strategy.context_parallel > 1 and settings.teacher_from:
        teacher = recorded_model_config(settings.teacher_from, TEACHER_KEY)
        _check_teacher_splits(teacher, cfg.kernels, document_mask=cfg.data.document_mask)
    if not get_strategy(name).fused_head:
        raise ConfigError(
            f"stage.objective=distill with strategy={name}: the divergence is computed "
            "inside the student head's forward, which this strategy's engine is not known to "
            "gather the head for; use strategy=ddp or fsdp"
        )


DISTILL = register_objective(
    ObjectiveSpec(
        name="distill",
        module=DistillModule.from_run_config,
        data=distill_data,
        batch="as SFT's: input_ids, labels (-100 off the assistant's tokens), doc_ids (B, T)",
        loss="chunked_distill_loss (forward_kl | jsd), inside the student's head",
        settings=DistillSettings,
        loss_inside_head=True,
        batches_vary=chat_rows_vary,
        frozen_models=_teacher,
        check=_check,
        context_parallel=True,
    )
)
