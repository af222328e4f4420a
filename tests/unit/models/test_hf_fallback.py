"""The transformers fallback (model.family=hf): transformers' own model behind the native
decoder's interface, and the folders it refuses."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hf_folders import write_tokenizer
from safetensors.torch import load_file, save_file

from recipes_lib.checkpoint.hf_files import read_folder_config
from recipes_lib.checkpoint.source import read_init_source
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.losses import causal_lm_loss
from recipes_lib.models.hf_fallback import (
    HFCausalLM,
    build_hf_model,
    document_positions,
    fallback_model_config,
)

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_folder(path, model_type="gpt_neox", tokenizer=False, **config):
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **config})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    if tokenizer:
        write_tokenizer(path, stdlib_instruction_records(50))
    return path


def built(folder) -> HFCausalLM:
    return build_hf_model(fallback_model_config(read_folder_config(folder)), folder=folder).eval()


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    return built(tiny_folder(tmp_path_factory.mktemp("neox")))


def test_state_dict_has_transformers_names(neox):
    theirs = set(neox.hf.state_dict())
    assert set(neox.state_dict()) == theirs
    assert len(neox.blocks) == 2 and all(type(b).__name__ == "GPTNeoXLayer" for b in neox.blocks)


def test_fused_chunked_loss_and_logprobs_match_transformers(neox):
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    logits = neox.hf(input_ids=ids).logits
    with torch.no_grad():
        assert neox.fused_head
        fused = neox(ids, labels=labels, loss_chunk_size=7)
        torch.testing.assert_close(fused, causal_lm_loss(logits, labels), atol=1e-5, rtol=1e-5)
        per_token = neox(ids, labels=labels, per_token=True, loss_chunk_size=5)
        expected = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])
        expected = expected[..., 0] * (labels != -100)
        torch.testing.assert_close(per_token, expected, atol=1e-5, rtol=1e-5)
        check = neox.first_batch_check(ids, None, labels, 7)
    assert check["difference"] < 1e-5


def test_packed_row_loss_equals_each_documents_own(neox):
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 10 + [1] * 8 + [2] * 6])
    assert document_positions(doc_ids).tolist() == [[*range(10), *range(8), *range(6)]]
    labels = torch.roll(ids, -1, 1)
    labels[0, [9, 17, 23]] = -100  # no label crosses a document's end
    with torch.no_grad():
        packed = neox(ids, doc_ids, labels=labels, per_token=True, loss_chunk_size=8)
        alone = [
            neox(ids[:, a:b], labels=labels[:, a:b], per_token=True)
            for a, b in ((0, 10), (10, 18), (18, 24))
        ]
    torch.testing.assert_close(packed, torch.cat(alone, 1), atol=1e-5, rtol=1e-5)
    assert neox.attention_backend.packs_documents and neox.packing == "positions"


def test_soft_capped_logits_are_not_fused(tmp_path):
    model = built(tiny_folder(tmp_path, "gemma2", head_dim=8, final_logit_softcapping=2.0))
    assert not model.fused_head
    ids = torch.randint(0, 256, (1, 12))
    labels = torch.roll(ids, -1, 1)
    with torch.no_grad():  # the chunked path computes the capped logits whole instead
        ours = model(ids, labels=labels, loss_chunk_size=4)
        torch.testing.assert_close(ours, causal_lm_loss(model.hf(input_ids=ids).logits, labels))
    with pytest.raises(ConfigError, match="soft-capping"):
        model(ids, fused=lambda hidden, weight: hidden.sum())


def test_activation_checkpointing_keeps_the_gradients(tmp_path):
    folder = tiny_folder(tmp_path)
    grads = []
    for enabled in (False, True):
        model = built(folder).train()
        model.hf.config.hidden_dropout = model.hf.config.attention_dropout = 0.0
        model.set_activation_checkpointing(enabled)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
        model(ids, labels=torch.roll(ids, -1, 1)).backward()
        grads.append(model.hf.get_input_embeddings().weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_fsdp_asks_the_model_for_its_decoder_layers(neox):
    from recipes_lib.parallel.fsdp import _blocks

    assert _blocks(neox) == neox.blocks


def test_a_folder_without_a_native_family_says_it_takes_the_fallback(tmp_path, caplog):
    folder = tiny_folder(tmp_path / "neox")
    with caplog.at_level(logging.WARNING):
        source = read_init_source(folder)
        read_init_source(folder)
    assert source.model is not None and source.model["family"] == "hf"
    assert source.model["hf_config"]["model_type"] == "gpt_neox"
    lines = [r.getMessage() for r in caplog.records if "no native path" in r.getMessage()]
    assert len(lines) == 1 and str(folder) in lines[0]


def test_model_hf_takes_a_native_folder_through_transformers(tmp_path):
    from recipes_lib.checkpoint.source import fill_model_from_init
    from recipes_lib.config import compose_config, to_run_config

    folder = tiny_folder(tmp_path / "llama", "llama", tokenizer=True)
    native = to_run_config(
        fill_model_from_init(compose_config(["recipe=sft/full", f"stage.init_from={folder}"]))
    )
    assert native.model.family == "llama"
    cfg = compose_config(["recipe=sft/full", "model=hf", f"stage.init_from={folder}"])
    model = to_run_config(fill_model_from_init(cfg)).model
    assert model.family == "hf" and model.hf_config["model_type"] == "llama"
    assert (model.dim, model.n_layers, model.vocab_size) == (32, 2, 256)


# ------------------------------------------------------------------ bad input
def test_an_encoder_folder_is_refused(tmp_path):
    folder = tiny_folder(tmp_path / "bert", "bert", is_decoder=False)
    with pytest.raises(ConfigError, match="depend on later tokens"):
        built(folder)
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps({"model_type": "vit", **TINY}))
    with pytest.raises(ConfigError, match=r"'vit'.*not a causal language model"):
        built(tmp_path / "vit")


def test_missing_weights_are_refused(tmp_path):
    folder = tiny_folder(tmp_path)
    weights = load_file(folder / "model.safetensors")
    dropped = next(k for k in weights if "layers.1.mlp" in k)
    del weights[dropped]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"model: 1 parameter\(s\) .* no weights .*{dropped}"):
        built(folder)


def test_a_tokenizer_larger_than_the_embeddings_is_refused(tmp_path):
    folder = tiny_folder(tmp_path, vocab_size=128, tokenizer=True)  # the tokenizer has 512
    with pytest.raises(ConfigError, match="tokenizer.json has 512 tokens but the model embeds 128"):
        built(folder)


def test_remote_code_is_refused_without_the_flag(tmp_path):
    folder = tiny_folder(tmp_path)
    config = read_folder_config(folder)
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"own code \(modeling_mine.MyForCausalLM\).*trust_remote"
    ):
        built(folder)


def test_a_refused_folder_stops_the_run_before_training(tmp_path):
    from hf_folders import write_chat_records
    from tiny import QUIET_OVERRIDES

    from recipes_lib.config import compose_config
    from recipes_lib.train import run

    folder = tiny_folder(
        tmp_path / "bert", "bert", is_decoder=False, vocab_size=512, tokenizer=True
    )
    chat = write_chat_records(tmp_path / "chat.jsonl", 20)
    overrides = [
        "recipe=sft/full",
        f"stage.init_from={folder}",
        f"data.path={chat}",
        "trainer=cpu",
        "trainer.max_steps=2",
        *QUIET_OVERRIDES,
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    with pytest.raises(ConfigError, match="not a causal language model"):
        run(compose_config(overrides))
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_remote_code_runs_with_the_flag_and_is_recorded(tmp_path):
    folder = tiny_folder(tmp_path / "mine", "llama")
    (folder / "configuration_mine.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class MyConfig(LlamaConfig):\n    model_type = 'mine'\n"
    )
    (folder / "modeling_mine.py").write_text(
        "from transformers import LlamaForCausalLM\n"
        "from .configuration_mine import MyConfig\n\n\n"
        "class MyForCausalLM(LlamaForCausalLM):\n    config_class = MyConfig\n"
    )
    config = read_folder_config(folder)
    config["model_type"] = "mine"
    config["auto_map"] = {
        "AutoConfig": "configuration_mine.MyConfig",
        "AutoModelForCausalLM": "modeling_mine.MyForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    model_config = fallback_model_config(config, trust_remote_code=True)
    model = build_hf_model(model_config, folder=folder)
    assert type(model.hf).__name__ == "MyForCausalLM"
    assert model.config.trust_remote_code  # recorded with the run's model


def test_the_estimates_count_transformers_model_on_the_meta_device(neox):
    from recipes_lib.models.hf_fallback import model_shapes

    shapes = model_shapes(neox.config)
    assert isinstance(shapes, HFCausalLM) and all(p.is_meta for p in shapes.parameters())
    assert shapes.num_params() == neox.num_params() == neox.hf.num_parameters()
    assert shapes.flops_per_token(64) == neox.flops_per_token(64) > 6 * neox.num_params(True)


def test_a_folder_whose_config_holds_an_infinite_value_builds_and_passes_the_checks(tmp_path):
    """transformers writes Falcon-H1's ``time_step_limit`` ``(0.0, inf)`` as a tagged
    object in config.json; the folder's own values are not the user's to keep finite."""
    import math

    from recipes_lib.assembly import check_run_config
    from recipes_lib.checkpoint.source import fill_model_from_init
    from recipes_lib.config import compose_config, to_run_config
    from recipes_lib.models.hf_fallback import hf_config_object
    from recipes_lib.parallel.precision import resolve_device_choices

    tiny = dict(TINY, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32)
    transformers.AutoConfig.for_model("falcon_h1", **tiny).save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    values = read_folder_config(tmp_path)
    assert values["time_step_limit"] == [0.0, math.inf]
    assert tuple(hf_config_object(fallback_model_config(values)).time_step_limit) == (0.0, math.inf)
    cfg = compose_config(["recipe=sft/lora", "model=hf", f"stage.init_from={tmp_path}"])
    # as a run checks it: no "model.hf_config.time_step_limit=[0.0, inf] must hold finite numbers"
    checked = resolve_device_choices(to_run_config(fill_model_from_init(cfg)))
    check_run_config(checked)
    checked.model.hf_config["layer_norm_epsilon"] = math.nan  # a nan is refused all the same
    with pytest.raises(ConfigError, match=r"^model\.hf_config\.layer_norm_epsilon=nan must be"):
        check_run_config(checked)


def test_a_module_named_as_the_fallbacks_own_attribute_is_refused_in_one_line(tmp_path):
    """GIT's head is a child named ``output``, the fallback's own method."""
    folder = tiny_folder(tmp_path, "git", num_attention_heads=4)
    with pytest.raises(ConfigError, match=r"model_type='git': its module 'output' has the name"):
        built(folder)


def test_an_image_text_config_gives_its_text_models_shape():
    """Gemma 3's and Fuyu's image-text folders keep the language model's shape in
    ``text_config``; the whole config is still what the model is built from."""
    text = {"vocab_size": 300, "hidden_size": 48, "num_hidden_layers": 3, "intermediate_size": 96}
    config = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 16}}
    model = fallback_model_config(config)
    assert (model.vocab_size, model.dim, model.n_layers, model.ffn_dim) == (300, 48, 3, 96)
    assert model.hf_config == config
    with pytest.raises(CheckpointError, match="at its top or in its text_config"):
        fallback_model_config({"model_type": "gemma3", "vision_config": {"hidden_size": 16}})


def test_a_published_image_text_config_takes_transformers_defaults_for_what_it_leaves_out():
    """A folder saved by transformers 4 (the published Gemma 3 4B) writes only the text
    values that differ from the defaults; the rest are transformers' own."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34}
    config = {"model_type": "gemma3", "text_config": {**text, "model_type": "gemma3_text"}}
    model = fallback_model_config(config)
    defaults = transformers.Gemma3TextConfig()
    assert (model.dim, model.n_layers, model.ffn_dim) == (2560, 34, 10240)
    assert model.vocab_size == defaults.vocab_size
    assert (model.n_heads, model.n_kv_heads, model.head_dim) == (
        defaults.num_attention_heads,
        defaults.num_key_value_heads,
        defaults.head_dim,
    )
    assert model.max_seq_len == defaults.max_position_embeddings
    assert model.hf_config == config  # built from the folder's own config
