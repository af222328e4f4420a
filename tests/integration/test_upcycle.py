"""Sparse upcycling: a mixture of experts started from a dense model computes what the
dense model did (every expert its layer's MLP, top-k renormalised), a pipeline goes
dense -> experts in one run, and a mixture that does not fit its dense source is refused
naming the keys before anything is built."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES, tiny_model_config

from recipes_lib.checkpoint.upcycle import load_upcycled_weights
from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.models import Transformer
from recipes_lib.models.moe import moe_layers
from recipes_lib.pipeline import parse_pipeline, run_pipeline
from recipes_lib.train import run

EXPERTS = dict(moe_experts=4, moe_top_k=2, moe_ffn_dim=64)


@pytest.mark.parametrize(
    ("dense_family", "moe"),
    [
        ("llama", {"family": "mixtral"}),
        # a layer that keeps its dense MLP beside one with experts
        ("qwen3", {"family": "qwen3_moe", "moe_dense_layers": [1]}),
        # shared experts start adding nothing
        ("qwen3", {"family": "qwen3_moe", "moe_shared_experts": 1}),
    ],
)
def test_the_upcycled_mixture_computes_the_dense_model(tmp_path, dense_family, moe):
    qk = {"qk_norm": "head"} if dense_family == "qwen3" else {}
    dense_config = tiny_model_config(family=dense_family, **qk)
    torch.manual_seed(0)
    dense = Transformer(dense_config).eval()
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_file(dense.state_dict(), str(tmp_path / "dense.safetensors"))
    torch.manual_seed(1)
    mixture = Transformer(replace(dense_config, **EXPERTS, **moe)).eval()
    router = moe_layers(mixture)[0].router.weight.clone()
    load_upcycled_weights(mixture, tmp_path / "dense.safetensors", "stage.init_from")
    assert torch.equal(moe_layers(mixture)[0].router.weight, router)  # fresh, not copied
    layer0 = mixture.layers[0].feed_forward.experts
    for e in range(4):
        assert torch.equal(layer0.w1.weight[e], dense.layers[0].feed_forward.w1.weight)
    x = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(mixture(x), dense(x), atol=1e-5, rtol=1e-5)


def test_a_dense_source_that_does_not_fit_is_named(tmp_path):
    dense = Transformer(tiny_model_config())
    save_file(dense.state_dict(), str(tmp_path / "dense.safetensors"))
    narrow = Transformer(tiny_model_config(family="mixtral", **{**EXPERTS, "moe_ffn_dim": 32}))
    with pytest.raises(CheckpointError, match="stage.init_from.*upcycled.*experts.w1"):
        load_upcycled_weights(narrow, tmp_path / "dense.safetensors", "stage.init_from='d'")


def _overrides(tmp_path, cache, *extra):
    return [
        "recipe=pretrain/tiny",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={cache}",
        "data.sources.stdlib.max_documents=120",
        "data.seq_len=64",
        "data.batch_size=4",
        *SMALL_VOCAB_OVERRIDES,
        "trainer.max_steps=4",
        "scheduler.warmup=1",
        "trainer.limit_val_batches=1",
        *QUIET_OVERRIDES,
        "callbacks=minimal",
        *extra,
    ]


MIXTRAL = [
    "model.family=mixtral",
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_dim=384",
    "model.moe_aux_loss_coef=0.01",
]


def test_upcycling_refuses_a_mixture_that_does_not_fit_before_it_starts(tmp_path, shared_cache):
    dense = run(compose_config(_overrides(tmp_path / "dense", shared_cache)))
    cases = {
        "model.moe_ffn_dim=192 vs the dense MLP's ffn_dim=384": ["model.moe_ffn_dim=192"],
        # Qwen3-MoE's per-head q/k norm: not the dense Llama's attention
        "model.qk_norm='head' vs 'none'": [
            "model.family=qwen3_moe",
            "model.qk_norm=head",
        ],
    }
    for match, extra in cases.items():
        overrides = _overrides(
            tmp_path / "moe",
            shared_cache,
            *MIXTRAL,
            "stage.upcycle=true",
            f"stage.init_from={dense.output_dir}",
            *extra,
        )
        with pytest.raises(ConfigError, match=f"stage.upcycle=true.*{match}"):
            run(compose_config(overrides))
        assert not (tmp_path / "moe" / "run").exists()


def test_a_pipeline_goes_from_dense_to_experts(tmp_path, shared_cache, monkeypatch):
    monkeypatch.setenv("RECIPES_CACHE", str(shared_cache))
    base = _overrides(tmp_path, shared_cache)[3:]  # the shared sizes, no run folder
    spec = parse_pipeline(
        {
            "name": "upcycle",
            "dir": str(tmp_path / "pipeline"),
            "overrides": base,
            "stages": {
                "dense": {"recipe": "pretrain/tiny"},
                "experts": {"recipe": "pretrain/tiny", "init": "upcycle", "overrides": MIXTRAL},
                # anneal: its output the mean of its last two checkpoints, experts included
                "anneal": {
                    "recipe": "pretrain/tiny",
                    "overrides": MIXTRAL,
                    "stage": {"average_last_k": 2},
                    "run": {"checkpoint_every_n_steps": 2},
                },
            },
        }
    )
    result = run_pipeline(spec)
    manifest = result["experts"].manifest
    assert manifest.model["moe_experts"] == 4 and manifest.model["family"] == "mixtral"
    assert manifest.global_step == 4 and manifest.weights_path.is_file()
    anneal = result["anneal"].manifest
    assert len(anneal.averaged_from) == 2
    averaged = load_weights(anneal.weights_path)
    steps = [load_weights(anneal.directory / path) for path in anneal.averaged_from]
    name = "layers.0.feed_forward.experts.w1.weight"
    assert averaged[name].shape == (4, 384, 128)
    torch.testing.assert_close(averaged[name], (steps[0][name] + steps[1][name]) / 2)


def test_a_sigmoid_router_bias_in_bf16_is_refused():
    from recipes_lib.config import to_run_config
    from recipes_lib.preflight import check_precision

    cfg = to_run_config(
        compose_config(
            [
                "recipe=pretrain/moe_tiny",
                "precision=bf16-true",
                "model.moe_router=sigmoid",
                "model.moe_bias_update_rate=0.001",
            ]
        )
    )
    with pytest.raises(ConfigError, match="model.moe_bias_update_rate with precision=bf16-true"):
        check_precision(cfg, cuda_capability=None, cpu_bf16=True)
