"""What a path that starts a stage holds, and the model it fits.

``stage.init_from`` and a pipeline stage's ``from`` take the same kinds of path:

=================  ===============================================================
``hf``             a Hugging Face model folder (``config.json`` and safetensors)
``manifest``       a stage's ``manifest.json``, or the stage folder holding it
``run``            a run's folder or its ``model.safetensors`` (``config.yaml`` beside)
``checkpoint``     a Lightning ``.ckpt`` (its hyperparameters name the model)
``sharded``        an FSDP checkpoint folder (``meta.pt`` names the model)
``weights``        a bare ``.safetensors`` file: weights, no recorded model
=================  ===============================================================

:func:`read_init_source` tells which, and the model shape the source records when it
records one. With ``model=from_init`` (every model field ``???``) a run takes its
shape from there (:func:`fill_model_from_init`); with a model chosen by name, the
pre-flight compares the two and names every difference (:func:`init_model_mismatches`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from recipes_lib.checkpoint.hf import (
    hf_config_mismatches,
    load_hf_weights_into,
    model_config_from_hf,
)
from recipes_lib.checkpoint.hf_files import is_hf_folder, read_folder_config, read_hf_config
from recipes_lib.checkpoint.layout import MANIFEST_NAME, WEIGHTS_NAME, RunDir
from recipes_lib.checkpoint.manifest import StageManifest, read_manifest
from recipes_lib.checkpoint.sharded import SHARDED_METADATA_NAME, is_sharded_checkpoint
from recipes_lib.checkpoint.weights import (
    load_state_into,
    load_weights,
    read_checkpoint,
)
from recipes_lib.config.model import field_differences
from recipes_lib.config.schema import ModelConfig
from recipes_lib.config.store import fill_from_init, from_init_fields
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.models.families import FAMILIES
from recipes_lib.models.hf_fallback import (
    FALLBACK_FAMILY,
    fallback_line,
    fallback_model_config,
    is_fallback,
)

log = logging.getLogger(__name__)
_ANNOUNCED: set[str] = set()  # folders whose fallback line was printed


@dataclass(frozen=True)
class InitSource:
    """A path that starts a stage, read without loading its weights.

    Attributes:
        path: the path as given (``~`` expanded).
        kind: ``hf`` | ``manifest`` | ``run`` | ``checkpoint`` | ``sharded`` | ``weights``.
        weights: the file or folder that holds the weights.
        model: the ModelConfig fields the source records, or None.
        manifest: the stage manifest, for ``manifest`` sources.
        checkpoint: the loaded Lightning checkpoint dict (tensors memory-mapped), for
            ``checkpoint`` sources.
    """

    path: Path
    kind: str
    weights: Path
    model: dict[str, Any] | None = None
    manifest: StageManifest | None = None
    checkpoint: dict[str, Any] | None = None


def _model_beside(folder: Path) -> dict[str, Any] | None:
    """The model recorded beside weights in ``folder``: a stage's ``manifest.json``, else a
    run's ``config.yaml`` (the manifest read for its model only, without checksums)."""
    run_dir = RunDir(folder)
    try:
        if run_dir.manifest.is_file():
            return recorded_model(json.loads(run_dir.manifest.read_text()).get("model"))
        if run_dir.config.is_file():
            config = OmegaConf.to_container(OmegaConf.load(run_dir.config), resolve=False)
            return recorded_model(config.get("model")) if isinstance(config, dict) else None
    except Exception:  # noqa: BLE001 - an unreadable record only means "not known"
        return None
    return None


def _hyperparameter_model(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    model = (checkpoint.get("hyper_parameters") or {}).get("model")
    return recorded_model(model)


def recorded_model(model: Any) -> dict[str, Any] | None:
    """The ModelConfig fields a manifest, run config or checkpoint recorded (``asdict`` of
    the config it was written from), or None when it recorded none."""
    return dict(model) if isinstance(model, dict) else None


def _hf_folder_model(folder: Path, where: str, fallback: bool) -> dict[str, Any]:
    """The model of a Hugging Face folder: its native family's, or the transformers
    fallback's (``fallback``, or a ``model_type`` no family reads: said in one line)."""
    hf_config = read_hf_config(folder)
    model_type = hf_config.get("model_type")
    native = any(model_type in family.hf_model_types for family in FAMILIES.values())
    if native and not fallback:
        return asdict(model_config_from_hf(hf_config, name=folder.name))
    if not fallback and where not in _ANNOUNCED:
        _ANNOUNCED.add(where)
        log.warning(fallback_line(where, model_type))
    # transformers reads the folder's own config.json (an image-text one's too, not the
    # text tower a native family reads from it)
    return asdict(fallback_model_config(read_folder_config(folder), name=folder.name))


def read_init_source(
    path: str | os.PathLike, key: str = "stage.init_from", *, fallback: bool = False
) -> InitSource:
    """Tell what ``path`` holds (see the module docstring); a Hugging Face folder's
    model is the transformers fallback's with ``fallback`` (``model=hf``) or when no
    family reads its ``model_type``.

    Raises:
        CheckpointError: naming ``key`` and the path, when it is none of those kinds or
            cannot be read.
    """
    source = Path(path).expanduser()
    where = f"{key}={str(path)!r}"
    try:
        if source.is_dir() and (source / MANIFEST_NAME).is_file():
            source = source / MANIFEST_NAME
        if source.is_file() and source.suffix == ".json":
            manifest = read_manifest(source, verify=False)
            model = recorded_model(manifest.model)
            return InitSource(source, "manifest", manifest.weights_path, model, manifest)
        if is_hf_folder(source):
            return InitSource(source, "hf", source, _hf_folder_model(source, where, fallback))
        if is_sharded_checkpoint(source):
            meta = read_checkpoint(source / SHARDED_METADATA_NAME)
            return InitSource(source, "sharded", source, _hyperparameter_model(meta))
        if source.is_dir() and (source / WEIGHTS_NAME).is_file():
            return InitSource(source, "run", source / WEIGHTS_NAME, _model_beside(source))
        if source.is_file() and source.suffix == ".safetensors":
            model = _model_beside(source.parent)
            return InitSource(source, "run" if model else "weights", source, model)
        if source.is_file() and source.suffix == ".ckpt":
            checkpoint = read_checkpoint(source)
            model = _hyperparameter_model(checkpoint)
            return InitSource(source, "checkpoint", source, model, checkpoint=checkpoint)
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from err
    if not source.exists():
        raise CheckpointError(f"{where}: no such file or folder")
    raise CheckpointError(
        f"{where} is not a stage manifest (or a stage folder holding {MANIFEST_NAME}), a "
        f"Hugging Face model folder, a .ckpt, a sharded checkpoint folder, a .safetensors "
        f"file or a folder holding {WEIGHTS_NAME}"
    )


def fill_model_from_init(cfg: DictConfig) -> DictConfig:
    """A copy of a composed config whose ``${from_init:...}`` model fields (the
    ``model=from_init`` preset) are taken from ``stage.init_from``; fields set on the
    command line or in a recipe are kept. A config without such fields is returned as
    it is.

    Raises:
        ConfigError: a ``from_init`` field and no ``stage.init_from``, or a source that
            records no model shape.
        CheckpointError: ``stage.init_from`` cannot be read.
    """
    if not from_init_fields(cfg.model):
        return cfg
    init_from = OmegaConf.select(cfg, "stage.init_from")
    if init_from is None:
        raise ConfigError(
            "model=from_init takes the model's shape from the weights the run starts from, "
            "but stage.init_from is not set: set stage.init_from=DIR, or choose a model "
            "(model=NAME)"
        )
    family = OmegaConf.to_container(cfg.model, resolve=False).get("family")  # type: ignore[union-attr]
    fallback = family == FALLBACK_FAMILY  # model=hf
    source = read_init_source(init_from, fallback=fallback)
    cfg = cfg.copy()
    fill_from_init(cfg.model, source.model, f"stage.init_from={init_from!r} ({source.kind})")
    return cfg


def init_model_mismatches(model: ModelConfig, source: InitSource) -> list[str]:
    """Every way ``model`` differs from the model ``source`` records (empty when the
    source records none): against a Hugging Face config, all that decides what the
    weights compute; against one of this library's own sources, the weight shapes (the
    RoPE settings and context may change between stages)."""
    if source.model is None:
        return []
    if source.kind == "hf" and is_fallback(model):  # transformers reads the folder itself
        theirs = read_folder_config(source.path).get("model_type")
        ours = (model.hf_config or {}).get("model_type")
        return [] if ours == theirs else [f"model.hf_config.model_type={ours!r} vs {theirs!r}"]
    if source.kind == "hf":
        return hf_config_mismatches(_as_model(source.model), model)
    differences = field_differences(model, source.model, "shape")
    return [f"model.{k}={ours!r} vs {theirs!r}" for k, ours, theirs in differences]


def _as_model(model: dict[str, Any]) -> ModelConfig:
    """A recorded model dict as a typed ModelConfig."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), model))  # type: ignore[return-value]


def recorded_model_config(path: str | os.PathLike, key: str) -> ModelConfig:
    """The model the weights at ``path`` were made for (``key`` names it in errors).

    Raises:
        CheckpointError: the path cannot be read, or records no model shape.
    """
    source = read_init_source(path, key)
    if source.model is None:
        raise CheckpointError(
            f"{key}={str(path)!r} records no model shape ({source.kind}): give a stage "
            "folder, a manifest, a Hugging Face folder or a .ckpt"
        )
    return _as_model(source.model)


def load_model_weights(model: nn.Module, path: str | os.PathLike, label: str | None = None) -> None:
    """Load the weights ``path`` holds into ``model`` (any kind of :func:`read_init_source`).

    A Lightning checkpoint's ``model.`` prefix is stripped; a Hugging Face folder's
    config must describe ``model`` and its tensors are renamed and checked as they are
    read. ``label`` names the source in errors (default ``stage.init_from='<path>'``).

    Raises:
        CheckpointError: the path is missing or unreadable, a Hugging Face config
            differs from the model's, or its tensors do not fit the model (the first
            mismatches are listed).
    """
    label = label or f"stage.init_from={str(path)!r}"
    if is_hf_folder(path) and not is_fallback(getattr(model, "config", {})):
        load_hf_weights_into(model, path, label)  # type: ignore[arg-type]
        return
    try:
        state = load_weights(path)
    except CheckpointError as err:
        raise CheckpointError(f"{label}: {err}") from err
    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig) and config.head == "score" and _lm_head(state, config):
        # a reward model starting from a language model: the body, and a fresh head
        state = {name: t for name, t in state.items() if name != HEAD_WEIGHT}
        load_state_into(model, state, label, keep=(HEAD_WEIGHT,))
        return
    load_state_into(model, state, label)


HEAD_WEIGHT = "output.weight"


def _lm_head(state: Mapping[str, Any], config: ModelConfig) -> bool:
    """Whether ``state`` is a language model's: its head projects to the vocabulary, or
    is the embeddings (tied: not stored)."""
    head = state.get(HEAD_WEIGHT)
    return head is None or tuple(head.shape) == (config.vocab_size, config.dim)
