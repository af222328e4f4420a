"""The stage hand-off manifest: one JSON file beside a stage's output weights.

A finished stage writes ``<stage dir>/manifest.json`` describing what it produced:
the output weights and their SHA-256, the Lightning checkpoint to continue from, the
tokenizer (copied into the stage folder), the model shape, how far it trained, its
last learning rate, the data it saw, the resolved config and a fingerprint of it,
package versions and the git revision. The next stage reads only this file, and a
rerun of the pipeline compares the fingerprint to decide whether the stage is done.

Paths inside the file are relative to its folder when they lie inside it, so a
pipeline folder can be moved or copied as a whole. The file is written to a temporary
name and renamed into place: a reader sees either no manifest or a complete one.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.layout import MANIFEST_NAME, RunDir
from recipes_lib.checkpoint.weights import sha256_file
from recipes_lib.errors import CheckpointError
from recipes_lib.files import tag_floats, untag_float, write_json_atomic

MANIFEST_FORMAT_VERSION = 2  # 2: kind, evaluation, gates, promotion


@dataclass
class FileRef:
    """A file and the SHA-256 of its bytes; ``path`` is relative to the manifest's folder
    when the file lies inside it."""

    path: str
    sha256: str


@dataclass
class StageMetrics:
    """How a stage went: first and last logged train loss, final validation, cost."""

    train_loss_start: float | None = None
    train_loss_end: float | None = None
    val_loss: float | None = None
    val_ppl: float | None = None
    tokens: int = 0  # tokens trained on in this stage (all ranks)
    steps: int = 0  # optimizer steps taken in this stage
    seconds: float = 0.0  # wall time of the training run that finished the stage
    skipped_records: int = 0  # records the data left out (malformed, too long, ...)
    compiled_graphs: int = 0  # graphs torch.compile compiled (recipes_lib.kernels.compiled)
    recompile_limit_hits: int = 0  # code that passed dynamo's recompile limit, then ran eager


@dataclass
class StageManifest:
    """What a finished stage hands to the next one (``manifest.json``).

    Attributes:
        format_version: :data:`MANIFEST_FORMAT_VERSION` of the writer.
        pipeline: the pipeline's name.
        stage: the stage's name.
        recipe: the recipe the stage composed, e.g. ``anneal/tiny``.
        weights: the stage's output weights (``model.safetensors``).
        checkpoint: the Lightning checkpoint at the final step (for ``init: full`` and
            ``init: weights+optimizer``), relative like ``weights.path``; ``None`` if
            the stage kept none.
        tokenizer: the tokenizer the stage trained with, copied into its folder.
        model: the model shape (``ModelConfig`` fields).
        start_step: the global step the stage started at (non-zero with ``init: full``).
        global_step: the global step it ended at.
        tokens_seen: the stage's token counter at the end (it continues across an
            ``init: full`` hand-off and restarts otherwise).
        last_lr: the learning rate the schedule had reached when the stage ended.
        data_fingerprint: identity of the tokenized data (sources, tokenizer, split).
        data_sources: the mixture's sources (``SourceConfig`` fields by name), for replay.
        config: the stage's resolved config less folder-specific paths, plus
            ``inputs``: its init mode, its source and the checksums of the source's
            weights and of its tokenizer (see ``recipes_lib.pipeline.handoff``).
        config_sha256: the fingerprint of ``config``; a rerun whose fingerprint differs
            is a changed stage.
        upstream: ``{"stage" or "path", "weights_sha256"}`` of what the stage started
            from, or ``None`` for a stage trained from scratch; with
            ``dequantized_from`` (``fp8 (128x128 blocks)``) when it was a quantized
            Hugging Face folder read dequantized.
        averaged_from: the step checkpoints averaged into the output weights.
        versions: python, torch, lightning and recipes_lib versions.
        git_revision: the source tree's git commit (``-dirty`` when modified), if any.
        metrics: see :class:`StageMetrics`.
        guard: what the training guard did (``skipped_updates``; ``rollbacks``, each with
            the bad step, the step resumed from and the sample positions moved past).
        created: when the manifest was written (UTC, ISO 8601).
        kind: ``train``; ``eval`` or ``promote`` for a stage that trained nothing and
            hands on weights another stage wrote (``weights`` points into that stage's
            folder).
        evaluation: the stage's evaluation of its output weights: ``settings``,
            ``results`` (task -> metric -> value), ``examples``, ``seconds``.
        gates: each gate checked once the stage was done: metric, condition, value,
            target, passed.
        promotion: a promote stage's choice: ``by``, ``mode``, each candidate's value
            and the ``winner``.
        memory_fit: what ``kernels.activation_checkpointing=auto`` chose: checkpointing,
            loss chunk, micro-batch and accumulation, the estimate and the budget.
        load_check: a model of the transformers fallback (``model.family=hf``): its
            first batch's loss as the library computes it and as transformers' own
            forward does (``library_loss``, ``transformers_loss``, ``difference``).
        attention: the attention backend each kind of layer ran (``global``,
            ``local``), as ``kernels.attention`` and its per-kind keys chose them.
    """

    pipeline: str
    stage: str
    recipe: str
    weights: FileRef
    tokenizer: FileRef
    model: dict[str, Any]
    global_step: int
    tokens_seen: int
    config: dict[str, Any]
    config_sha256: str
    checkpoint: str | None = None
    start_step: int = 0
    last_lr: float | None = None
    data_fingerprint: str | None = None
    data_sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    upstream: dict[str, Any] | None = None
    averaged_from: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    git_revision: str | None = None
    metrics: StageMetrics = field(default_factory=StageMetrics)
    # what the training guard did: updates skipped, rollbacks and the data they skipped
    guard: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    kind: str = "train"
    evaluation: dict[str, Any] | None = None
    gates: list[dict[str, Any]] = field(default_factory=list)
    promotion: dict[str, Any] | None = None
    # what kernels.activation_checkpointing=auto chose (recipes_lib.launch_check.autofit)
    memory_fit: dict[str, Any] | None = None
    # the transformers fallback's first-batch check (recipes_lib.models.hf_fallback)
    load_check: dict[str, float] | None = None
    # the attention backend of each kind of layer (recipes_lib.kernels.choice)
    attention: dict[str, str] = field(default_factory=dict)
    format_version: int = MANIFEST_FORMAT_VERSION
    # The folder the manifest was read from or written to; not stored in the file.
    directory: Path | None = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------ locations
    def resolve(self, relative: str) -> Path:
        """A path stored in the manifest as a path on this machine."""
        path = Path(relative)
        if path.is_absolute() or self.directory is None:
            return path
        return self.directory / path

    @property
    def weights_path(self) -> Path:
        return self.resolve(self.weights.path)

    @property
    def tokenizer_path(self) -> Path:
        return self.resolve(self.tokenizer.path)

    @property
    def checkpoint_path(self) -> Path | None:
        return self.resolve(self.checkpoint) if self.checkpoint is not None else None

    def to_json(self) -> dict[str, Any]:
        """The manifest as strict JSON values: a model config's infinite values (a
        folder's own, such as Falcon-H1's ``time_step_limit``) tagged as transformers
        tags them."""
        data = asdict(self)
        data.pop("directory")
        return tag_floats(data)


def relative_to(path: str | os.PathLike, directory: Path) -> str:
    """``path`` relative to ``directory`` when it lies inside it, else absolute."""
    absolute = Path(path).resolve()
    try:
        return absolute.relative_to(directory.resolve()).as_posix()
    except ValueError:
        return str(absolute)


def package_versions() -> dict[str, str]:
    """Versions of the packages that decide what a stage computes."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for name in ("torch", "lightning", "recipes-lib"):
        try:
            versions[name.replace("-", "_")] = version(name)
        except PackageNotFoundError:
            versions[name.replace("-", "_")] = "unknown"
    return versions


def git_revision(directory: str | os.PathLike | None = None) -> str | None:
    """The git commit of the tree holding ``directory`` (default: this package's source),
    with ``-dirty`` appended when tracked files are modified; ``None`` outside git."""
    where = Path(directory) if directory is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    revision = head.stdout.strip()
    return f"{revision}-dirty" if status.returncode == 0 and status.stdout.strip() else revision


def write_manifest(manifest: StageManifest, directory: str | os.PathLike) -> Path:
    """Write ``manifest`` as ``<directory>/manifest.json``, atomically.

    Call it on global rank 0 only. Returns the file's path.
    """
    folder = Path(directory)
    target = RunDir(folder).manifest
    try:
        write_json_atomic(target, manifest.to_json(), allow_nan=False)
    except OSError as err:
        raise CheckpointError(
            f"stage {manifest.stage}: cannot write manifest '{target}': {err}"
        ) from err
    manifest.directory = folder
    return target


def _build(cls: type, data: Any, where: str) -> Any:
    """``cls(**data)`` for a manifest dataclass, naming the entry that does not fit."""
    if not isinstance(data, dict):
        raise ValueError(f"'{where}' must be an object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)} - {"directory"}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown entries {unknown} in '{where}'")
    required = {
        f.name
        for f in fields(cls)
        if f.default is MISSING and f.default_factory is MISSING and f.name != "directory"
    }
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"missing entries {missing} in '{where}'")
    return cls(**data)


def _check_types(manifest: StageManifest) -> None:
    for name in ("global_step", "tokens_seen", "start_step"):
        value = getattr(manifest, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"'{name}' must be an integer, got {value!r}")
    for name, value in (
        ("weights.sha256", manifest.weights.sha256),
        ("tokenizer.sha256", manifest.tokenizer.sha256),
        ("config_sha256", manifest.config_sha256),
    ):
        if not isinstance(value, str) or len(value) != 64:
            raise ValueError(f"'{name}' must be a hex SHA-256, got {value!r}")
    if not isinstance(manifest.model, dict) or not isinstance(manifest.config, dict):
        raise ValueError("'model' and 'config' must be objects")


def read_manifest(
    path: str | os.PathLike, *, stage: str | None = None, verify: bool = True
) -> StageManifest:
    """Read and check a stage manifest.

    Args:
        path: ``manifest.json`` or the stage folder holding it.
        stage: how the caller names the stage in errors (default: the manifest's own).
        verify: also check that the weights, tokenizer and checkpoint files exist and
            that the weights and tokenizer match their recorded SHA-256.

    Raises:
        CheckpointError: naming the stage, the file and the reason, for a missing or
            unparsable file, a newer format, missing entries, a missing file it refers
            to, or a checksum mismatch.
    """
    source = Path(path)
    if source.is_dir():
        source = source / MANIFEST_NAME
    label = stage or "?"

    def fail(reason: str) -> CheckpointError:
        return CheckpointError(f"stage {label}: manifest '{source}': {reason}")

    if not source.is_file():
        raise fail("no such file")
    try:
        data = json.loads(source.read_text(), object_hook=untag_float)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise fail(f"not readable JSON ({err})") from err
    if not isinstance(data, dict):
        raise fail("not a JSON object")
    label = stage or str(data.get("stage", "?"))
    version = data.get("format_version")
    if not isinstance(version, int) or version > MANIFEST_FORMAT_VERSION:
        raise fail(
            f"format_version={version!r}; this recipes_lib reads up to {MANIFEST_FORMAT_VERSION}"
        )
    try:
        data = dict(data)
        data["weights"] = _build(FileRef, data.get("weights"), "weights")
        data["tokenizer"] = _build(FileRef, data.get("tokenizer"), "tokenizer")
        data["metrics"] = _build(StageMetrics, data.get("metrics", {}), "metrics")
        manifest = _build(StageManifest, data, "manifest")
        _check_types(manifest)
    except (TypeError, ValueError) as err:
        raise fail(str(err)) from err
    manifest.directory = source.parent
    if verify:
        verify_manifest(manifest, source, label)
    return manifest


def _retrain_advice(manifest: StageManifest, source: Path) -> str:
    """How to train a stage whose outputs are damaged again. The runner reads and verifies
    the manifest in a stage folder before it looks at on_change, so on_change=rerun alone
    stops at the same error; without the folder the stage is simply not trained yet, and
    on_change=rerun then retrains the stages that started from it too."""
    folder = source.parent
    return (
        f"to train stage {manifest.stage} again, move its folder '{folder}' aside (rename it, "
        f"e.g. to '{folder}.old') and run its pipeline again with on_change=rerun"
    )


def verify_manifest(manifest: StageManifest, source: Path, label: str) -> None:
    """Check that the files a manifest names exist and match their checksums.

    Raises:
        CheckpointError: naming the stage, the file and the reason, and how to train the
            stage again.
    """
    for what, ref in (("weights", manifest.weights), ("tokenizer", manifest.tokenizer)):
        file = manifest.resolve(ref.path)
        if not file.is_file():
            raise CheckpointError(
                f"stage {label}: manifest '{source}': its {what} file '{file}' is missing; "
                + _retrain_advice(manifest, source)
            )
        actual = sha256_file(file)
        if actual != ref.sha256:
            raise CheckpointError(
                f"stage {label}: manifest '{source}': checksum mismatch for {what} '{file}' "
                f"(recorded sha256 {ref.sha256[:16]}..., file has {actual[:16]}...): it "
                "changed after the stage wrote it; " + _retrain_advice(manifest, source)
            )
    checkpoint = manifest.checkpoint_path
    if checkpoint is not None and not checkpoint.is_file():
        raise CheckpointError(
            f"stage {label}: manifest '{source}': its checkpoint '{checkpoint}' is missing; "
            + _retrain_advice(manifest, source)
        )
