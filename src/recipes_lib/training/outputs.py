"""A stage's output weights: the final weights, the mean of its last step checkpoints
(``stage.average_last_k``) or their moving average (``stage.ema_decay``), with an
adapter merged in (and saved alone in PEFT's format), written to
``<run.dir>/model.safetensors`` on global rank 0. Weights holding a non-finite value are
never written.

They are written as training ends, from the device, and the model's tensors are freed
after: Lightning's teardown would otherwise copy the whole model to the CPU first (5.6 s
of a 1B run's end on an H100), only for the export to read it there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from recipes_lib.adapters import has_adapter, merge_adapter, save_adapter
from recipes_lib.callbacks.ema import WeightEMA
from recipes_lib.checkpoint.hf_tokenizer import HF_TOKENIZER_CONFIG_NAME, read_json, token_text
from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.weights import average_checkpoints, list_step_checkpoints, save_weights
from recipes_lib.config import RunConfig
from recipes_lib.data.chat_records import tokenizer_chat_template
from recipes_lib.data.tokenizer import load_tokenizer, save_tokenizer_folder
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.parallel.strategy import get_strategy

if TYPE_CHECKING:
    from recipes_lib.training.module import CausalLMModule

log = logging.getLogger(__name__)


def step_saver(cfg: RunConfig, trainer: L.Trainer) -> tuple[ModelCheckpoint, int] | None:
    """The checkpoint callback that saves every N optimizer steps and its N, if there is one.

    ModelCheckpoint keeps N to itself, so N is read from the ``callbacks`` entry the
    callback was built from: its ``every_n_train_steps``, which the shipped callback
    groups set to ``run.checkpoint_every_n_steps``.
    """
    every = next(
        (
            int(node["every_n_train_steps"])
            for node in cfg.callbacks.values()
            if isinstance(node, Mapping) and (node.get("every_n_train_steps") or 0) > 0
        ),
        None,
    )
    savers = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    if every is None or not savers:
        return None
    return savers[0], every


def prepare_averaging(
    cfg: RunConfig, trainer: L.Trainer, steps: int, ckpt_path: str | None
) -> ModelCheckpoint | None:
    """Check that ``stage.average_last_k`` step checkpoints will exist, and keep them all.

    Raises:
        ConfigError: no callback saves step checkpoints, the last step would not be
            saved, or a fresh run would save fewer than K of them.
    """
    k = cfg.stage.average_last_k
    if k is None:
        return None
    found = step_saver(cfg, trainer)
    if found is None:
        raise ConfigError(
            f"stage.average_last_k={k} averages step checkpoints, but no ModelCheckpoint "
            "callback saves every N train steps (callbacks.checkpoint)"
        )
    saver, every = found
    if steps % every != 0:
        raise ConfigError(
            f"stage.average_last_k={k}: the run ends at step {steps}, which is not a multiple "
            f"of the checkpoint interval {every} (run.checkpoint_every_n_steps), so the "
            "average would leave out the final weights"
        )
    if ckpt_path is None and steps // every < k:
        raise ConfigError(
            f"stage.average_last_k={k}, but {steps} steps with a checkpoint every {every} "
            f"(run.checkpoint_every_n_steps) save only {steps // every}"
        )
    saver.save_top_k = -1  # keep every step checkpoint (with no monitor: all or one)
    return saver


def export_weights(
    cfg: RunConfig,
    trainer: L.Trainer,
    module: CausalLMModule,
    out: Path,
    saver: ModelCheckpoint | None,
    ema: WeightEMA | None,
) -> tuple[Path, list[Path]]:
    """Write the stage's output weights (rank 0) and say which checkpoints they average.

    Raises:
        CheckpointError: fewer than ``stage.average_last_k`` step checkpoints up to the
            final step are on disk, or the newest is not the final step.
    """
    step = trainer.global_step
    chosen: list[Path] = []
    if saver is not None and saver.dirpath is not None:
        k = cfg.stage.average_last_k
        assert k is not None  # a saver comes only with a k to average (prepare_averaging)
        saved = [(s, p) for s, p in list_step_checkpoints(saver.dirpath) if s <= step]
        if len(saved) < k or saved[-1][0] != step:
            found = ", ".join(f"{p.name} (step {s})" for s, p in saved) or "none"
            raise CheckpointError(
                f"stage.average_last_k={k} needs the last {k} step checkpoints up to step "
                f"{step} in {saver.dirpath}; found: {found}"
            )
        chosen = [p for _, p in saved[-k:]]
    path = RunDir(out).weights
    model = module.model
    assert model is not None  # built by configure_model before the fit
    # sharded weights are gathered by every rank together, onto rank 0
    final = get_strategy(cfg.strategy.name).gather_full_state_dict(model, trainer.strategy)
    refusal = None
    if trainer.is_global_zero:
        if chosen:
            state, source = average_checkpoints(chosen), f"mean of {len(chosen)} checkpoints"
        elif ema is not None:
            state, source = ema.averaged_state_dict(model), f"ema decay {ema.decay}"
        else:
            state, source = final, "final"
        adapted = has_adapter(model)
        merged = merge_adapter(model, state) if adapted else state
        bad = [
            name for name, t in merged.items() if t.is_floating_point() and not t.isfinite().all()
        ]
        if bad:  # never hand on weights a run cannot recover from (nor their adapters)
            refusal = (
                f"the output weights ({source}) hold non-finite values in {len(bad)} "
                f"tensor(s) ({', '.join(bad[:3])}); {path} is not written"
            )
        else:  # the merged weights first: an adapter folder that fails loses nothing
            merged_from = f"{source}, {cfg.adapter.kind} merged" if adapted else source
            save_weights(merged, path, metadata={"global_step": str(step), "weights": merged_from})
            if adapted:
                try:
                    save_adapter(model, RunDir(out).adapter, cfg.adapter, state=state)
                except CheckpointError as err:
                    refusal = f"{err}; the merged weights are written to {path}"
    # every rank learns rank 0's verdict, so none waits on a rank that has given up
    refusal = trainer.strategy.broadcast(refusal, src=0)
    if refusal is not None:
        raise CheckpointError(refusal)
    trainer.strategy.barrier("export_weights")
    return path, chosen


def save_tokenizer_beside(cfg: RunConfig, out: Path, tokenizer_path: Path | None) -> None:
    """Write the run's tokenizer beside its output weights where the stage has not (a
    pretraining run reads its own from the data cache), so the folder loads on its own:
    ``recipes-generate checkpoint=<run.dir>``, the ``hf/`` export.

    The EOS token and chat template are those beside the tokenizer, else
    ``data.tokenizer.eos_token`` where the tokenizer has it.
    """
    if tokenizer_path is None or RunDir(out).tokenizer.is_file():
        return
    beside = Path(tokenizer_path).parent
    eos = token_text(read_json(beside / HF_TOKENIZER_CONFIG_NAME).get("eos_token"))
    configured = cfg.data.tokenizer.eos_token
    if eos is None and load_tokenizer(tokenizer_path).token_to_id(configured) is not None:
        eos = configured
    save_tokenizer_folder(
        out,
        tokenizer_path,
        eos_token=eos,
        chat_template=tokenizer_chat_template(beside),
        model_max_length=cfg.model.max_seq_len,
    )


class OutputWeights(Checkpoint):
    """Writes the stage's output weights when the fit reaches its final step, then frees
    the model's tensors (:func:`release_weights`): no step follows.

    A ``Checkpoint`` callback, so Lightning runs its ``on_train_end`` after every step
    saver's (it moves checkpoint callbacks to the end, in their order, and this one is
    added last): ``stage.average_last_k`` finds the final step's checkpoint on disk. It
    takes the last step's guard verdict first, so a fit that rolls back writes nothing.
    """

    def __init__(
        self,
        cfg: RunConfig,
        steps: int,
        saver: ModelCheckpoint | None,
        ema: WeightEMA | None,
    ):
        self.cfg, self.steps, self.saver, self.ema = cfg, steps, saver, ema
        self.written: tuple[Path, list[Path]] | None = None  # (weights, averaged checkpoints)
        self.seconds = 0.0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        module = cast("CausalLMModule", pl_module)  # every objective's module is one
        module.guard.act(trainer, wait=True)  # the last step's verdict, if not yet in
        if trainer.global_step < self.steps or module.guard.rollback is not None:
            return  # stopped early, or another fit follows
        started = time.perf_counter()
        out = Path(self.cfg.run.dir)
        self.written = export_weights(self.cfg, trainer, module, out, self.saver, self.ema)
        release_weights(pl_module)
        self.seconds = time.perf_counter() - started


def release_weights(module: torch.nn.Module) -> int:
    """Drop every gradient of ``module`` (the last step's are still held) and free the
    storage of its plain parameters and buffers (each becomes an empty tensor on its
    device); return how many elements of weights were freed.

    Tensors of another kind keep their storage: sharded ``DTensor`` parameters, whose
    owner (FSDP2) holds more views of them, and quantised or DeepSpeed-partitioned ones.
    """
    freed = 0
    for parameter in module.parameters():
        parameter.grad = None
    for tensor in [*module.parameters(), *module.buffers()]:
        plain = type(tensor) in (torch.nn.Parameter, torch.Tensor) and not hasattr(tensor, "ds_id")
        if plain and type(tensor.data) is torch.Tensor and tensor.numel() > 0:
            freed += tensor.numel()
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return freed
