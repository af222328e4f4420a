"""SFT end to end on the built-in standard-library instructions, full and with LoRA."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from integration_helpers import metric_series, read_metrics, tiny_overrides
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.chat.module import build_chat_data
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.train import run


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, shared_cache):
    """A 16-step pretraining run of the tiny model: its output weights and tokenizer."""
    root = tmp_path_factory.mktemp("pretrain")
    return run(compose_config(tiny_overrides(root, shared_cache)))


def sft_overrides(tmp_path, pretrained, recipe: str, *extra: str) -> list[str]:
    return [
        f"recipe={recipe}",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"stage.init_from={pretrained.weights_path}",
        f"data.tokenizer.path={pretrained.tokenizer_path}",
        "data.sources.stdlib_sft.max_documents=240",
        "data.chat.truncation=left",
        "data.seq_len=128",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        *SMALL_VOCAB_OVERRIDES,
        "trainer.max_steps=30",
        "trainer.val_check_interval=10",
        "trainer.limit_val_batches=4",
        "trainer.log_every_n_steps=1",
        *QUIET_OVERRIDES,
        "scheduler.warmup=3",
        "run.checkpoint_every_n_steps=30",
        "callbacks=minimal",
        *extra,
    ]


def _val_losses(run_dir) -> list[float]:
    return [loss for _, loss in metric_series(read_metrics(run_dir), "val/loss")]


def test_sft_lowers_the_held_out_loss_on_assistant_tokens(tmp_path, pretrained):
    result = run(compose_config(sft_overrides(tmp_path, pretrained, "sft/tiny")))
    assert result.global_step == 30
    losses = _val_losses(result.output_dir)
    assert len(losses) == 3
    assert losses[-1] < losses[0] - 0.1, losses
    rows = read_metrics(result.output_dir)
    trained = [v for _, v in metric_series(rows, "train/assistant_tokens")]
    assert trained and all(0 < v <= 4 * 128 for v in trained)
    output = load_weights(result.weights_path)
    assert not any("lora" in k for k in output)
    assert not (result.output_dir / "adapter").exists()


def test_an_adapter_folder_that_fails_loses_none_of_the_merged_weights(
    tmp_path, pretrained, monkeypatch
):
    """The merged weights are written before the adapter folder; a folder that cannot be
    written is one clear error that says where the weights are."""

    def refuse(model, out_dir, *args, **kwargs):
        raise CheckpointError(f"cannot save an adapter to {out_dir}: a test's refusal")

    monkeypatch.setattr("recipes_lib.training.outputs.save_adapter", refuse)
    overrides = sft_overrides(tmp_path, pretrained, "sft/lora_tiny", "trainer.max_steps=2")
    weights = tmp_path / "run" / "model.safetensors"
    with pytest.raises(CheckpointError, match="a test's refusal; the merged weights are wr"):
        run(compose_config([*overrides, "trainer.val_check_interval=null", "scheduler.warmup=1"]))
    assert set(load_weights(weights)) == set(load_weights(pretrained.weights_path))
    assert not (tmp_path / "run" / "adapter").exists()


def test_lora_sft_trains_adapters_and_exports_merged_weights(tmp_path, pretrained):
    result = run(
        compose_config(
            sft_overrides(tmp_path, pretrained, "sft/lora_tiny", "adapter.r=4", "optim.lr=1e-2")
        )
    )
    assert result.global_step == 30
    losses = _val_losses(result.output_dir)
    assert losses[-1] < losses[0] - 0.05, losses

    base = load_weights(pretrained.weights_path)
    merged = load_weights(result.weights_path)
    assert merged.keys() == base.keys()  # plain Transformer weights: base + B @ A * scale
    assert torch.equal(merged["tok_embeddings.weight"], base["tok_embeddings.weight"])
    assert torch.equal(
        merged["layers.0.attention_norm.weight"], base["layers.0.attention_norm.weight"]
    )
    assert not torch.allclose(
        merged["layers.0.attention.wq.weight"], base["layers.0.attention.wq.weight"]
    )

    adapter = result.output_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and "q_proj" in config["target_modules"]
    factors = load_weights(adapter / "adapter_model.safetensors")
    a = factors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = factors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    scale = config["lora_alpha"] / config["r"]
    torch.testing.assert_close(
        merged["layers.0.attention.wq.weight"],
        base["layers.0.attention.wq.weight"] + scale * b @ a,
    )


def test_qlora_on_cpu_fails_before_training(tmp_path, pretrained):
    if torch.cuda.is_available():
        pytest.skip("checks the message where CUDA is missing")
    cfg = compose_config(sft_overrides(tmp_path, pretrained, "sft/tiny", "adapter=qlora"))
    with pytest.raises(ConfigError, match="adapter.kind=qlora needs"):
        run(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_tokenizer_comes_from_beside_the_init_weights(tmp_path, pretrained):
    overrides = [
        o for o in sft_overrides(tmp_path, pretrained, "sft/tiny") if "tokenizer.path" not in o
    ]
    alone = tmp_path / "alone"  # the weights without the tokenizer a run writes beside them
    alone.mkdir()
    shutil.copyfile(pretrained.weights_path, alone / "model.safetensors")
    with pytest.raises(
        ConfigError, match="has no tokenizer.json beside it; set data.tokenizer.path"
    ):
        run(
            compose_config([o.replace(str(pretrained.weights_path), str(alone)) for o in overrides])
        )
    stage_dir = tmp_path / "stage"
    stage_dir.mkdir()
    shutil.copyfile(pretrained.weights_path, stage_dir / "model.safetensors")
    shutil.copyfile(pretrained.tokenizer_path, stage_dir / "tokenizer.json")
    overrides = [o.replace(str(pretrained.weights_path), str(stage_dir)) for o in overrides]
    cfg = to_run_config(compose_config(overrides))
    data = build_chat_data(cfg, total_train_samples=8)
    assert data.config.tokenizer.path == str(stage_dir / "tokenizer.json")
