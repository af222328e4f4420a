"""``strategy.context_parallel`` is refused before training, in one line naming the key,
where its rows cannot be split; a degree that fits passes."""

from __future__ import annotations

import pytest

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.errors import ConfigError
from recipes_lib.preflight import check_run

SPLIT = ["strategy=ddp", "trainer.devices=4", "data.seq_len=64", "kernels.attention=flex"]


def _cfg(*overrides: str):
    return to_run_config(compose_config(["recipe=pretrain/tiny", *SPLIT, *overrides]))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["strategy.context_parallel=3"], r"strategy.context_parallel=3 does not divide the 4"),
        (
            ["strategy.context_parallel=4", "data.seq_len=60"],
            r"data.seq_len=60 is not divisible by 2 x strategy.context_parallel=4",
        ),
        (
            ["strategy.context_parallel=2", "kernels.attention=flash_attn"],
            r"kernels.attention=flash_attn cannot run with rows split",
        ),
        (
            ["strategy.context_parallel=2", "strategy=single", "trainer.devices=1"],
            r"strategy.context_parallel=2 needs strategy=ddp or fsdp or hsdp; strategy=single",
        ),
        (  # a row's ranks must share one hsdp copy's sharding
            ["strategy.context_parallel=4", "strategy=hsdp", "strategy.replicas=2"],
            r"strategy.context_parallel=4 does not divide the 2 ranks each strategy=hsdp copy",
        ),
        (
            [
                "strategy.context_parallel=2",
                "strategy=fsdp",
                "strategy.expert_parallel=true",
                "model.family=qwen3_moe",
                "model.qk_norm=head",
                "model.moe_experts=4",
                "model.moe_top_k=2",
                "model.moe_ffn_dim=64",
            ],
            r"strategy.expert_parallel=true is not supported with strategy.context_parallel=2",
        ),
        (["strategy.context_parallel=0"], r"strategy.context_parallel=0 must be 1 or more"),
    ],
)
def test_a_degree_the_run_cannot_use_is_refused(overrides, match):
    with pytest.raises(ConfigError, match=match) as refused:
        check_run(_cfg(*overrides), ("pretrain",))
    assert "\n" not in str(refused.value)


def test_an_objective_that_cannot_split_its_rows_is_refused(monkeypatch):
    """A user's objective that does not declare it (``ObjectiveSpec.context_parallel``):
    every built-in one does."""
    import dataclasses

    from recipes_lib.objectives import registry

    sft = registry.get_objective("sft")
    mine = dataclasses.replace(sft, name="mine", context_parallel=False)
    monkeypatch.setitem(registry._REGISTRY, "mine", mine)
    overrides = ["recipe=sft/tiny", *SPLIT, "strategy.context_parallel=2", "stage.objective=mine"]
    cfg = to_run_config(compose_config(overrides))
    with pytest.raises(ConfigError, match=r"^stage.objective=mine cannot split its rows"):
        check_run(cfg, (cfg.stage.objective,))


@pytest.mark.parametrize(
    "recipe",
    ["sft/tiny", "sft/lora_tiny", "dpo/tiny", "dpo/lora_tiny", "simpo/tiny", "orpo/tiny"]
    + ["kto/tiny", "reward/tiny", "distill/tiny", "grpo/tiny"],
)
def test_sequence_and_pair_objectives_split_their_rows(recipe):
    cfg = to_run_config(compose_config([f"recipe={recipe}", *SPLIT, "strategy.context_parallel=2"]))
    check_run(cfg, (cfg.stage.objective,))


def test_a_degree_that_fits_passes():
    check_run(_cfg("strategy.context_parallel=4"), ("pretrain",))
    check_run(_cfg("strategy.context_parallel=2"), ("pretrain",))


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=fsdp", "strategy.context_parallel=4"],
        ["strategy=fsdp", "strategy.context_parallel=2"],  # two replicas of a row's pair
        ["strategy=hsdp", "strategy.replicas=2", "strategy.context_parallel=2"],
    ],
)
def test_fsdp_and_hsdp_split_rows(overrides):
    check_run(_cfg(*overrides), ("pretrain",))


@pytest.mark.parametrize(
    ("shape", "named"),
    [
        ({"attention_sinks": True}, "attention sinks"),
        ({"mla_kv_rank": 64}, "multi-head latent attention"),
        ({"linear_layers": (0, 1)}, "linear attention"),
    ],
)
def test_a_teacher_whose_attention_cannot_be_split_is_named_before_training(shape, named):
    from types import SimpleNamespace

    from recipes_lib.objectives.distill import _check_teacher_splits

    plain = {"family": "tiny", "attention_sinks": False, "mla_kv_rank": None, "linear_layers": ()}
    _check_teacher_splits(SimpleNamespace(**plain))  # a plain teacher splits
    with pytest.raises(ConfigError, match=f"^stage.distill.teacher_from: .*{named}") as refused:
        _check_teacher_splits(SimpleNamespace(**{**plain, **shape}))
    assert "\n" not in str(refused.value)


def test_a_teachers_layer_kind_on_a_backend_that_cannot_split_rows_is_named():
    from recipes_lib.objectives.distill import _check_teacher_splits

    def composed(*overrides):
        return to_run_config(compose_config(["model=gemma3_1b", *overrides]))

    teacher = composed().model  # local-window and global layers
    flex = composed("kernels.attention=flex").kernels
    _check_teacher_splits(teacher, flex, document_mask=True)
    varlen = composed("kernels.attention=flex", "kernels.attention_local=varlen").kernels
    with pytest.raises(ConfigError, match=r"teacher's kernels.attention_local=varlen"):
        _check_teacher_splits(teacher, varlen, document_mask=True)
