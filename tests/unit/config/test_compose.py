"""Every shipped recipe and config-group option composes against the typed schema."""

from __future__ import annotations

import dataclasses

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from recipes_lib.checkpoint.source import fill_model_from_init
from recipes_lib.config import (
    RunConfig,
    compose_config,
    conf_dir,
    list_group_options,
    list_recipes,
    to_run_config,
)
from recipes_lib.config.store import from_init_fields
from recipes_lib.errors import ConfigError

GROUPS = [
    "model",
    "kernels",
    "data",
    "stage",
    "adapter",
    "optim",
    "scheduler",
    "trainer",
    "strategy",
    "precision",
    "callbacks",
    "logger",
]
NEEDS_A_VALUE = {
    ("data", "local_text"): "data.sources.main.path=/tmp",
    ("data", "hub_text"): "data.sources.main.hub=x",
}
# recipes whose data the user must name
RECIPE_NEEDS = {
    "cpt/long": ["data.sources.main.path=/tmp", "data.sources.short.path=/tmp"],
    "cpt/long_8b": ["data.sources.main.path=/tmp", "data.sources.short.path=/tmp"],
}


def test_shipped_recipes_are_listed():
    recipes = list_recipes()
    for name in ("pretrain/tiny", "pretrain/gpt_124m", "pretrain/llama_1b"):
        assert name in recipes


def _typed(overrides: list[str], hf_folder) -> RunConfig:
    """The typed config of ``overrides``; a ``model=from_init`` config takes its shape from
    a tiny Hugging Face folder, as a run given ``stage.init_from`` does."""
    cfg = compose_config(overrides)
    if from_init_fields(cfg.model):
        cfg = fill_model_from_init(compose_config([*overrides, f"stage.init_from={hf_folder}"]))
    return to_run_config(cfg)


@pytest.mark.parametrize("recipe", list_recipes())
def test_every_recipe_composes_to_a_typed_config(recipe, hf_folder):
    cfg = _typed([f"recipe={recipe}", *RECIPE_NEEDS.get(recipe, [])], hf_folder)
    assert isinstance(cfg, RunConfig)
    assert cfg.data.seq_len <= cfg.model.max_seq_len
    assert cfg.data.tokenizer.vocab_size <= cfg.model.vocab_size


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in list_group_options(g)])
def test_every_group_option_composes(group, option, hf_folder):
    overrides = [f"{group}={option}"]
    if (group, option) in NEEDS_A_VALUE:
        overrides.append(NEEDS_A_VALUE[(group, option)])
    cfg = _typed(overrides, hf_folder)
    assert isinstance(cfg, RunConfig)


def test_from_init_takes_the_folders_shape_and_keeps_what_is_set(hf_folder):
    cfg = _typed(["recipe=sft/full", "model.max_seq_len=256"], hf_folder)
    assert (cfg.model.dim, cfg.model.n_kv_heads, cfg.model.vocab_size) == (64, 2, 512)
    assert cfg.model.qkv_bias and cfg.model.tie_embeddings  # a qwen2 folder
    assert cfg.model.max_seq_len == 256  # set on the command line: kept
    with pytest.raises(ConfigError, match="stage.init_from is not set"):
        fill_model_from_init(compose_config(["recipe=sft/full"]))
    with pytest.raises(ConfigError, match=r"model\.name is \$\{from_init:name\}"):
        to_run_config(compose_config(["recipe=sft/full"]))


def test_groups_on_disk_are_all_tested():
    # pipeline/ is a group of conf/pipeline_root.yaml, tested in tests/unit/pipeline;
    # hydra/ holds Hydra's own settings (the job logging), no part of the run config
    on_disk = {
        p.name
        for p in conf_dir().iterdir()
        if p.is_dir() and p.name not in ("recipe", "pipeline", "hydra", "__pycache__")
    }
    assert on_disk <= set(GROUPS)


def test_overrides_reach_the_typed_config():
    cfg = to_run_config(
        compose_config(
            ["recipe=pretrain/tiny", "optim.lr=2e-4", "model.n_layers=3", "scheduler=wsd"]
        )
    )
    assert cfg.optim.lr == pytest.approx(2e-4)
    assert cfg.model.n_layers == 3
    assert cfg.scheduler.name == "wsd"
    # the recipe's own choices survive a group change it did not make
    assert cfg.model.vocab_size == 4096


def test_recipe_overrides_group_defaults():
    cfg = to_run_config(compose_config(["recipe=pretrain/llama_1b"]))
    assert cfg.model.name == "llama_1b"
    assert cfg.model.rope_scaling.type == "llama3"
    assert cfg.scheduler.name == "wsd"
    assert cfg.precision.name == "bf16-mixed"


def test_unknown_key_fails_at_compose_time_naming_it():
    with pytest.raises(ConfigCompositionException, match="model.dimm"):
        compose_config(["model.dimm=3"])
    # `+key=` opens the node while composing; the typed conversion still refuses it
    with pytest.raises(ConfigError, match="model.dimm"):
        to_run_config(compose_config(["+model.dimm=3"]))


def test_wrong_type_fails_at_compose_time_naming_the_key():
    with pytest.raises((ValidationError, ConfigCompositionException)) as info:
        compose_config(["optim.lr=fast"])
    text = str(info.value) + str(info.value.__cause__)
    assert "optim.lr" in text


def test_unknown_recipe_fails_naming_it():
    with pytest.raises(Exception, match="recipe/pretrain/nope"):
        compose_config(["recipe=pretrain/nope"])


def test_from_init_refuses_a_run_record_without_model_family(tmp_path):
    # every run the library writes records its whole model config; a config.yaml
    # without model.family is not guessed at but refused, naming the key and the folder
    from recipes_lib.checkpoint.weights import save_weights
    from recipes_lib.models import Transformer

    cfg = to_run_config(compose_config(["recipe=pretrain/tiny"]))
    model = dataclasses.asdict(cfg.model)
    for name in ("family", "qk_norm", "norm_placement"):
        model.pop(name)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml({"model": model}))
    save_weights(Transformer(cfg.model).state_dict(), tmp_path / "model.safetensors")
    composed = compose_config(["recipe=sft/full", f"stage.init_from={tmp_path}"])
    with pytest.raises(ConfigError) as caught:
        fill_model_from_init(composed)
    assert str(caught.value) == (
        f"model=from_init: stage.init_from={str(tmp_path)!r} (run) does not record "
        "model.family; set it"
    )


# the model fields the schema gained after runs were first recorded with the native
# families (DeepSeek-V3's latent attention and router groups, Qwen3.5's linear attention)
ADDED_MODEL_FIELDS = (
    "mla_kv_rank",
    "mla_q_rank",
    "mla_rope_dim",
    "v_head_dim",
    "rope_interleave",
    "attention_output_gate",
    "linear_layers",
    "linear_heads",
    "linear_key_heads",
    "linear_key_dim",
    "linear_value_dim",
    "linear_conv_kernel",
    "moe_shared_gate",
    "moe_groups",
    "moe_top_groups",
    "moe_routed_scale",
)


def test_from_init_reads_a_run_recorded_before_fields_were_added(tmp_path):
    # a run folder written before the schema gained a field records no key for it: the
    # model it trained had the field's default, and it starts the next run unchanged
    from recipes_lib.checkpoint.source import load_model_weights
    from recipes_lib.checkpoint.weights import save_weights
    from recipes_lib.models import Transformer

    cfg = to_run_config(compose_config(["recipe=pretrain/tiny"]))
    model = dataclasses.asdict(cfg.model)
    for name in ADDED_MODEL_FIELDS:
        model.pop(name)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml({"model": model}))
    save_weights(Transformer(cfg.model).state_dict(), tmp_path / "model.safetensors")
    composed = compose_config(["recipe=sft/full", f"stage.init_from={tmp_path}"])
    filled = to_run_config(fill_model_from_init(composed)).model
    assert dataclasses.asdict(filled) == dataclasses.asdict(cfg.model)
    load_model_weights(Transformer(filled), tmp_path)


def test_model_from_init_fills_every_field_of_the_model():
    """A field missing from conf/model/from_init.yaml would keep its default, not the
    folder's value (a Gemma 3 window, a SmolLM3 NoPE layer)."""
    from dataclasses import fields

    from recipes_lib.config.schema import ModelConfig

    marked = from_init_fields(compose_config(["model=from_init"]).model)
    top = {key.split(".")[0] for key in marked}
    # trust_remote_code is the user's own choice, never a source's
    assert top == {f.name for f in fields(ModelConfig)} - {"init_std", "trust_remote_code"}
