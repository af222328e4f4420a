"""The backend of each kind of attention layer: ``kernels.attention`` (a backend or
``auto``) and ``kernels.attention_local`` / ``kernels.attention_global``, the auto rule,
and the one-line refusals naming the key, before anything is written."""

from __future__ import annotations

import pytest
import torch

from recipes_lib.config import compose_config
from recipes_lib.errors import ConfigError, UnsupportedKernelError
from recipes_lib.kernels import (
    ATTENTION_BACKENDS,
    ATTENTION_CHOICES,
    AttentionChoice,
    choose_attention,
    get_attention_backend,
)
from recipes_lib.train import run

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ATTENTION_BACKENDS)
def test_one_backend_runs_every_kind_of_layer_as_before(name):
    choice = choose_attention(name)
    assert choice.names() == {"global": name, "local": name}
    assert choice.backends["global"] is choice.backends["local"]  # one instance, one mask cache
    assert choice.line() == f"attention: {name}" and choice.name == name
    assert choice.keys == {
        "global": f"kernels.attention={name}",
        "local": f"kernels.attention={name}",
    }


def test_auto_takes_flex_for_windows_and_sdpa_for_global_causal_layers():
    choice = choose_attention("auto")
    assert choice.names() == {"global": "sdpa", "local": "flex"}
    assert choice.name == "mixed"
    assert choice.line() == (
        "attention: global layers sdpa, local layers flex (kernels.attention=auto)"
    )
    # a document mask: SDPA cannot apply it, so the global layers take flex too, and the
    # two kinds share one flex (its masks built once per window)
    packed = choose_attention("auto", document_mask=True)
    assert packed.names() == {"global": "flex", "local": "flex"}
    assert packed.backends["global"] is packed.backends["local"]
    # a model without local layers reports (and checks) its global ones alone
    assert (
        choice.for_kinds(["global"]).line()
        == "attention: global layers sdpa (kernels.attention=auto)"
    )


def test_a_kind_key_overrides_kernels_attention_for_that_kind():
    choice = choose_attention("sdpa", local="flex")
    assert choice.names() == {"global": "sdpa", "local": "flex"}
    assert choice.line() == (
        "attention: global layers sdpa, local layers flex "
        "(kernels.attention=sdpa, kernels.attention_local=flex)"
    )
    choice = choose_attention("auto", global_="flex")
    assert choice.names() == {"global": "flex", "local": "flex"}
    assert choice.keys == {
        "global": "kernels.attention_global=flex",
        "local": "kernels.attention=auto",
    }
    assert choose_attention("flex", global_="auto").names() == {"global": "sdpa", "local": "flex"}


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"attention": "xformers"}, "kernels.attention"),
        ({"attention": "auto", "local": "xformers"}, "kernels.attention_local"),
        ({"attention": "sdpa", "global_": "Flex"}, "kernels.attention_global"),
    ],
)
def test_an_unknown_name_is_refused_naming_its_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        choose_attention(**kwargs)
    message = str(err.value)
    assert message.startswith(f"{key}=")
    assert "\n" not in message and all(name in message for name in ATTENTION_CHOICES)


def test_a_backend_that_cannot_run_here_is_refused_naming_its_key():
    choice = choose_attention("sdpa", local="flash_attn")
    with pytest.raises(UnsupportedKernelError) as err:
        choice.check(device=CPU, dtype=torch.float32, document_mask=False)
    message = str(err.value)
    assert message.startswith("kernels.attention_local=flash_attn cannot run here")
    assert "'cpu'" in message and "\n" not in message
    # a model without local layers never runs it
    choice.for_kinds(["global"]).check(device=CPU, dtype=torch.float32, document_mask=False)
    # the single key keeps its line
    with pytest.raises(UnsupportedKernelError, match="^kernels.attention=flash_attn cannot run"):
        choose_attention("flash_attn").check(device=CPU, dtype=torch.float32, document_mask=False)


def test_a_kind_without_document_masking_is_refused_naming_its_key():
    choice = choose_attention("flex", global_="sdpa")
    choice.check(device=CPU, dtype=torch.float32, document_mask=False)
    with pytest.raises(UnsupportedKernelError, match="^kernels.attention_global=sdpa cannot run"):
        choice.check(device=CPU, dtype=torch.float32, document_mask=True)
    doc_ids = torch.zeros(1, 16, dtype=torch.long)
    with pytest.raises(UnsupportedKernelError, match="^kernels.attention_global=sdpa cannot mask"):
        choice.build_mask(doc_ids, 16, window=None)
    assert choice.build_mask(doc_ids, 16, window=4) is not None  # the local layers' flex
    # auto chose for rows without documents: the line says what it took
    with pytest.raises(UnsupportedKernelError, match=r"^kernels.attention=auto \(sdpa\) cannot"):
        choose_attention("auto").build_mask(doc_ids, 16)


def test_each_window_gets_its_kinds_mask():
    choice = choose_attention("auto")
    assert choice.build_mask(None, 16, window=None) is None  # SDPA's causal flag
    local = choice.build_mask(None, 16, window=4)
    assert type(local).__name__ == "BlockMask"
    assert choice.build_mask(None, 16, window=4) is local  # flex keeps its causal masks


def test_single_wraps_an_instance():
    flex = get_attention_backend("flex")
    choice = AttentionChoice.single(flex)
    assert choice.for_window(None) is flex and choice.for_window(8) is flex
    assert choice.line() == "attention: flex"


def _compose(tmp_path, *overrides: str):
    return compose_config(
        [
            "recipe=pretrain/tiny",
            f"run.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            *overrides,
        ]
    )


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["kernels.attention_local=xformers"],
            r"^kernels\.attention_local='xformers' is not an attention backend; choose one of",
        ),
        (
            ["data.document_mask=true", "kernels.attention=flex", "kernels.attention_global=sdpa"],
            r"^data\.document_mask=true needs an attention backend with document masking; "
            r"kernels\.attention_global=sdpa has none \(use kernels\.attention_global=flex\)$",
        ),
        (
            ["data.document_mask=true", "kernels.attention=sdpa"],  # as before
            r"^data\.document_mask=true needs an attention backend with document masking; "
            r"kernels\.attention=sdpa has none \(use kernels\.attention=flex\)$",
        ),
    ],
)
def test_a_run_refuses_bad_attention_keys_before_writing_anything(tmp_path, overrides, line):
    with pytest.raises(ConfigError, match=line):
        run(_compose(tmp_path, *overrides))
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_auto_with_document_masks_passes_the_run_checks(tmp_path):
    from recipes_lib.assembly import check_run_config
    from recipes_lib.config import to_run_config

    cfg = to_run_config(_compose(tmp_path, "data.document_mask=true", "kernels=auto"))
    assert cfg.kernels.attention == "auto"
    check_run_config(cfg)


@pytest.mark.parametrize(
    ("override", "refusal"),
    [
        ("kernels.attention_local=flex", "a backend per kind of layer needs a native"),
        ("kernels.attention=varlen", "transformers has no such attention"),
    ],
)
def test_the_transformers_fallback_refuses_a_backend_per_kind(tmp_path, override, refusal):
    import dataclasses

    from recipes_lib.config import to_run_config
    from recipes_lib.preflight import check_data_and_kernels

    cfg = to_run_config(_compose(tmp_path, override))
    fallback = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, family="hf"))
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=\S+: {refusal}"):
        check_data_and_kernels(fallback)


def test_the_transformers_fallback_takes_auto_as_its_flex(tmp_path):
    import dataclasses

    from recipes_lib.config import to_run_config
    from recipes_lib.models.hf_fallback import ATTENTION_IMPLEMENTATIONS
    from recipes_lib.preflight import check_data_and_kernels

    cfg = to_run_config(_compose(tmp_path, "kernels.attention=auto"))
    fallback = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, family="hf"))
    check_data_and_kernels(fallback)  # the post-training recipes' default
    assert ATTENTION_IMPLEMENTATIONS["auto"] == "flex_attention"


def test_a_run_prints_and_keeps_each_kinds_backend(tmp_path, caplog):
    import logging

    from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES, family_overrides

    cfg = _compose(
        tmp_path,
        *family_overrides("gemma3"),
        "model.sliding_window=16",
        "model.window_layers=[0]",
        "kernels.attention=auto",
        "trainer.max_steps=2",
        "scheduler.warmup=1",
        "data.sources.stdlib.max_documents=60",
        "data.seq_len=64",
        "data.batch_size=4",
        "trainer.limit_val_batches=1",
        *SMALL_VOCAB_OVERRIDES,
        *QUIET_OVERRIDES,
    )
    with caplog.at_level(logging.INFO, logger="recipes_lib.train"):
        result = run(cfg)
    assert result.attention == {"global": "sdpa", "local": "flex"}
    line = "attention: global layers sdpa, local layers flex (kernels.attention=auto)"
    assert line in caplog.messages
    assert result.global_step == 2 and result.weights_path is not None


GEMMA_LIKE = ("model.sliding_window=16", "model.window_layers=[0]")


def test_a_kind_on_a_backend_that_cannot_split_rows_is_refused_naming_its_key():
    from tiny import family_overrides

    from recipes_lib.config import to_run_config
    from recipes_lib.preflight import check_run

    split = ["strategy=ddp", "trainer.devices=4", "data.seq_len=64", "kernels.attention=auto"]
    overrides = [*family_overrides("gemma3"), *GEMMA_LIKE, *split]
    cfg = to_run_config(compose_config(["recipe=pretrain/tiny", *overrides]))
    check_run(cfg, ("pretrain",))  # flex and sdpa both split rows
    with pytest.raises(ConfigError) as refused:
        check_run(
            to_run_config(
                compose_config(
                    [
                        "recipe=pretrain/tiny",
                        *overrides,
                        "strategy.context_parallel=2",
                        "kernels.attention_local=flash_attn",
                    ]
                )
            ),
            ("pretrain",),
        )
    message = str(refused.value)
    assert message.startswith("kernels.attention_local=flash_attn cannot run with rows split")
    assert "\n" not in message


def test_flash_attn_for_one_kind_on_a_cpu_is_refused_before_the_first_step(tmp_path):
    from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES, family_overrides

    cfg = _compose(
        tmp_path,
        *family_overrides("gemma3"),
        *GEMMA_LIKE,
        "kernels.attention=auto",
        "kernels.attention_local=flash_attn",
        "data.sources.stdlib.max_documents=60",
        "data.seq_len=64",
        *SMALL_VOCAB_OVERRIDES,
        *QUIET_OVERRIDES,
    )
    with pytest.raises(UnsupportedKernelError) as refused:
        run(cfg)
    message = str(refused.value)
    assert message.startswith("kernels.attention_local=flash_attn cannot run here")
    assert "'cpu'" in message and "\n" not in message
    assert not list((tmp_path / "run").rglob("*.ckpt"))  # no step was taken
    assert not (tmp_path / "run" / "model.safetensors").exists()
