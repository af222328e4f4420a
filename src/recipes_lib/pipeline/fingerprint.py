"""What a stage computes, as a fingerprint, and how two fingerprints differ.

A stage's fingerprint is its resolved config, less where it runs (:data:`LOCATION_KEYS`),
plus the checksums of what it starts from. A finished stage records it in its manifest;
a rerun compares the new fingerprint with it to decide whether the stage is done.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from recipes_lib.config import RunConfig
from recipes_lib.pipeline.handoff import Handoff, tokenizer_file_sha256
from recipes_lib.pipeline.spec import StageSpec

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
    """``key: old -> new`` for each differing key of two fingerprint payloads.

    A key the recorded payload lacks whose new value is the schema's default is no
    change: the schema gained it after the stage ran (``model.family``, ``data.path``),
    and at its default it computes what the stage computed."""
    flat_old, flat_new = _flatten(dict(old)), _flatten(dict(new))
    names = {
        "inputs.weights_sha256": "the weights it starts from",
        "inputs.tokenizer_sha256": "the tokenizer",
    }
    defaults = _flatten(asdict(RunConfig()))
    changes = []
    for key in sorted(set(flat_old) | set(flat_new)):
        a, b = flat_old.get(key, "<unset>"), flat_new.get(key, "<unset>")
        if a == b:
            continue
        if key not in flat_old and key in defaults and b == defaults[key]:
            continue  # a key the schema gained since the stage ran, at its default
        if key in names:
            changes.append(f"{names[key]} changed")
        else:
            changes.append(f"{key}: {a!r} -> {b!r}")
    if len(changes) > limit:
        changes = [*changes[:limit], f"... and {len(changes) - limit} more"]
    return changes
