"""From one stage to the next: what a stage starts from and how it starts.

Set-up order for one stage:

1. compose its config (:func:`recipes_lib.pipeline.compose.compose_stage`);
2. read what it starts from (a manifest of an earlier stage, or an outside file):
   :func:`handoff_from_manifest` / :func:`handoff_from_path`;
3. check the two fit (:func:`check_model_compatible`, :func:`check_weights_fit`);
4. apply the hand-off: initial weights / optimizer / resume point by ``init``, the
   source's tokenizer, its last learning rate, replayed data: :func:`apply_handoff`;
5. fingerprint the result (:mod:`recipes_lib.pipeline.fingerprint`); a completed stage
   whose fingerprint still matches is not trained again.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.dequantize import dequantized_from
from recipes_lib.checkpoint.hf_files import HF_CONFIG_NAME, hf_weight_files, read_folder_config
from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.manifest import StageManifest, read_manifest
from recipes_lib.checkpoint.source import read_init_source, recorded_model
from recipes_lib.checkpoint.weights import sha256_file
from recipes_lib.config import (
    ModelConfig,
    RunConfig,
    SourceConfig,
)
from recipes_lib.config.model import field_differences
from recipes_lib.config.schema import model_fields
from recipes_lib.data.text.prepare import DEFAULT_SOURCES
from recipes_lib.data.tokenizer import TOKENIZER_FILE, resolve_tokenizer_file
from recipes_lib.errors import CheckpointError, ConfigError, RecipesError
from recipes_lib.pipeline.compose import sets_key
from recipes_lib.pipeline.spec import PipelineSpec, StageSpec

REPLAY_PREFIX = "replay_"


@dataclass(frozen=True)
class Handoff:
    """What a stage starts from: an earlier stage's manifest or an outside file.

    Attributes:
        label: how messages name the source (``stage pretrain`` or a path).
        stage: the source stage's name, ``None`` for an outside file.
        manifest: the source's manifest, when it has one.
        weights: its output weights (``.safetensors``, or the ``.ckpt`` itself).
        weights_sha256: checksum of ``weights``.
        checkpoint: its Lightning checkpoint at the final step, if any.
        tokenizer: its tokenizer file, if known.
        tokenizer_sha256: checksum of ``tokenizer``.
        model: its model shape (ModelConfig fields), if known.
        global_step / tokens_seen / last_lr: where its training ended.
        data_sources: its data mixture (SourceConfig fields by name), if known.
        dequantized: a quantized Hugging Face folder's method, its weights read
            dequantized (``fp8 (128x128 blocks)``); the stage's manifest records it.
    """

    label: str
    stage: str | None
    manifest: StageManifest | None
    weights: Path
    weights_sha256: str
    checkpoint: Path | None = None
    tokenizer: Path | None = None
    tokenizer_sha256: str | None = None
    model: dict[str, Any] | None = None
    global_step: int = 0
    tokens_seen: int = 0
    last_lr: float | None = None
    data_sources: dict[str, dict[str, Any]] | None = None
    dequantized: str | None = None


def handoff_from_manifest(manifest: StageManifest, label: str) -> Handoff:
    return Handoff(
        label=label,
        stage=manifest.stage,
        manifest=manifest,
        weights=manifest.weights_path,
        weights_sha256=manifest.weights.sha256,
        checkpoint=manifest.checkpoint_path,
        tokenizer=manifest.tokenizer_path,
        tokenizer_sha256=manifest.tokenizer.sha256,
        model=recorded_model(manifest.model),
        global_step=manifest.global_step,
        tokens_seen=manifest.tokens_seen,
        last_lr=manifest.last_lr,
        data_sources=dict(manifest.data_sources),
    )


def checkpoint_last_lr(checkpoint: Mapping[str, Any]) -> float | None:
    """The learning rate a Lightning checkpoint's run had reached (``last_lr``, which the
    training module records beside its scheduler), or None for a run without one."""
    last_lr = checkpoint.get("last_lr")
    return float(last_lr) if last_lr is not None else None


def handoff_from_path(path: str | Path, stage: StageSpec) -> Handoff:
    """The hand-off of an outside ``from`` path: a manifest (or a folder holding one), a
    Hugging Face model folder (``config.json`` and safetensors weights), a Lightning
    ``.ckpt``, a ``.safetensors`` file or a folder holding ``model.safetensors`` (see
    :func:`recipes_lib.checkpoint.source.read_init_source`).

    Raises:
        CheckpointError: naming the stage and the path, when it is none of those or
            cannot be read.
    """
    where = f"{stage.key}.from"
    source = read_init_source(path, where)
    if source.kind == "manifest":
        manifest = read_manifest(source.path, stage=f"{stage.name} (from {source.path})")
        return handoff_from_manifest(manifest, str(source.path))
    if source.kind == "hf":
        # the checksum covers config.json and every weight file
        try:
            files = [source.path / HF_CONFIG_NAME, *hf_weight_files(source.path)]
        except CheckpointError as err:
            raise CheckpointError(f"{where}={str(path)!r}: {err}") from err
        digest = hashlib.sha256(" ".join(sha256_file(f) for f in files).encode()).hexdigest()
        tokenizer = source.path / TOKENIZER_FILE
        return Handoff(
            label=str(source.path),
            stage=None,
            manifest=None,
            weights=source.path,
            weights_sha256=digest,
            tokenizer=tokenizer if tokenizer.is_file() else None,
            tokenizer_sha256=sha256_file(tokenizer) if tokenizer.is_file() else None,
            model=source.model,
            dequantized=dequantized_from(read_folder_config(source.path)),
        )
    if source.kind == "checkpoint":
        checkpoint = source.checkpoint or {}
        return Handoff(
            label=str(source.path),
            stage=None,
            manifest=None,
            weights=source.path,
            weights_sha256=sha256_file(source.path),
            checkpoint=source.path,
            model=source.model,
            global_step=int(checkpoint.get("global_step", 0)),
            tokens_seen=int(checkpoint.get("tokens_seen", 0)),
            last_lr=checkpoint_last_lr(checkpoint),
        )
    if source.kind == "sharded":
        raise CheckpointError(
            f"{where}={str(path)!r} is a sharded checkpoint folder; start the stage from the "
            "stage folder it belongs to, or consolidate it to one file first "
            "(recipes_lib.checkpoint.sharded.consolidate_sharded_checkpoint)"
        )
    # a .safetensors file (or a folder holding model.safetensors)
    return Handoff(str(source.weights), None, None, source.weights, sha256_file(source.weights))


# --------------------------------------------------------------------- checks


def check_model_compatible(
    stage: StageSpec, model: ModelConfig, source: Handoff | str, source_model: Mapping[str, Any]
) -> None:
    """Raise :class:`ConfigError` when the stage's model cannot take the source's weights:
    every shape field (``model_fields("shape")`` of the schema) that differs is named (a
    reward model's score head may start from a language model: ``field_differences``).

    Args:
        stage: the stage that starts from the source.
        model: the stage's model config.
        source: the source (its label is used in messages).
        source_model: the source's model config fields.
    """
    label = source.label if isinstance(source, Handoff) else source
    differences = [
        f"model.{key}={ours} vs {theirs}"
        for key, ours, theirs in field_differences(model, source_model, "shape")
    ]
    if differences:
        free = ", ".join(model_fields("context"))
        raise ConfigError(
            f"stage {stage.name}: {'; '.join(differences)}: its model does not fit the "
            f"weights of {label} it starts from (only {free} may change between stages)"
        )


def check_weights_fit(stage: StageSpec, model: ModelConfig, weights: Path) -> None:
    """Compare the tensor shapes in a ``.safetensors`` file with the stage's model.

    Raises:
        ConfigError: a tensor the model has is shaped differently, or none match.
    """
    from safetensors import safe_open

    from recipes_lib.models.hf_fallback import model_shapes

    expected = {k: tuple(v.shape) for k, v in model_shapes(model).state_dict().items()}
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except Exception as err:
        raise CheckpointError(f"{stage.key}.from: '{weights}' is not readable: {err}") from err
    if model.head == "score" and found.get("output.weight") == (model.vocab_size, model.dim):
        del expected["output.weight"]  # a language model's head: the score head starts fresh
    common = sorted(set(expected) & set(found))
    if not common:
        raise ConfigError(
            f"stage {stage.name}: '{weights}' holds none of the model's tensors "
            f"(e.g. {sorted(expected)[:3]})"
        )
    for name in common:
        if expected[name] != found[name]:
            raise ConfigError(
                f"stage {stage.name}: '{weights}' does not fit the stage's model: {name} is "
                f"{found[name]} there and {expected[name]} in the model"
            )


def tokenizer_file_sha256(path: str, key: str) -> str:
    try:
        return sha256_file(resolve_tokenizer_file(path))
    except RecipesError as err:
        raise ConfigError(f"{key}: {err}") from err


# --------------------------------------------------------------------- hand-off


def replay_sources(
    stage: StageSpec,
    sources: Mapping[str, SourceConfig],
    previous: Mapping[str, Mapping[str, Any]],
    fraction: float,
) -> dict[str, SourceConfig]:
    """The stage's mixture plus the previous mixture, weighted to ``fraction`` of it.

    Each previous source ``s`` joins as ``replay_<s>`` with its weight scaled so the
    replayed sources together make ``fraction`` of the sampled sequences, in their old
    proportions: ``w'_s = w_s / P * fraction / (1 - fraction) * W`` for the stage's own
    total weight ``W`` and the previous total ``P``.
    """
    own = dict(sources) if sources else {k: copy.copy(v) for k, v in DEFAULT_SOURCES.items()}
    if not previous:
        raise ConfigError(
            f"{stage.key}.replay_fraction={fraction}: the source names no data sources to replay"
        )
    own_total = sum(s.weight for s in own.values())
    previous_total = sum(float(s.get("weight", 1.0)) for s in previous.values())
    scale = fraction / (1.0 - fraction) * own_total / previous_total
    mixed = dict(own)
    for name, fields_ in previous.items():
        replay_name = f"{REPLAY_PREFIX}{name}"
        if replay_name in mixed:
            raise ConfigError(
                f"{stage.key}.data.sources.{replay_name}: the name is taken; replayed "
                f"sources are named {REPLAY_PREFIX}<name>"
            )
        try:
            source = SourceConfig(**dict(fields_))
        except TypeError as err:
            raise ConfigError(f"{stage.key}.replay_fraction: bad source '{name}': {err}") from err
        source.weight = float(fields_.get("weight", 1.0)) * scale
        mixed[replay_name] = source
    return mixed


def apply_handoff(
    pipeline: PipelineSpec, stage: StageSpec, cfg: RunConfig, handoff: Handoff | None
) -> RunConfig:
    """A copy of ``cfg`` set up to start from ``handoff`` as the stage's keys say.

    ``init: weights`` loads ``handoff.weights``; ``weights+optimizer`` loads the
    source's checkpoint with its optimizer state; ``full`` resumes the source's
    checkpoint (``run.ckpt_path``). The stage reuses the source's tokenizer unless it
    names the same one itself; ``lr_from_previous`` sets ``optim.lr`` to the source's
    last learning rate (unless the stage sets ``optim.lr``); ``replay_fraction`` mixes
    the source's data back in.

    Raises:
        ConfigError / CheckpointError: naming the stage, when the source lacks what the
            stage needs (a checkpoint, a tokenizer, a last learning rate, more steps).
    """
    cfg = copy.deepcopy(cfg)
    if handoff is None:
        return cfg
    if stage.init in ("weights+optimizer", "full"):
        if handoff.checkpoint is None or not handoff.checkpoint.is_file():
            raise CheckpointError(
                f"stage {stage.name}: init={stage.init} needs a single-file Lightning "
                f"checkpoint of {handoff.label}, which has none (a stage run with a sharded "
                "strategy keeps folder checkpoints: continue it with init: weights)"
            )
    _set_start(stage, cfg, handoff.weights, handoff.checkpoint)
    if cfg.data.tokenizer.path is None:
        if handoff.tokenizer is None:
            raise ConfigError(
                f"stage {stage.name}: {handoff.label} has no manifest naming its tokenizer; "
                f"set {stage.key}.data.tokenizer.path to the tokenizer its weights use"
            )
        cfg.data.tokenizer.path = str(handoff.tokenizer)
    elif handoff.tokenizer_sha256 is not None:
        ours = tokenizer_file_sha256(cfg.data.tokenizer.path, f"{stage.key}.data.tokenizer.path")
        if ours != handoff.tokenizer_sha256:
            raise ConfigError(
                f"stage {stage.name}: data.tokenizer.path={cfg.data.tokenizer.path} is not the "
                f"tokenizer of {handoff.label} ({handoff.tokenizer}); a later stage must reuse "
                f"the earlier stage's tokenizer: drop {stage.key}.data.tokenizer.path"
            )
    if stage.lr_from_previous and not sets_key(pipeline, stage, "optim.lr"):
        if handoff.last_lr is None:
            raise ConfigError(
                f"{stage.key}.lr_from_previous: {handoff.label} recorded no last learning rate"
            )
        if handoff.last_lr <= 0:
            raise ConfigError(
                f"{stage.key}.lr_from_previous: {handoff.label} ended at learning rate "
                f"{handoff.last_lr}; a stage cannot start from a zero learning rate"
            )
        cfg.optim.lr = handoff.last_lr
    if stage.replay_fraction > 0:
        cfg.data.sources = replay_sources(
            stage, cfg.data.sources, handoff.data_sources or {}, stage.replay_fraction
        )
    return cfg


def _set_start(stage: StageSpec, cfg: RunConfig, weights: Path, checkpoint: Path | None) -> None:
    """Set in ``cfg`` what ``stage.init`` starts from: the source's ``weights`` or its
    Lightning ``checkpoint`` (with its optimizer state, or resumed whole)."""
    if stage.init in ("weights", "upcycle"):
        cfg.stage.init_from = str(weights)
        cfg.stage.upcycle = stage.init == "upcycle"
    elif stage.init == "weights+optimizer":
        cfg.stage.init_from = str(checkpoint)
        cfg.stage.init_optimizer = True
    elif stage.init == "full":
        cfg.run.ckpt_path = str(checkpoint)


def expected_start(stage: StageSpec, cfg: RunConfig, source_dir: Path) -> RunConfig:
    """A copy of ``cfg`` with the paths :func:`apply_handoff` will set once the stage in
    ``source_dir`` has run (they need not exist yet): what a plan checks a stage's config
    with before its source trains. The learning rate and data stay as configured; the
    source's last rate and data sources are not known yet."""
    cfg = copy.deepcopy(cfg)
    folder = RunDir(source_dir)
    _set_start(stage, cfg, folder.weights, folder.last_checkpoint)
    if cfg.data.tokenizer.path is None:
        cfg.data.tokenizer.path = str(folder.tokenizer)
    return cfg
