"""Online RL with verifiable rewards: the ``grpo`` objective.

Each training batch is a batch of prompts (:mod:`recipes_lib.data.prompts.module`). The
policy samples ``stage.grpo.completions_per_prompt`` completions of each with the KV
cache
(:func:`~recipes_lib.models.sampling.sample_completions`, on the training devices: under
FSDP the sharded model generates through its own forward), the rewards score them
(:mod:`recipes_lib.rewards`), and each completion's advantage is its reward against its
group's (:func:`~recipes_lib.losses.rl.group_advantages`). The clipped objective
(:func:`~recipes_lib.losses.rl.grpo_loss`) is then minimised over
``stage.grpo.updates_per_batch`` optimizer steps on the same completions (the data module
draws each batch that many times); the ratio is taken to the log-probs of the policy
that sampled, kept with the completions. With ``stage.grpo.kl_coef > 0`` a frozen reference
(the starting weights; under LoRA the base with its adapters bypassed) adds the KL term.

Under ``strategy.context_parallel`` the ranks of a group sample the same completions (seeded
by their data-parallel replica, then taken from the group's first rank), and each runs
the policy, the sampling policy and the reference on its share of every row; the loss
adds up each completion's sums over the group (``grpo_loss``'s ``across``), so it is the
whole completions' loss.

Sampling is seeded by ``run.seed``, the optimizer step and the data-parallel replica (the
rank, without context parallelism), and the completions
a step left for the next ones are saved in checkpoints, so a resumed run continues as
the uninterrupted one would (on one process; a run of several that resumes between a
batch's updates samples that batch again on every rank, as the checkpoint holds rank
0's completions only).

Logged as ``train/...``: ``loss``, ``reward`` (the mean weighted total),
``rewards/<name>`` (each reward's mean), ``completion_length``, ``finished`` (the share
of completions that ended with the EOS token), ``clip_fraction`` and ``kl``; validation
decodes one greedy completion per held-out prompt and logs ``val/reward`` and
``val/rewards/<name>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recipes_lib.config.schema import RunConfig
from recipes_lib.data.prompts.module import PromptDataModule, prompts_of
from recipes_lib.data.tokenizer import init_tokenizer_path
from recipes_lib.errors import ConfigError
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.losses.cross_entropy import IGNORE_INDEX
from recipes_lib.losses.rl import LOSS_NORMS, group_advantages, grpo_loss
from recipes_lib.models.sampling import Completions, sample_completions
from recipes_lib.objectives.registry import (
    FrozenModel,
    ObjectiveSpec,
    register_objective,
    shapes_vary,
)
from recipes_lib.objectives.settings import GRPOSettings
from recipes_lib.objectives.sft import save_chat_tokenizer_beside_outputs
from recipes_lib.parallel.context import (
    data_parallel_rank,
    from_group_leader,
    group_loss,
    group_sum,
    holding_shard,
)
from recipes_lib.rewards import build_rewards, score_completions
from recipes_lib.training.module import Batch, CausalLMModule
from recipes_lib.training.reference import (
    REFERENCE_SOURCE_KEY,
    FrozenReference,
    build_reference,
    restore_reference,
)

ROLLOUT_KEY = "grpo_rollout"  # checkpoint entry: completions later steps train on


@dataclass
class Rollout:
    """Sampled completions ready to train on: rows of prompt and completion, the
    completion tokens as labels, and what the loss needs of them."""

    key: list[int]  # the prompts' dataset indices
    input_ids: Tensor  # (R, L) prompt + completion, all but the last token
    labels: Tensor  # (R, L) the completion's tokens where they are next, -100 elsewhere
    advantages: Tensor  # (R,)
    # (R, L) under the sampling policy (None: one update) and the reference (None: no KL
    # term); under context parallelism this rank's share of every row, (R, L / N)
    old_logps: Tensor | None
    ref_logps: Tensor | None
    metrics: dict[str, Tensor]

    def to(self, device: torch.device) -> Rollout:
        """This rollout with its tensors on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        metrics = {k: v.to(device) for k, v in self.metrics.items()}
        return replace(self, **moved, metrics=metrics)

    def state(self) -> dict[str, Any]:
        """Its fields, tensors on the CPU (for a checkpoint)."""
        cpu = self.to(torch.device("cpu"))
        return {f.name: getattr(cpu, f.name) for f in fields(cpu)}


def check_grpo(settings: GRPOSettings) -> None:
    """Refuse GRPO settings out of range, naming the key."""
    checks = [
        (settings.completions_per_prompt >= 2, "completions_per_prompt", "must be >= 2 (a group)"),
        (settings.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
        (settings.temperature > 0, "temperature", "must be > 0 (training samples)"),
        (0 < settings.top_p <= 1, "top_p", "must be in (0, 1]"),
        (settings.updates_per_batch >= 1, "updates_per_batch", "must be >= 1"),
        (0 < settings.clip_low < 1, "clip_low", "must be in (0, 1)"),
        (settings.clip_high is None or settings.clip_high > 0, "clip_high", "must be > 0"),
        (settings.kl_coef >= 0, "kl_coef", "must be >= 0"),
        (settings.loss_norm in LOSS_NORMS, "loss_norm", f"must be one of {list(LOSS_NORMS)}"),
    ]
    for ok, key, problem in checks:
        if not ok:
            raise ConfigError(f"stage.grpo.{key}={getattr(settings, key)!r} {problem}")


class GRPOModule(CausalLMModule):
    """GRPO of a causal LM on prompts with verifiable rewards (see the module docstring).

    Takes :class:`CausalLMModule`'s arguments plus ``settings`` (:class:`GRPOSettings`),
    ``allowed_targets`` (``run.allowed_targets``, for reward functions of your own) and
    ``seed`` (``run.seed``, for sampling).

    Raises:
        ConfigError: a setting out of range or a reward that cannot be built.
    """

    @classmethod
    def from_run_config(cls, cfg, **kwargs: Any) -> GRPOModule:
        extra = {"allowed_targets": tuple(cfg.run.allowed_targets), "seed": cfg.run.seed}
        return super().from_run_config(cfg, **extra, **kwargs)  # type: ignore[return-value]

    def __init__(
        self,
        *args: Any,
        settings: GRPOSettings | None = None,
        allowed_targets: Sequence[str] = (),
        seed: int = 0,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.grpo_config = settings if settings is not None else GRPOSettings()
        check_grpo(self.grpo_config)
        self.rewards = build_rewards(self.grpo_config.rewards, allowed_targets)
        self.hparams["grpo"] = asdict(self.grpo_config)
        self.seed = seed
        self.reference: FrozenReference | None = None
        self.reference_source: str | None = None  # the file a separate reference came from
        self.rollout: Rollout | None = None

    def configure_model(self) -> None:
        """Build the policy, then (with ``stage.grpo.kl_coef > 0``) its frozen reference."""
        if self.model is not None:
            return
        super().configure_model()
        if self.grpo_config.kl_coef > 0:
            self.reference = build_reference(self, self.init_from, "stage.init_from")
            self.reference_source = self.reference.source

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.reference is not None:
            self.reference.match_dtype(next(self.built_model().parameters()).dtype)

    # -------------------------------------------------------------- rollouts
    def _datamodule(self):
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or getattr(datamodule, "eos_id", None) is None:
            raise ConfigError(
                "stage.objective=grpo needs its prompt data module (data=stdlib_grpo or "
                "data=prompts), set up before training"
            )
        return datamodule

    def sample(self, batch: Batch, k: int, temperature: float, seed: int) -> Completions:
        """``k`` completions of each prompt of ``batch``, stopping at the EOS token."""
        settings = self.grpo_config
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return sample_completions(
            self.built_model(),
            prompts_of(batch),
            settings.max_new_tokens,
            completions_per_prompt=k,
            temperature=temperature,
            top_p=settings.top_p if temperature > 0 else 1.0,
            stop_ids=[self._datamodule().eos_id],
            generator=generator,
            all_finished=self._all_finished,
        )

    def _all_finished(self, done: Tensor) -> bool:
        """Whether every row of every process finished: processes that shard the model
        decode the same number of steps (each gathers the weights)."""
        return self._across_ranks(bool(done.all()), dist.ReduceOp.MIN)

    def _across_ranks(self, flag: bool, op: dist.ReduceOp.RedOpType) -> bool:
        """``flag`` combined over the run's processes by ``op`` (MIN: every one's, MAX:
        any one's); this process's alone when it runs by itself."""
        value = torch.tensor(int(flag), device=self.device)
        trainer = self._attached()
        if trainer is not None and trainer.world_size > 1 and dist.is_initialized():
            dist.all_reduce(value, op=op)
        return bool(value)

    def score(
        self, batch: Batch, completions: Completions, k: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The completions' total rewards ``(R,)`` and each reward's values."""
        datamodule = self._datamodule()
        texts = [  # without the EOS token a finished completion ends with
            datamodule.tokenizer.decode(tokens[:-1] if done else tokens)
            for tokens, done in zip(completions.tokens, completions.finished, strict=True)
        ]
        records = [r for r in batch["records"] for _ in range(k)]
        where = [w for w in batch["where"] for _ in range(k)]
        return score_completions(self.rewards, texts, records, where)

    def _rows(self, batch: Batch, completions: Completions, k: int) -> tuple[Tensor, Tensor]:
        """``input_ids`` and ``labels`` ``(R, L)`` of prompt + completion rows."""
        prompts = [p for p in prompts_of(batch) for _ in range(k)]
        rows = [p + c for p, c in zip(prompts, completions.tokens, strict=True)]
        width = max(len(row) for row in rows) - 1
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for r, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
            input_ids[r, : len(row) - 1] = torch.tensor(row[:-1])
            # the token at position i + 1 is predicted at i: the completion's, from the
            # prompt's last position on
            labels[r, len(prompt) - 1 : len(row) - 1] = torch.tensor(row[len(prompt) :])
        return input_ids.to(self.device), labels.to(self.device)

    def token_logprobs(
        self, model: Any, input_ids: Tensor, labels: Tensor
    ) -> tuple[Tensor, Tensor, ContextShard | None]:
        """``(R, L)`` fp32 log-probs of ``labels`` under ``model`` (0 where ignored) at
        the sampling temperature (as the completions were drawn), through the head fused
        with the loss when ``kernels.loss_chunk_size`` is set; with the labels they are
        of and None. Under ``strategy.context_parallel``: those of this rank's share of
        every row, the share's labels and its shard; the model keeps the shard while a
        gradient is to flow (the training step clears it after the backward)."""
        mask = self.expert_load.rows_mask(labels)  # padding after a row's labels
        split = self.rows_share(input_ids, labels, None, mask)
        if split is None:
            return self._logprobs(model, input_ids, labels, mask), labels, None
        shard, (ids, local, _, local_mask) = split
        with holding_shard(self._takes_shard(model), shard):
            logps = self._logprobs(model, ids, local, local_mask)
        return logps, local, shard

    def _logprobs(self, model: Any, ids: Tensor, labels: Tensor, mask: Tensor | None) -> Tensor:
        return model(
            ids,
            None,
            labels=labels,
            per_token=True,
            loss_chunk_size=self.kernels_config.loss_chunk_size,
            temperature=self.grpo_config.temperature,
            token_mask=mask,
        )

    def _takes_shard(self, model: Any) -> Any:
        """The transformer that runs ``model``'s rows: a reference's own, else the
        policy's (the reference of an adapted policy is the policy, adapters bypassed)."""
        if isinstance(model, FrozenReference) and model.model is not None:
            return model.model
        return self.built_model()

    def make_rollout(self, batch: Batch) -> Rollout:
        """Sample, score and prepare the completions of ``batch``'s prompts."""
        settings = self.grpo_config
        k = settings.completions_per_prompt
        trainer = self._attached()
        step, rank = (trainer.global_step, trainer.global_rank) if trainer else (0, 0)
        strategy = trainer.strategy if trainer else None
        # each step and data-parallel replica its own; the ranks sharing a row take one
        replica = data_parallel_rank(strategy, rank)
        seed = (self.seed * 1_000_003 + step) * 1009 + replica
        completions = self.sample(batch, k, settings.temperature, seed)
        total, each = self.score(batch, completions, k)
        # the group's first rank's completions and rewards (a reward model or a timeout
        # need not score alike on every rank), on the CPU to travel
        completions, total, each = from_group_leader(
            strategy, (completions, total.cpu(), {name: v.cpu() for name, v in each.items()})
        )
        advantages = group_advantages(total, k, scale=settings.scale_rewards)
        input_ids, labels = self._rows(batch, completions, k)
        old = ref = None
        with torch.no_grad():
            if settings.updates_per_batch > 1:
                old = self.token_logprobs(self.built_model(), input_ids, labels)[0]
            if self.reference is not None:
                ref = self.token_logprobs(self.reference, input_ids, labels)[0]
        lengths = torch.tensor([len(t) for t in completions.tokens], dtype=torch.float32)
        metrics = {
            "reward": total.mean(),
            **{f"rewards/{name}": values.mean() for name, values in each.items()},
            "completion_length": lengths.mean(),
            "finished": torch.tensor(completions.finished, dtype=torch.float32).mean(),
        }
        return Rollout(
            key=batch["index"].tolist(),
            input_ids=input_ids,
            labels=labels,
            advantages=advantages.to(self.device),
            old_logps=old,
            ref_logps=ref,
            metrics={name: value.to(self.device) for name, value in metrics.items()},
        )

    def _rollout_for(self, batch: Batch) -> Rollout:
        """The completions this step trains on: new ones on the first of a batch's
        ``updates_per_batch`` steps, else the ones kept from its first."""
        repeat = self.trainer.global_step % self.grpo_config.updates_per_batch
        kept = self.rollout
        fresh = repeat == 0 or kept is None or kept.key != batch["index"].tolist()
        if self._across_ranks(fresh, dist.ReduceOp.MAX):  # ranks sample together
            self.rollout = self.make_rollout(batch)
        return self.rollout  # type: ignore[return-value]

    # ------------------------------------------------------------------ loss
    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped objective on the step's completions, and its metrics."""
        settings = self.grpo_config
        rollout = self._rollout_for(batch)
        model = self.built_model()
        logps, labels, shard = self.token_logprobs(model, rollout.input_ids, rollout.labels)
        old = rollout.old_logps if rollout.old_logps is not None else logps.detach()
        loss, metrics = grpo_loss(
            logps,
            old,
            rollout.advantages,
            labels != IGNORE_INDEX,
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            ref_logps=rollout.ref_logps,
            kl_coef=settings.kl_coef,
            loss_norm=settings.loss_norm,
            max_new_tokens=settings.max_new_tokens,
            across=None if shard is None else (lambda sums: group_sum(sums, shard)),
        )
        if shard is not None:  # every rank of the group holds the loss of whole rows
            loss = group_loss(loss, shard)
        return loss, {**rollout.metrics, **metrics}

    def count_tokens(self, batch: Batch) -> int:
        """The completion tokens this rank trains on in the step."""
        rollout = self.rollout
        return 0 if rollout is None else int((rollout.labels != IGNORE_INDEX).sum())

    # ------------------------------------------------------------ validation
    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """One greedy completion of each held-out prompt, and its rewards."""
        completions = self.sample(batch, 1, 0.0, self.seed)
        total, each = self.score(batch, completions, 1)
        size = len(batch["records"])
        values = {"reward": total, **{f"rewards/{n}": v for n, v in each.items()}}
        for name, value in values.items():
            mean = value.mean().to(self.device)
            self.log(f"val/{name}", mean, on_epoch=True, sync_dist=True, batch_size=size)
        return total.mean()

    def on_validation_epoch_end(self) -> None:
        self._val_loss_sum = self._val_batches = None  # no loss, no perplexity

    # ----------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[REFERENCE_SOURCE_KEY] = self.reference_source
        rollout = self.rollout
        # split rows hold a rank's share of the log-probs: a resumed run samples again
        whole = self.context_parallel == 1
        if rollout is not None and self.grpo_config.updates_per_batch > 1 and whole:
            checkpoint[ROLLOUT_KEY] = rollout.state()

    def on_load_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # type: ignore[arg-type]
        self.reference_source = restore_reference(
            self.reference, checkpoint, self.reference_source, "stage.init_from"
        )
        saved = checkpoint.get(ROLLOUT_KEY)
        trainer = self._attached()
        # the checkpoint holds rank 0's completions: another rank samples its batch again
        if saved is not None and getattr(trainer, "world_size", 1) == 1:
            self.rollout = Rollout(**saved).to(self.device)

    def on_fit_end(self) -> None:
        save_chat_tokenizer_beside_outputs(self)  # the tokenizer and template, as SFT's


def prompt_data(cfg: RunConfig, *, total_train_samples: int) -> PromptDataModule:
    """The prompts (the tokenizer beside the starting weights unless
    ``data.tokenizer.path`` names one), each batch drawn ``updates_per_batch`` times."""
    settings = GRPO.settings_of(cfg)
    return PromptDataModule(
        cfg.data,
        model_vocab_size=cfg.model.vocab_size,
        model_max_seq_len=cfg.model.max_seq_len,
        total_train_samples=total_train_samples,
        tokenizer_path=init_tokenizer_path(cfg.data, cfg.stage.init_from),
        max_new_tokens=settings.max_new_tokens,
        repeats=settings.updates_per_batch,
    )


def _reference(cfg: RunConfig, settings: GRPOSettings) -> tuple[FrozenModel, ...]:
    """With a KL term, the starting weights as a reference (the base itself under an
    adapter); it runs once per batch of completions."""
    if settings.kl_coef <= 0:
        return ()
    shared = cfg.adapter.kind != "none"
    return (
        FrozenModel(
            "reference", cfg.model, sharded=True, forward_each_step=False, shares_policy=shared
        ),
    )


def _check(cfg: RunConfig, settings: GRPOSettings) -> None:
    """Its optimizer steps on one batch of completions follow the data stream one batch
    per step, and its sampling runs through the model's own forward."""
    from recipes_lib.parallel.strategy import get_strategy

    updates = settings.updates_per_batch
    if updates > 1 and (cfg.trainer.accumulate_grad_batches != 1 or cfg.stage.batch_ramp.tokens):
        raise ConfigError(
            f"stage.grpo.updates_per_batch={updates} takes one batch of prompts per optimizer "
            f"step; trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches} "
            "and stage.batch_ramp split a step: raise data.batch_size instead"
        )
    if get_strategy(cfg.strategy.name).steps_in_engine:
        raise ConfigError(
            f"stage.objective=grpo with strategy={cfg.strategy.name}: sampling is not "
            "supported inside DeepSpeed's engine; use ddp or fsdp"
        )


GRPO = register_objective(
    ObjectiveSpec(
        name="grpo",
        module=GRPOModule.from_run_config,
        data=prompt_data,
        batch="prompts: records, where, index (B,), their token ids; rollouts sampled in the step",
        loss="grpo_loss on group_advantages",
        settings=GRPOSettings,
        batches_vary=shapes_vary,
        frozen_models=_reference,
        check=_check,
        context_parallel=True,
    )
)
