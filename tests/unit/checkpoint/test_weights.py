import hashlib
import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from tiny import tiny_model_config

from recipes_lib.checkpoint import weights
from recipes_lib.checkpoint.weights import (
    TIED_METADATA_KEY,
    average_checkpoints,
    list_step_checkpoints,
    load_state_into,
    load_weights,
    save_weights,
    sha256_file,
)
from recipes_lib.errors import CheckpointError
from recipes_lib.models import Transformer


def tiny_transformer(seed: int = 0, **overrides) -> Transformer:
    config = tiny_model_config(**{"n_kv_heads": None, **overrides})
    torch.manual_seed(seed)
    return Transformer(config)


def lightning_checkpoint(path, state: dict[str, torch.Tensor], step: int):
    torch.save(
        {"global_step": step, "state_dict": {f"model.{k}": v for k, v in state.items()}}, path
    )
    return path


def test_round_trip_keeps_names_values_and_dtypes(tmp_path):
    state = {
        "a": torch.randn(3, 4),
        "b": torch.arange(6, dtype=torch.int64),
        "c": torch.randn(5, dtype=torch.float64).to(torch.bfloat16),
        "transposed": torch.randn(4, 3).t(),  # not contiguous
    }
    path = save_weights(state, tmp_path / "sub" / "w.safetensors", metadata={"step": "7"})
    loaded = load_weights(path)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["step"] == "7"
        assert f.metadata()["format"] == "pt"
    assert load_weights(tmp_path / "sub" / "w.safetensors").keys() == state.keys()


def test_tied_weights_are_stored_once_and_load_back_tied(tmp_path):
    model = tiny_transformer(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    path = save_weights(model.state_dict(), tmp_path / "model.safetensors")
    with safe_open(str(path), framework="pt") as f:
        stored = set(f.keys())
        tied = json.loads(f.metadata()[TIED_METADATA_KEY])
    assert len(stored) == len(model.state_dict()) - 1
    assert tied == {"output.weight": "tok_embeddings.weight"}

    loaded = load_weights(tmp_path)  # a folder holding model.safetensors
    assert loaded.keys() == model.state_dict().keys()
    assert torch.equal(loaded["output.weight"], model.tok_embeddings.weight)

    fresh = tiny_transformer(seed=1, tie_embeddings=True)
    assert not torch.equal(fresh.tok_embeddings.weight, model.tok_embeddings.weight)
    load_state_into(fresh, loaded, "test")
    assert fresh.output.weight is fresh.tok_embeddings.weight
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_partially_overlapping_tensors_are_saved_as_copies(tmp_path):
    base = torch.arange(12.0)
    state = {"whole": base, "head": base[:4], "view": base.view(3, 4)}
    loaded = load_weights(save_weights(state, tmp_path / "w.safetensors"))
    assert torch.equal(loaded["head"], base[:4])
    assert torch.equal(loaded["view"], base.view(3, 4))


def test_sha256_matches_hashlib_and_changes_with_content(tmp_path):
    path = tmp_path / "blob.bin"
    data = bytes(range(256)) * 5000  # larger than one read chunk at chunk_size=4096
    path.write_bytes(data)
    assert sha256_file(path, chunk_size=4096) == hashlib.sha256(data).hexdigest()
    path.write_bytes(data[:-1] + b"\x00")
    assert sha256_file(path) != hashlib.sha256(data).hexdigest()
    with pytest.raises(CheckpointError, match="missing.bin"):
        sha256_file(tmp_path / "missing.bin")


def test_average_of_three_checkpoints_is_the_elementwise_mean(tmp_path):
    model = tiny_transformer(tie_embeddings=True)
    states, paths = [], []
    for i in range(3):
        torch.manual_seed(10 + i)
        state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        state["output.weight"] = state["tok_embeddings.weight"]  # tied, as the module saves it
        states.append(state)
        paths.append(lightning_checkpoint(tmp_path / f"step{i}.ckpt", state, step=i))

    averaged = average_checkpoints(paths)
    assert averaged.keys() == model.state_dict().keys()
    for name in averaged:
        expected = torch.stack([s[name] for s in states]).mean(dim=0)
        assert averaged[name].dtype == torch.float32
        torch.testing.assert_close(averaged[name], expected, atol=1e-6, rtol=0)
    assert averaged["output.weight"] is averaged["tok_embeddings.weight"]
    # the average differs from each of its inputs
    assert not torch.allclose(averaged["norm.weight"], states[-1]["norm.weight"])


def test_average_of_bf16_checkpoints_is_computed_in_fp32(tmp_path):
    values = [
        torch.tensor([1.0, 2.0]),
        torch.tensor([1.0078125, 2.0]),
        torch.tensor([1.0, 2.015625]),
    ]
    paths = [
        lightning_checkpoint(tmp_path / f"{i}.ckpt", {"w": v.to(torch.bfloat16)}, i)
        for i, v in enumerate(values)
    ]
    averaged = average_checkpoints(paths)["w"]
    assert averaged.dtype == torch.float32
    torch.testing.assert_close(averaged, torch.stack(values).mean(0), atol=1e-7, rtol=0)


def test_average_refuses_checkpoints_that_differ(tmp_path):
    a = lightning_checkpoint(tmp_path / "a.ckpt", {"w": torch.zeros(2, 3)}, 1)
    b = lightning_checkpoint(tmp_path / "b.ckpt", {"w": torch.zeros(3, 2)}, 2)
    c = lightning_checkpoint(tmp_path / "c.ckpt", {"v": torch.zeros(2, 3)}, 3)
    with pytest.raises(CheckpointError, match=r"w: checkpoint \(3, 2\) vs model \(2, 3\)"):
        average_checkpoints([a, b])
    with pytest.raises(CheckpointError, match="missing: w"):
        average_checkpoints([a, c])
    with pytest.raises(CheckpointError, match="at least one"):
        average_checkpoints([])
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        average_checkpoints([a, tmp_path / "gone.ckpt"])


def test_failed_write_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "model.safetensors"
    save_weights({"w": torch.ones(4)}, target)
    before = target.read_bytes()

    def write_half_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 10)
        raise OSError("disk full")

    monkeypatch.setattr(weights, "save_file", write_half_then_fail)
    with pytest.raises(CheckpointError, match="disk full"):
        save_weights({"w": torch.zeros(4)}, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

    with pytest.raises(CheckpointError, match="'step' is a int"):
        save_weights({"w": torch.zeros(4), "step": 3}, tmp_path / "other.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_load_weights_reads_lightning_checkpoints_and_rejects_bad_files(tmp_path):
    state = {"w": torch.randn(2, 2), "b": torch.randn(2)}
    loaded = load_weights(lightning_checkpoint(tmp_path / "x.ckpt", state, 5))
    assert loaded.keys() == state.keys()
    assert torch.equal(loaded["w"], state["w"])
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        load_weights(tmp_path / "bad.safetensors")
    (tmp_path / "bad.ckpt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a loadable torch checkpoint"):
        load_weights(tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_weights(tmp_path / "empty_dir_without_weights")


def test_load_state_into_lists_the_first_mismatches():
    small, wide = tiny_transformer(), tiny_transformer(dim=64, n_heads=4)
    state = small.state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["norm.weight"]
    with pytest.raises(CheckpointError) as info:
        load_state_into(wide, state, "stage.init_from='x'")
    message = str(info.value)
    assert message.startswith("stage.init_from='x' does not fit the configured model")
    assert "tok_embeddings.weight: checkpoint (64, 32) vs model (64, 64)" in message
    assert "1 missing: norm.weight" in message
    assert "1 unexpected: extra.weight" in message
    mismatched = int(message.split(" does not fit the configured model: ")[1].split()[0])
    assert mismatched > 5
    assert message.count(";") == 4  # only the first five shape mismatches are named


def test_list_step_checkpoints_orders_by_step_and_skips_last(tmp_path):
    for step in (12, 4, 8):
        lightning_checkpoint(tmp_path / f"step{step:06d}.ckpt", {"w": torch.zeros(1)}, step)
    lightning_checkpoint(tmp_path / "last.ckpt", {"w": torch.zeros(1)}, 12)
    found = list_step_checkpoints(tmp_path)
    assert [s for s, _ in found] == [4, 8, 12]
    assert [p.name for _, p in found] == ["step000004.ckpt", "step000008.ckpt", "step000012.ckpt"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_weights_follow_the_umask(tmp_path, umask):
    # safetensors creates its file 0600; a renamed-into-place output kept that mode
    previous = os.umask(umask)
    try:
        path = save_weights({"a": torch.zeros(2)}, tmp_path / "model.safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
