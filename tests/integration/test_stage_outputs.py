"""A finished run writes its output weights: final, averaged over checkpoints, or an EMA."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import tiny_overrides
from lightning.pytorch.callbacks import Callback
from tiny import StopAtStep

from recipes_lib.checkpoint.weights import load_weights, read_checkpoint, sha256_file
from recipes_lib.config import compose_config
from recipes_lib.errors import ConfigError
from recipes_lib.train import run


def checkpoint_weights(path) -> dict[str, torch.Tensor]:
    state = read_checkpoint(path)["state_dict"]
    return {k.removeprefix("model."): v.clone() for k, v in state.items()}


def test_average_of_the_last_three_checkpoints_is_the_output(tiny_cfg):
    result = run(tiny_cfg("stage.average_last_k=3", "run.checkpoint_every_n_steps=4"))
    assert result.global_step == 16
    assert [p.name for p in result.averaged_from] == [
        "step000008.ckpt",
        "step000012.ckpt",
        "step000016.ckpt",
    ]
    assert result.weights_path == result.output_dir / "model.safetensors"
    steps = [checkpoint_weights(p) for p in result.averaged_from]
    for p in result.averaged_from:
        assert read_checkpoint(p)["global_step"] == int(p.stem.removeprefix("step"))
    output = load_weights(result.weights_path)
    assert output.keys() == steps[0].keys()
    for name, value in output.items():
        expected = torch.stack([s[name] for s in steps]).mean(dim=0)
        torch.testing.assert_close(value, expected, atol=1e-6, rtol=0)
    final = checkpoint_weights(result.last_checkpoint)
    assert not torch.allclose(output["norm.weight"], final["norm.weight"])
    # the last k step checkpoints stay for the average (retention keeps at least k; the
    # run's run.keep_last_checkpoints is 2 by default)
    names = sorted(p.name for p in (result.output_dir / "checkpoints").glob("step*.ckpt"))
    assert names == [f"step{s:06d}.ckpt" for s in (8, 12, 16)]


class ModelSize(Callback):
    """The model's elements, gradients included, when the fit ends (after Lightning's
    teardown)."""

    elements: int | None = None

    def on_fit_end(self, trainer, pl_module) -> None:
        tensors = [*pl_module.parameters(), *pl_module.buffers()]
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.elements = sum(t.numel() for t in tensors + grads)


def test_final_weights_are_the_output_by_default(tiny_cfg):
    size = ModelSize()
    result = run(tiny_cfg(), callbacks=[size])
    assert size.elements == 0  # written from the device, then freed: no copy at teardown
    assert result.averaged_from == []
    output = load_weights(result.weights_path)
    final = checkpoint_weights(result.last_checkpoint)
    assert output.keys() == final.keys()
    for name, value in output.items():
        assert torch.equal(value, final[name]), name
    assert len(sha256_file(result.weights_path)) == 64


def test_ema_output_resumes_exactly(tmp_path, shared_cache):
    settings = ("stage.ema_decay=0.8", "model.tie_embeddings=true")
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight = run(compose_config(tiny_overrides(straight_dir, shared_cache, *settings)))
    straight_output = load_weights(straight.weights_path)
    final = checkpoint_weights(straight.last_checkpoint)
    assert not torch.allclose(straight_output["norm.weight"], final["norm.weight"])
    assert torch.equal(straight_output["output.weight"], straight_output["tok_embeddings.weight"])

    size = ModelSize()
    stopped = run(
        compose_config(tiny_overrides(split_dir, shared_cache, *settings)),
        callbacks=[StopAtStep(8), size],
    )
    assert stopped.global_step == 8
    assert size.elements > 0  # nothing written, nothing freed
    assert stopped.weights_path is None  # an unfinished stage has no output
    assert not (split_dir / "run" / "model.safetensors").exists()
    resumed = run(
        compose_config(tiny_overrides(split_dir, shared_cache, *settings, "run.ckpt_path=last"))
    )
    resumed_output = load_weights(resumed.weights_path)
    for name, value in straight_output.items():
        torch.testing.assert_close(resumed_output[name], value, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("stage.average_last_k=5", "run.checkpoint_every_n_steps=4"), "save only 4"),
        (("stage.average_last_k=2", "run.checkpoint_every_n_steps=5"), "not a multiple"),
        (("stage.average_last_k=2", "~callbacks.checkpoint"), "no ModelCheckpoint"),
        (("stage.average_last_k=2", "stage.ema_decay=0.9"), "set one of them"),
    ],
)
def test_averaging_that_cannot_happen_stops_before_training(tiny_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run(tiny_cfg(*overrides))


def test_a_run_resumed_at_its_final_step_still_writes_its_output(tiny_cfg):
    """Killed after its last checkpoint but before the export: rerun, it restores the
    final step (no step runs, and Lightning calls no on_train_end) and writes the
    output from the restored weights."""
    first = run(tiny_cfg())
    final = checkpoint_weights(first.last_checkpoint)
    first.weights_path.unlink()  # as if the process died before writing it
    again = run(tiny_cfg("run.ckpt_path=last"))
    assert again.global_step == first.global_step and again.weights_path.is_file()
    output = load_weights(again.weights_path)
    for name, value in output.items():
        assert torch.equal(value, final[name]), name
