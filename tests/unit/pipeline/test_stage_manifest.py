"""Stage manifests: written atomically, read back equal, and refused when they lie."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from pipeline_helpers import complete_without_training, fake_manifest, make_pipeline

from recipes_lib.checkpoint.manifest import (
    MANIFEST_FORMAT_VERSION,
    MANIFEST_NAME,
    read_manifest,
    write_manifest,
)
from recipes_lib.errors import CheckpointError
from recipes_lib.pipeline import plan_pipeline


def test_round_trip_and_relative_paths(tmp_path):
    written = fake_manifest(tmp_path / "pretrain", last_lr=1.5e-4, global_step=7)
    text = (tmp_path / "pretrain" / MANIFEST_NAME).read_text()
    assert json.loads(text)["weights"]["path"] == "model.safetensors"  # relative to its folder
    assert not list((tmp_path / "pretrain").glob(".*partial"))  # nothing half-written left

    read = read_manifest(tmp_path / "pretrain")
    assert read == written
    assert read.format_version == MANIFEST_FORMAT_VERSION
    assert (read.global_step, read.last_lr) == (7, 1.5e-4)
    assert read.weights_path == tmp_path / "pretrain" / "model.safetensors"

    # the folder moves as a whole: paths resolve against the manifest's new place
    shutil.move(tmp_path / "pretrain", tmp_path / "moved")
    moved = read_manifest(tmp_path / "moved" / MANIFEST_NAME)
    assert moved.weights_path == tmp_path / "moved" / "model.safetensors"
    assert moved.tokenizer_path.is_file()


def test_a_folders_infinite_config_value_is_written_as_strict_json_and_read_back(tmp_path):
    """A fallback stage's model config carries its folder's config.json, whose infinite
    values (Falcon-H1's time_step_limit) the manifest tags as transformers does."""
    from dataclasses import replace

    from pipeline_helpers import tiny_model

    hf_config = {"model_type": "falcon_h1", "time_step_limit": [0.0, math.inf]}
    written = fake_manifest(tmp_path / "sft", model=replace(tiny_model(), hf_config=hf_config))
    saved = json.loads((tmp_path / "sft" / MANIFEST_NAME).read_text())
    assert saved["model"]["hf_config"]["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    read = read_manifest(tmp_path / "sft")
    assert read.model["hf_config"]["time_step_limit"] == [0.0, math.inf]
    assert read == written


def test_checksum_mismatch_names_stage_file_and_reason(tmp_path):
    fake_manifest(tmp_path / "cpt", stage="cpt")
    weights = tmp_path / "cpt" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        read_manifest(tmp_path / "cpt")
    message = str(info.value)
    assert "stage cpt" in message
    assert str(tmp_path / "cpt" / MANIFEST_NAME) in message
    assert "checksum mismatch" in message and str(weights) in message
    read_manifest(tmp_path / "cpt", verify=False)  # reading without the check still works


def test_missing_files_and_bad_content_are_refused(tmp_path):
    fake_manifest(tmp_path / "a", stage="a")
    (tmp_path / "a" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"stage a: .*tokenizer file .* is missing"):
        read_manifest(tmp_path / "a")

    fake_manifest(tmp_path / "b", stage="b")
    with pytest.raises(CheckpointError, match="no such file"):
        read_manifest(tmp_path / "nowhere", stage="b")

    path = tmp_path / "b" / MANIFEST_NAME
    data = json.loads(path.read_text())
    for change, match in (
        ({"format_version": MANIFEST_FORMAT_VERSION + 1}, "format_version"),
        ({"global_step": "ten"}, "global_step"),
        ({"surprise": 1}, r"unknown entries \['surprise'\]"),
    ):
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(CheckpointError, match=match):
            read_manifest(path)
    del data["weights"]
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="weights"):
        read_manifest(path)
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"stage \?: .*not readable JSON"):
        read_manifest(path)


def test_missing_checkpoint_is_refused(tmp_path):
    manifest = fake_manifest(tmp_path / "a", stage="a")
    manifest.checkpoint = "checkpoints/last.ckpt"
    write_manifest(manifest, tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"checkpoint .*last\.ckpt' is missing"):
        read_manifest(tmp_path / "a")


def test_checksum_mismatch_says_how_to_train_the_stage_again_and_that_works(tmp_path):
    stages = {"pretrain": {"recipe": "pretrain/tiny"}, "anneal": {"recipe": "anneal/tiny"}}
    spec = make_pipeline(tmp_path, stages)
    manifests = {}
    complete_without_training(spec, "pretrain", manifests)
    complete_without_training(spec, "anneal", manifests)
    folder = spec.dir / "pretrain"
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        plan_pipeline(spec)
    message = str(info.value)
    assert "stage pretrain" in message and "checksum mismatch" in message
    assert f"move its folder '{folder}' aside" in message and "on_change=rerun" in message
    # on_change=rerun alone does not get past the damaged manifest
    rerun = make_pipeline(tmp_path, stages, on_change="rerun")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        plan_pipeline(rerun)

    # the advice followed: the stage trains again, and the stage after it with it
    folder.rename(tmp_path / "pipe" / "pretrain.old")
    assert [p.action for p in plan_pipeline(rerun)] == ["train", "rerun"]
