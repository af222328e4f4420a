"""What a stage computes, as a fingerprint, and how two fingerprints differ.

A stage's fingerprint is the payload :mod:`recipes_lib.config.fingerprint` makes of its
resolved config (less where it runs), less the paths to its inputs, plus the checksums
of what it starts from. A finished stage records it in its manifest;
a rerun compares the new fingerprint with it to decide whether the stage is done.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from recipes_lib.config import RunConfig
from recipes_lib.config.fingerprint import LOCATION_KEYS, config_payload
from recipes_lib.config.fingerprint import describe_changes as describe_config_changes
from recipes_lib.pipeline.handoff import Handoff, tokenizer_file_sha256
from recipes_lib.pipeline.spec import StageSpec

# Paths to a stage's inputs: left out of its fingerprint, which holds the checksums of
# what they name instead (``inputs``).
INPUT_PATH_KEYS = ("stage.init_from", "data.tokenizer.path")


def stage_fingerprint(
    stage: StageSpec, cfg: RunConfig, handoff: Handoff | None
) -> tuple[dict[str, Any], str]:
    """The identity of what a stage computes, and its SHA-256.

    It is the resolved config less ``LOCATION_KEYS`` and :data:`INPUT_PATH_KEYS` (the
    stage's own folder written as ``${run.dir}`` wherever it appears), plus ``inputs``: the ``init``
    mode, the source, and the checksums of what those paths named (the source's
    weights and the tokenizer file).
    """
    config = config_payload(asdict(cfg), cfg.run.dir, (*LOCATION_KEYS, *INPUT_PATH_KEYS))
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


def describe_changes(old: Mapping[str, Any], new: Mapping[str, Any], limit: int = 8) -> list[str]:
    """``key: old -> new`` for each differing key of two fingerprint payloads (see
    :func:`recipes_lib.config.fingerprint.describe_changes`); a changed input is named in
    words."""
    names = {
        "inputs.weights_sha256": "the weights it starts from",
        "inputs.tokenizer_sha256": "the tokenizer",
    }
    return describe_config_changes(old, new, limit, names)
