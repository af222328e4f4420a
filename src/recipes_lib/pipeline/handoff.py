"""From a stage spec to the stage's RunConfig, and from one stage to the next.

Set-up order for one stage:

1. compose the recipe with the pipeline's and the stage's Hydra overrides
   (``compose_config``), then merge the stage's other keys (a partial RunConfig) and
   place the run in ``<pipeline dir>/<stage>``: :func:`compose_stage`;
2. read what it starts from (a manifest of an earlier stage, or an outside file):
   :func:`handoff_from_manifest` / :func:`handoff_from_path`;
3. apply the hand-off: initial weights / optimizer / resume point by ``init``, the
   source's tokenizer, its last learning rate, replayed data: :func:`apply_handoff`;
4. fingerprint the result (:func:`stage_fingerprint`); a completed stage whose
   fingerprint still matches is not trained again.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes_lib.checkpoint.hf import (
    HF_CONFIG_NAME,
    hf_weight_files,
    is_hf_folder,
    model_config_from_hf,
    read_hf_config,
)
from recipes_lib.checkpoint.manifest import MANIFEST_NAME, StageManifest, read_manifest
from recipes_lib.checkpoint.weights import WEIGHTS_NAME, read_checkpoint, sha256_file
from recipes_lib.config import (
    ModelConfig,
    RunConfig,
    SourceConfig,
    compose_config,
    list_recipes,
)
from recipes_lib.config.schema import model_fields, resolved_model_fields
from recipes_lib.config.store import fill_from_init, run_schema_node
from recipes_lib.data.prepare import DEFAULT_SOURCES
from recipes_lib.data.tokenizer import TOKENIZER_FILE, resolve_tokenizer_file
from recipes_lib.errors import CheckpointError, ConfigError, RecipesError
from recipes_lib.pipeline.spec import PipelineSpec, StageSpec

# Keys that say where a stage runs or how it reports, not what it computes; left out
# of the fingerprint (paths to inputs are replaced by the inputs' checksums).
LOCATION_KEYS = (
    "run.dir",
    "run.ckpt_path",
    "stage.init_from",
    "data.tokenizer.path",
    "data.cache_dir",
    "data.num_proc",
    "data.num_workers",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
)
# Keys the runner sets from the stage's ``init`` and ``from``.
RUNNER_KEYS = ("run.dir", "run.ckpt_path", "stage.init_from", "stage.init_optimizer")
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
        model=dict(manifest.model),
        global_step=manifest.global_step,
        tokens_seen=manifest.tokens_seen,
        last_lr=manifest.last_lr,
        data_sources=dict(manifest.data_sources),
    )


def handoff_from_hf_folder(folder: Path, where: str) -> Handoff:
    """The hand-off of a Hugging Face model folder: its weights (``stage.init_from`` loads
    the folder itself), its tokenizer and chat template when it has a ``tokenizer.json``,
    and the model shape its ``config.json`` describes. Its checksum covers config.json
    and every weight file.

    Raises:
        CheckpointError: naming ``where``, for an unsupported or incomplete folder.
    """
    try:
        model = model_config_from_hf(read_hf_config(folder), name=folder.name)
        files = [folder / HF_CONFIG_NAME, *hf_weight_files(folder)]
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from err
    digest = hashlib.sha256(" ".join(sha256_file(f) for f in files).encode()).hexdigest()
    tokenizer = folder / TOKENIZER_FILE
    return Handoff(
        label=str(folder),
        stage=None,
        manifest=None,
        weights=folder,
        weights_sha256=digest,
        tokenizer=tokenizer if tokenizer.is_file() else None,
        tokenizer_sha256=sha256_file(tokenizer) if tokenizer.is_file() else None,
        model=asdict(model),
    )


def handoff_from_path(path: str | Path, stage: StageSpec) -> Handoff:
    """The hand-off of an outside ``from`` path: a manifest (or a folder holding one), a
    Hugging Face model folder (``config.json`` and safetensors weights), a Lightning
    ``.ckpt``, a ``.safetensors`` file or a folder holding ``model.safetensors``.

    Raises:
        CheckpointError: naming the stage and the path, when it is none of those or
            cannot be read.
    """
    source = Path(path).expanduser()
    where = f"{stage.key}.from={str(path)!r}"
    if source.is_dir() and (source / MANIFEST_NAME).is_file():
        source = source / MANIFEST_NAME
    if source.is_file() and source.suffix == ".json":
        manifest = read_manifest(source, stage=f"{stage.name} (from {source})")
        return handoff_from_manifest(manifest, str(source))
    if is_hf_folder(source):
        return handoff_from_hf_folder(source, where)
    if source.is_dir() and (source / WEIGHTS_NAME).is_file():
        source = source / WEIGHTS_NAME
    if source.is_file() and source.suffix == ".safetensors":
        return Handoff(str(source), None, None, source, sha256_file(source))
    if source.is_file() and source.suffix == ".ckpt":
        try:
            checkpoint = read_checkpoint(source)
        except CheckpointError as err:
            raise CheckpointError(f"{where}: {err}") from err
        model = (checkpoint.get("hyper_parameters") or {}).get("model")
        schedulers = checkpoint.get("lr_schedulers") or [{}]
        last_lrs = schedulers[0].get("_last_lr") or [None]
        return Handoff(
            label=str(source),
            stage=None,
            manifest=None,
            weights=source,
            weights_sha256=sha256_file(source),
            checkpoint=source,
            model=dict(model) if isinstance(model, Mapping) else None,
            global_step=int(checkpoint.get("global_step", 0)),
            tokens_seen=int(checkpoint.get("tokens_seen", 0)),
            last_lr=float(last_lrs[0]) if last_lrs[0] is not None else None,
        )
    if not source.exists():
        raise CheckpointError(f"{where}: no such stage or file")
    raise CheckpointError(
        f"{where} is not a manifest (.json or a stage folder holding {MANIFEST_NAME}), a "
        f"Hugging Face model folder, a .ckpt, a .safetensors file or a folder holding "
        f"{WEIGHTS_NAME}"
    )


# --------------------------------------------------------------------- compose


def compose_stage(
    pipeline: PipelineSpec,
    stage: StageSpec,
    source_model: Mapping[str, Any] | None = None,
    source_label: str = "no source",
) -> RunConfig:
    """The stage's RunConfig before any hand-off: recipe + overrides + stage keys, with
    ``model=from_init`` fields taken from ``source_model`` (the model of what the stage
    starts from, named ``source_label`` in errors).

    Raises:
        ConfigError: naming the stage for an unknown recipe, an override that does not
            compose, or a stage key the schema does not have (``stages.<s>.<key>``).
    """
    recipes = list_recipes()
    if stage.recipe not in recipes:
        raise ConfigError(
            f"{stage.key}.recipe={stage.recipe!r}: no such recipe; choose one of: "
            + ", ".join(recipes)
        )
    for key in RUNNER_KEYS:
        if sets_key(pipeline, stage, key):
            raise ConfigError(
                f"{stage.key}.{key} is set by the pipeline (from the stage's init and from "
                "keys and its folder); do not set it"
            )
    overrides = [f"recipe={stage.recipe}", *pipeline.overrides, *stage.overrides]
    try:
        composed = compose_config(overrides)
    except Exception as err:  # Hydra's composition errors carry the key at fault
        raise ConfigError(
            f"stage {stage.name}: recipe {stage.recipe} with overrides {list(overrides[1:])} "
            f"does not compose: {err}"
        ) from err
    typed = run_schema_node()
    try:
        typed = OmegaConf.merge(typed, OmegaConf.to_container(composed, resolve=False))
        typed = OmegaConf.merge(typed, stage.settings)
    except OmegaConfBaseException as err:
        full_key = getattr(err, "full_key", None) or ""
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{stage.key}.{full_key}: {reason}") from err
    typed.run.dir = str(pipeline.dir / stage.name)
    try:
        fill_from_init(typed.model, source_model, f"{stage.key}: {source_label}")
    except ConfigError as err:
        raise ConfigError(f"stage {stage.name}: {err}") from err
    try:
        return OmegaConf.to_object(typed)  # type: ignore[return-value]
    except (OmegaConfBaseException, ValueError) as err:
        full_key = getattr(err, "full_key", None) or ""
        raise ConfigError(f"{stage.key}.{full_key}: {str(err).splitlines()[0]}") from err


def sets_key(pipeline: PipelineSpec, stage: StageSpec, key: str) -> bool:
    """Whether the stage itself (its keys or overrides, or the pipeline's) sets ``key``."""
    node: Any = stage.settings
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if node is not None:
        return True
    overrides = (*pipeline.overrides, *stage.overrides)
    return any(o.lstrip("+").split("=")[0] == key for o in overrides)


# --------------------------------------------------------------------- checks


def check_model_compatible(
    stage: StageSpec, model: ModelConfig, source: Handoff | str, source_model: Mapping[str, Any]
) -> None:
    """Raise :class:`ConfigError` when the stage's model cannot take the source's weights:
    every shape field (``model_fields("shape")`` of the schema) that differs is named.

    Args:
        stage: the stage that starts from the source.
        model: the stage's model config.
        source: the source (its label is used in messages).
        source_model: the source's model config fields.
    """
    label = source.label if isinstance(source, Handoff) else source
    ours = resolved_model_fields(model, "shape")
    theirs = resolved_model_fields(source_model, "shape")
    differences = [
        f"model.{key}={ours[key]} vs {theirs[key]}" for key in ours if ours[key] != theirs[key]
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
    import torch
    from safetensors import safe_open

    from recipes_lib.models import Transformer

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(model).state_dict().items()}
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except Exception as err:
        raise CheckpointError(f"{stage.key}.from: '{weights}' is not readable: {err}") from err
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
    if stage.init == "weights":
        cfg.stage.init_from = str(handoff.weights)
    elif stage.init in ("weights+optimizer", "full"):
        if handoff.checkpoint is None or not handoff.checkpoint.is_file():
            raise CheckpointError(
                f"stage {stage.name}: init={stage.init} needs a single-file Lightning "
                f"checkpoint of {handoff.label}, which has none (a stage run with a sharded "
                "strategy keeps folder checkpoints: continue it with init: weights)"
            )
        if stage.init == "full":
            cfg.run.ckpt_path = str(handoff.checkpoint)
        else:
            cfg.stage.init_from = str(handoff.checkpoint)
            cfg.stage.init_optimizer = True
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


# ------------------------------------------------------------------ fingerprint


def _drop(data: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(last, None)


def _replace_text(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {k: _replace_text(v, old, new) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_replace_text(v, old, new) for v in value]
    return value


def stage_fingerprint(
    stage: StageSpec, cfg: RunConfig, handoff: Handoff | None
) -> tuple[dict[str, Any], str]:
    """The identity of what a stage computes, and its SHA-256.

    It is the resolved config less :data:`LOCATION_KEYS` (the stage's own folder
    written as ``${run.dir}`` wherever it appears), plus ``inputs``: the ``init``
    mode, the source, and the checksums of what those paths named (the source's
    weights and the tokenizer file).
    """
    config = asdict(cfg)
    config = _replace_text(config, str(cfg.run.dir), "${run.dir}")
    for key in LOCATION_KEYS:
        _drop(config, key)
    tokenizer_sha = None
    if cfg.data.tokenizer.path is not None:
        if handoff is not None and cfg.data.tokenizer.path == str(handoff.tokenizer):
            tokenizer_sha = handoff.tokenizer_sha256
        else:
            tokenizer_sha = tokenizer_file_sha256(
                cfg.data.tokenizer.path, f"{stage.key}.data.tokenizer.path"
            )
    payload = {
        **config,
        "inputs": {
            "init": stage.init,
            "from": (handoff.stage or handoff.label) if handoff is not None else None,
            "weights_sha256": handoff.weights_sha256 if handoff is not None else None,
            "tokenizer_sha256": tokenizer_sha,
        },
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return payload, hashlib.sha256(blob).hexdigest()


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): value}


def describe_changes(old: Mapping[str, Any], new: Mapping[str, Any], limit: int = 8) -> list[str]:
    """``key: old -> new`` for each differing key of two fingerprint payloads."""
    flat_old, flat_new = _flatten(dict(old)), _flatten(dict(new))
    names = {
        "inputs.weights_sha256": "the weights it starts from",
        "inputs.tokenizer_sha256": "the tokenizer",
    }
    changes = []
    for key in sorted(set(flat_old) | set(flat_new)):
        a, b = flat_old.get(key, "<unset>"), flat_new.get(key, "<unset>")
        if a == b:
            continue
        if key in names:
            changes.append(f"{names[key]} changed")
        else:
            changes.append(f"{key}: {a!r} -> {b!r}")
    if len(changes) > limit:
        changes = [*changes[:limit], f"... and {len(changes) - limit} more"]
    return changes
