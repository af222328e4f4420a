"""Which checkpoint a run resumes: the newest one that verifies.

``run.ckpt_path=last`` and a pipeline's resume both call :func:`newest_good_checkpoint`
on the run's ``checkpoints/`` folder. It lists every checkpoint there (step files,
sharded folders, ``last.ckpt`` when it is a copy rather than a link, a link to a
checkpoint elsewhere, followed), newest step first, and checks each in turn
(:func:`check_checkpoint`) until one passes. A newer one that fails is moved aside
(``<name>.corrupt-<time>``, never deleted) with one line naming it, what is wrong and
the checkpoint used instead.

Every process of a multi-process launch makes the same choice on its own (the process
group does not exist yet): each checks the same files, and only global rank 0 moves
anything. A checkpoint that another rank has just moved aside reads as missing, which
is the same verdict.

What a run resumes at all: :func:`auto_resume` turns a rerun of the same command (its
``run.dir`` holds checkpoints and a ``config.yaml`` of the same config) into
``run.ckpt_path=last`` and refuses a changed config with the keys that changed;
:func:`resolve_ckpt_path` turns ``run.ckpt_path`` into the checkpoint to load. A run
with nothing to resume where something was (checkpoints moved aside as corrupt, a
``last.ckpt`` linking to nothing) says in one line that it starts from step 0, and why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

from recipes_lib.checkpoint.integrity import verify_checkpoint
from recipes_lib.checkpoint.layout import (
    CHECKSUM_SUFFIX,
    PARTIAL_SUFFIX,
    RunDir,
    checksum_sidecar,
)
from recipes_lib.checkpoint.sharded import SHARDED_METADATA_NAME, is_sharded_checkpoint
from recipes_lib.checkpoint.weights import listed_step, read_checkpoint
from recipes_lib.config import RunConfig
from recipes_lib.config.fingerprint import recorded_config_changes
from recipes_lib.errors import CheckpointError, ConfigError, CorruptCheckpointError
from recipes_lib.files import global_rank, move_aside

log = logging.getLogger(__name__)


def _check_unrecorded_folder(folder: Path) -> None:
    """A sharded folder without checksums (written before them): its metadata files load
    and every shard its ``.metadata`` names is there, at least as long as it says."""
    from torch.distributed.checkpoint import FileSystemReader

    read_checkpoint(folder / SHARDED_METADATA_NAME, verify=False)
    metadata = FileSystemReader(folder).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file():
            raise CorruptCheckpointError(folder, f"lacks {name}, which its .metadata lists")
        if shard.stat().st_size < end:
            size = shard.stat().st_size
            raise CorruptCheckpointError(folder, f"has {name} truncated: {size:,} of {end:,} bytes")


def check_checkpoint(path: str | os.PathLike) -> bool:
    """Check that ``path`` (a checkpoint file, a sharded folder, or a link to either) can be
    resumed.

    With a checksum record: every file against it. Without one (checkpoints written
    before checksums were recorded still resume): a file must load as a torch
    checkpoint, a sharded folder's metadata must load and name shards that are all
    there; a bit flipped inside tensor data goes unnoticed then. A DeepSpeed folder,
    which has no record, is taken as it is.

    Returns:
        True when checked against a checksum record, False when only by loading.

    Raises:
        CheckpointError: ``path`` does not exist.
        CorruptCheckpointError: what is wrong with it, in one line.
    """
    target = Path(path)
    if verify_checkpoint(target):
        return True
    real = target.resolve()
    try:
        if is_sharded_checkpoint(real):
            _check_unrecorded_folder(real)
        elif real.is_file():
            read_checkpoint(real, verify=False)
    except CorruptCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever torch raises for a torn file
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        problem = f"has no checksum and does not load: {first_line}"
        raise CorruptCheckpointError(target, problem) from err
    return False


def _candidates(folder: Path, at_most_step: int | None) -> list[Path]:
    """Every checkpoint in ``folder`` (up to ``at_most_step``), the newest step first
    (``last.ckpt`` before a step checkpoint of the same step; one whose step cannot be
    told, last). A link to a checkpoint elsewhere is followed; one to a checkpoint in
    ``folder`` is left out (``last.ckpt`` as a link is the step checkpoint it points
    at), and so is one to nothing."""
    ranked = []
    here = folder.resolve()
    for path in folder.glob("*.ckpt"):
        if not path.exists() or (path.is_symlink() and path.resolve().parent == here):
            continue
        is_last = path.name.startswith("last")
        step = listed_step(path)
        if step is None:  # a last.ckpt that cannot be read was the newest when written
            step = 2**62 if is_last else -1
        if at_most_step is not None and step > at_most_step:
            continue
        ranked.append(((step, is_last, path.name), path))
    return [path for _, path in sorted(ranked, key=lambda item: item[0], reverse=True)]


def move_aside_corrupt(path: Path) -> Path:
    """Rename a checkpoint that failed verification, and its checksum sidecar, to
    ``<name>.corrupt-<time>``; returns the new name of the checkpoint."""
    moved = move_aside(path, "corrupt")
    sidecar = checksum_sidecar(path)
    if sidecar.exists():
        move_aside(sidecar, "corrupt")
    return moved


def remove_unfinished_writes(folder: str | os.PathLike) -> list[Path]:
    """Remove what an interrupted run left half-written in ``folder`` (hidden
    ``.*.partial`` files and sharded folders, never renamed into place, so never a
    checkpoint), in one line naming them; call it only while holding the run folder's
    lock (:mod:`~recipes_lib.checkpoint.run_lock`), before this run writes there."""
    directory = Path(folder)
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(directory.glob(f".*{PARTIAL_SUFFIX}")):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        names = ", ".join(p.name for p in removed)
        log.info("removed what an interrupted write left in %s: %s", directory, names)
    return removed


def newest_good_checkpoint(
    folder: str | os.PathLike, move_bad: bool | None = None, at_most_step: int | None = None
) -> Path | None:
    """The newest checkpoint in ``folder`` that passes :func:`check_checkpoint`, or None
    when there is none at all (``at_most_step``: of those saved at that step or before,
    as a rollback needs).

    Newer ones that fail are moved aside (by global rank 0 unless ``move_bad`` says
    otherwise), each logged (by rank 0) in one line with the checkpoint used instead.

    Raises:
        CorruptCheckpointError: checkpoints are there but none passes (they are moved
            aside too, and named).
    """
    directory = Path(folder)
    if not directory.is_dir():
        return None
    rank_zero = global_rank() == 0
    if move_bad is None:
        move_bad = rank_zero
    failed: list[tuple[Path, str, Path | None]] = []
    chosen = None
    for path in _candidates(directory, at_most_step):
        try:
            check_checkpoint(path)
        except CheckpointError as err:
            problem = err.problem if isinstance(err, CorruptCheckpointError) else str(err)
            failed.append((path, problem, move_aside_corrupt(path) if move_bad else None))
            continue
        chosen = path
        break
    for path, problem, moved in failed if rank_zero else ():
        aside = f"moved aside to {moved.name}" if moved is not None else "left in place"
        if chosen is None:
            log.warning("checkpoint %s %s; %s", path, problem, aside)
        else:
            log.warning(
                "checkpoint %s %s; %s; resuming from %s (step %s)",
                path,
                problem,
                aside,
                chosen,
                listed_step(chosen),
            )
    if chosen is None and failed:
        names = ", ".join(p.name for p, _, _ in failed)
        aside = ", each moved aside" if move_bad else ""
        raise CorruptCheckpointError(
            directory,
            f"holds no checkpoint that verifies ({names} failed{aside}); start afresh in "
            "another run.dir, or name a checkpoint with run.ckpt_path=PATH",
        )
    return chosen


def resume_checkpoint(folder: str | os.PathLike) -> Path | None:
    """What ``run.ckpt_path=last`` (and a pipeline's resume) starts from: the newest
    checkpoint in ``folder`` that verifies; None when there is none yet. (What an
    interrupted write left is removed by the run once it holds its folder.)

    Raises:
        CorruptCheckpointError: checkpoints are there but none verifies.
    """
    return newest_good_checkpoint(folder)


def afresh_reason(folder: str | os.PathLike) -> str | None:
    """Why a run folder's ``checkpoints/`` that looks used holds nothing to resume: its
    checkpoints moved aside as corrupt, links to nothing; None when it looks unused."""
    directory = Path(folder)
    if not directory.is_dir():
        return None
    reasons = []
    corrupt = sorted(
        p.name
        for p in directory.glob("*.corrupt-*")
        if CHECKSUM_SUFFIX not in p.name  # a sidecar goes with its checkpoint
    )
    if corrupt:
        reasons.append(f"its checkpoints were moved aside as corrupt ({', '.join(corrupt)})")
    dangling = sorted(p for p in directory.glob("*.ckpt") if p.is_symlink() and not p.exists())
    for link in dangling:
        reasons.append(f"{link.name} links to {os.readlink(link)}, which is not there")
    return "; ".join(reasons) or None


# ------------------------------------------------------------- a run's resume point


def resolve_ckpt_path(cfg: RunConfig) -> str | None:
    """``run.ckpt_path`` as the checkpoint to resume: ``last`` is the newest one in the
    run's folder that verifies (None before the first); a named one must verify (no
    fallback: the error names it)."""
    path = cfg.run.ckpt_path
    if path is None or path in ("hpc", "best"):
        return path
    if path == "last":
        folder = RunDir(cfg.run.dir).checkpoints
        found = resume_checkpoint(folder)
        if found is None and global_rank() == 0:
            why = afresh_reason(folder) or "it holds no checkpoint yet"
            log.warning("run.ckpt_path=last: starting from step 0: %s: %s", folder, why)
        return str(found) if found is not None else None
    if not (Path(path).is_file() or is_sharded_checkpoint(path)):
        raise CheckpointError(
            f"run.ckpt_path: '{path}' is neither a checkpoint file nor a sharded checkpoint folder"
        )
    try:
        check_checkpoint(path)
    except CorruptCheckpointError as err:
        raise CheckpointError(f"run.ckpt_path: {err}") from err
    return path


def auto_resume(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``run.ckpt_path=last`` when it is a rerun: ``run.dir`` holds checkpoints
    and the config its ``config.yaml`` records, less location keys (as a pipeline compares
    its stages). A run is never started afresh over checkpoints.

    Raises:
        ConfigError: the config changed (the keys listed).
        CheckpointError: there are checkpoints but no recorded config.
    """
    run_dir = RunDir(cfg.run.dir)
    if cfg.run.ckpt_path is not None:
        return cfg
    if not run_dir.has_checkpoints():
        why = afresh_reason(run_dir.checkpoints)
        if why is not None and global_rank() == 0:
            log.warning("run.dir=%s: starting from step 0: %s", cfg.run.dir, why)
        return cfg
    afresh = "start afresh with another run.dir (or run.name)"
    if not run_dir.config.is_file():
        raise CheckpointError(
            f"run.dir={cfg.run.dir} holds checkpoints but no {run_dir.config.name} to compare "
            f"the config with; resume them with run.ckpt_path=last, or {afresh}"
        )
    changes = recorded_config_changes(cfg, run_dir.config)
    if changes:
        raise ConfigError(
            f"run.dir={cfg.run.dir} holds checkpoints of another config ({'; '.join(changes)}); "
            f"rerun with that config to resume, resume anyway with run.ckpt_path=last, or {afresh}"
        )
    log.info("run.dir=%s holds checkpoints of this config: resuming the newest", cfg.run.dir)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, ckpt_path="last"))
