"""Pipelines written as dicts, and stage outputs made without training (fake weights,
tokenizer and a manifest whose fingerprint matches the stage's config)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tiny import SMALL_VOCAB_OVERRIDES

from recipes_lib.checkpoint.manifest import FileRef, StageManifest, write_manifest
from recipes_lib.checkpoint.weights import save_weights, sha256_file
from recipes_lib.config import ModelConfig, SourceConfig
from recipes_lib.models import Transformer
from recipes_lib.pipeline.compose import compose_stage
from recipes_lib.pipeline.fingerprint import stage_fingerprint
from recipes_lib.pipeline.handoff import (
    apply_handoff,
    handoff_from_manifest,
)
from recipes_lib.pipeline.spec import PipelineSpec, parse_pipeline


def tiny_model(**changes: Any) -> ModelConfig:
    """The ``model=tiny`` shape with the 512-token vocabulary of ``SMALL_VOCAB_OVERRIDES``."""
    return ModelConfig(**{"vocab_size": 512, "n_kv_heads": 2, "tie_embeddings": True, **changes})


def make_pipeline(tmp_path: Path, stages: dict[str, Any], **top: Any) -> PipelineSpec:
    """A pipeline in ``tmp_path / 'pipe'`` with a 512-token vocabulary everywhere."""
    data = {
        "name": "p",
        "dir": str(tmp_path / "pipe"),
        "overrides": list(SMALL_VOCAB_OVERRIDES),
        **top,
    }
    data["stages"] = stages
    return parse_pipeline(data)


def fake_weights(path: Path, model: ModelConfig, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    return save_weights(Transformer(model).state_dict(), path)


def fake_manifest(
    stage_dir: Path,
    *,
    stage: str = "pretrain",
    model: ModelConfig | None = None,
    tokenizer_text: str = '{"fake": "tokenizer"}',
    config: dict[str, Any] | None = None,
    config_sha256: str = "0" * 64,
    last_lr: float | None = 3e-4,
    global_step: int = 10,
) -> StageManifest:
    """Weights, a tokenizer file and a manifest in ``stage_dir``, as a finished stage
    leaves them (no checkpoint)."""
    model = model or tiny_model()
    stage_dir.mkdir(parents=True, exist_ok=True)
    weights = fake_weights(stage_dir / "model.safetensors", model)
    tokenizer = stage_dir / "tokenizer.json"
    tokenizer.write_text(tokenizer_text)
    manifest = StageManifest(
        pipeline="p",
        stage=stage,
        recipe="pretrain/tiny",
        weights=FileRef("model.safetensors", sha256_file(weights)),
        tokenizer=FileRef("tokenizer.json", sha256_file(tokenizer)),
        model=asdict(model),
        global_step=global_step,
        tokens_seen=global_step * 1024,
        config=config or {},
        config_sha256=config_sha256,
        last_lr=last_lr,
        data_sources={"stdlib": asdict(SourceConfig(builtin="stdlib"))},
    )
    write_manifest(manifest, stage_dir)
    return manifest


def complete_without_training(
    pipeline: PipelineSpec, name: str, manifests: dict[str, StageManifest]
) -> StageManifest:
    """Leave stage ``name`` as if it had finished: a manifest whose fingerprint is the
    one the runner computes for the stage's current config and its source's manifest."""
    index = pipeline.index(name)
    stage = pipeline.stages[index]
    cfg = compose_stage(pipeline, stage)
    source = stage.source or (pipeline.stages[index - 1].name if index else None)
    handoff = (
        handoff_from_manifest(manifests[source], f"stage {source}")
        if source is not None and stage.init != "scratch"
        else None
    )
    cfg = apply_handoff(pipeline, stage, cfg, handoff)
    payload, sha = stage_fingerprint(stage, cfg, handoff)
    tokenizer_text = (
        Path(handoff.tokenizer).read_text() if handoff is not None else '{"fake": "tokenizer"}'
    )
    manifest = fake_manifest(
        pipeline.dir / name,
        stage=name,
        model=cfg.model,
        tokenizer_text=tokenizer_text,
        config=payload,
        config_sha256=sha,
    )
    manifests[name] = manifest
    return manifest
