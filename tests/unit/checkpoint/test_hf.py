import json
import os
import stat
from dataclasses import replace

import pytest
import torch
from hf_folders import TINY_HF, tiny_hf_model
from safetensors.torch import load_file, save_file
from tiny import tiny_model_config
from tokenizers import Tokenizer

from recipes_lib.checkpoint.hf import (
    is_hf_folder,
    load_hf_checkpoint,
    load_hf_weights_into,
    model_config_from_hf,
)
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.hf_tokenizer import hf_eos_token_ids, load_hf_tokenizer
from recipes_lib.config.schema import RopeScalingConfig
from recipes_lib.data.tokenizer import save_tokenizer, save_tokenizer_folder, train_bpe_tokenizer
from recipes_lib.errors import CheckpointError, ConfigError, DataError
from recipes_lib.models import Transformer
from recipes_lib.models.families.llama import LLAMA_NAMES

transformers = pytest.importorskip("transformers")

VOCAB = 300  # holds a byte-level BPE tokenizer (256 bytes + EOS + merges)
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def tokens(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def hf_kwargs(**overrides) -> dict:
    """The transformers config of the models here: :data:`TINY_HF` with their own numbers."""
    return {
        **TINY_HF,
        "vocab_size": VOCAB,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "attn_implementation": "eager",
        **overrides,
    }


def perturb(module: torch.nn.Module, seed: int = 0) -> None:
    """Nudge every parameter so zero biases and unit norms count in a comparison."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def save_hf(path, family, max_shard_size="50GB", **overrides):
    hf = tiny_hf_model(family, **hf_kwargs(**overrides))
    perturb(hf)
    hf.save_pretrained(path, max_shard_size=max_shard_size)
    return hf


def logits_of(model, x):
    with torch.no_grad():
        return model(x) if isinstance(model, Transformer) else model(input_ids=x).logits


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "head_dim": 32}),
        ("llama", {"rope_parameters": LLAMA3_ROPE}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
        ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("mistral", {"sliding_window": None}),
    ],
    ids=[
        "llama",
        "llama-tied-headdim",
        "llama3-rope",
        "linear-rope",
        "qwen2",
        "qwen2-tied",
        "mistral",
    ],
)
def test_imported_model_matches_transformers(tmp_path, family, overrides):
    hf = save_hf(tmp_path, family, **overrides)
    model, config = load_hf_checkpoint(tmp_path)
    assert config.qkv_bias == (family == "qwen2")
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert config.max_seq_len == 128 and config.n_kv_heads == 2
    assert not model.training
    x = tokens(2, 100)  # past original_max_position_embeddings: every RoPE band counts
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)


def test_mistral_sliding_window_limits_the_context(tmp_path):
    hf = save_hf(tmp_path, "mistral", sliding_window=48)
    model, config = load_hf_checkpoint(tmp_path)
    assert config.max_seq_len == 48  # full attention equals the window up to 48 tokens
    x = tokens(1, 48)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    with pytest.raises(CheckpointError, match=r"max_seq_len=64 exceeds sliding_window=48"):
        load_hf_checkpoint(tmp_path, max_seq_len=64)
    with pytest.raises(ConfigError, match="max_seq_len=48"):  # never computed differently
        model(tokens(1, 49))
    assert load_hf_checkpoint(tmp_path, max_seq_len=32)[1].max_seq_len == 32


def test_sharded_transformers_checkpoint_loads(tmp_path):
    hf = save_hf(tmp_path, "qwen2", max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = load_hf_checkpoint(tmp_path)
    x = tokens(1, 30)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)


def test_bfloat16_checkpoint_keeps_its_dtype_unless_asked(tmp_path):
    hf = save_hf(tmp_path, "llama")
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.rope_cos.dtype == torch.float32
    model32, _ = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    assert model32.layers[0].attention.wq.weight.dtype == torch.float32
    expected = hf.model.layers[0].self_attn.q_proj.weight.float()
    torch.testing.assert_close(model32.layers[0].attention.wq.weight, expected, atol=0, rtol=0)


# ------------------------------------------------------------------------ export
@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n"] * 20
    tokenizer = train_bpe_tokenizer(texts, vocab_size=VOCAB)
    return save_tokenizer(tokenizer, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def native_model(**overrides) -> Transformer:
    """Our model of the shape :func:`hf_kwargs` gives transformers."""
    shape = {"name": "tiny", "vocab_size": VOCAB, "dim": 64, "ffn_dim": 96, "max_seq_len": 128}
    config = tiny_model_config(**{**shape, **overrides})
    torch.manual_seed(0)
    model = Transformer(config).eval()
    perturb(model, seed=1)
    return model


@pytest.mark.parametrize(
    ("overrides", "model_type"),
    [
        ({}, "llama"),
        ({"tie_embeddings": True, "head_dim": 32, "norm_eps": 1e-6}, "llama"),
        ({"qkv_bias": True, "family": "qwen2", "rope_theta": 1e6}, "qwen2"),
        (
            {
                "rope_scaling": RopeScalingConfig(
                    type="llama3", factor=4.0, original_max_seq_len=32
                ),
                "rope_theta": 500000.0,
            },
            "llama",
        ),
        ({"rope_scaling": RopeScalingConfig(type="linear", factor=2.0)}, "llama"),
    ],
    ids=["llama", "tied-headdim", "qwen2", "llama3-rope", "linear-rope"],
)
def test_export_loads_in_transformers_with_the_same_logits(
    tmp_path, tokenizer_file, overrides, model_type
):
    model = native_model(**overrides)
    out = export_hf_checkpoint(
        model, model.config, tmp_path / "hf", tokenizer_file, chat_template=CHAT_TEMPLATE
    )
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == model_type
    assert written["torch_dtype"] == "float32"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == (
        "Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"
    )
    x = tokens(2, 100)
    torch.testing.assert_close(logits_of(hf, x), logits_of(model, x), atol=1e-4, rtol=1e-4)

    # and back: the same tensors
    again, config = load_hf_checkpoint(out)
    assert replace(config, name="tiny", init_std=0.02) == model.config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_exported_tokenizer_loads_in_transformers(tmp_path, tokenizer_file):
    model = native_model()
    out = export_hf_checkpoint(
        model, model.config, tmp_path, tokenizer_file, chat_template=CHAT_TEMPLATE
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.eos_token == "<|endoftext|>" and hf_tokenizer.eos_token_id == 0
    ours, template = load_hf_tokenizer(out)
    assert template == CHAT_TEMPLATE
    text = "def add(a, b):"
    assert hf_tokenizer(text).input_ids == ours.encode(text).ids
    chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<user>hi"
    assert hf_eos_token_ids(out, ours) == [0]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0


def test_sharded_export_loads_both_ways(tmp_path):
    model = native_model(qkv_bias=True, family="qwen2")
    out = export_hf_checkpoint(model, model.config, tmp_path, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert all(len(load_file(out / s)) >= 1 for s in shards)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    x = tokens(1, 40)
    torch.testing.assert_close(logits_of(hf.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4)
    # re-exporting unsharded replaces the shards
    export_hf_checkpoint(model, model.config, tmp_path)
    assert not list(out.glob("model-*")) and not (out / "model.safetensors.index.json").exists()
    again, _ = load_hf_checkpoint(out)
    torch.testing.assert_close(logits_of(again, x), logits_of(model, x), atol=0, rtol=0)


def test_export_from_a_state_dict_in_bfloat16(tmp_path):
    model = native_model(tie_embeddings=True)
    export_hf_checkpoint(model.state_dict(), model.config, tmp_path, dtype=torch.bfloat16)
    stored = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied: transformers ties it back
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(CheckpointError, match="no Hugging Face name: extra.weight"):
        export_hf_checkpoint({"extra.weight": torch.ones(2)}, model.config, tmp_path)


# ------------------------------------------------------------------------ errors
def test_mismatched_checkpoint_lists_the_first_mismatches(tmp_path):
    save_hf(tmp_path, "llama")
    config_file = tmp_path / "config.json"
    good = json.loads(config_file.read_text())

    config_file.write_text(json.dumps({**good, "intermediate_size": 128}))
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(tmp_path)
    message = str(err.value)
    assert "6 shape mismatch(es)" in message  # gate, up, down of two layers
    assert "model.layers.0.mlp.gate_proj.weight: checkpoint (96, 64) vs model (128, 64)" in message
    assert str(tmp_path) in message

    config_file.write_text(json.dumps({**good, "num_hidden_layers": 4}))
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(tmp_path)
    message = str(err.value)
    assert "18 missing: model.layers.2.input_layernorm.weight, model.layers.2.self_attn" in message
    assert message.count("model.layers.") == 5  # the first few, not all 18

    config_file.write_text(json.dumps(good))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(tmp_path)
    assert "1 missing: model.norm.weight" in str(err.value)
    assert "1 unexpected: model.layers.0.self_attn.q_norm.weight" in str(err.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"model_type": "gpt2"},
            "model_type='gpt2' is not supported; supported: llama",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=true also adds a bias to o_proj"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
            "'dynamic' is not supported",
        ),
        ({"hidden_size": None}, "no 'hidden_size'"),
    ],
)
def test_unsupported_configs_are_refused(changes, message):
    config = {**hf_kwargs(), "model_type": "llama", **changes}
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        model_config_from_hf(config)


def test_unsupported_model_type_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match="model_type='mamba'"):
        load_hf_checkpoint(tmp_path)


def test_legacy_rope_keys_and_qwen2_window():
    legacy = {
        **hf_kwargs(),
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
    }
    config = model_config_from_hf(legacy, name="l3")
    assert config.name == "l3" and config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScalingConfig(
        type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_seq_len=32,
    )
    linear = {**legacy, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert model_config_from_hf(linear).rope_scaling == RopeScalingConfig("linear", 2.0)
    # Qwen2 configs carry a sliding_window that only counts with use_sliding_window
    qwen = {**hf_kwargs(), "model_type": "qwen2", "sliding_window": 16}
    assert model_config_from_hf({**qwen, "use_sliding_window": False}).max_seq_len == 128
    windowed = {**qwen, "use_sliding_window": True, "max_window_layers": 0}
    assert model_config_from_hf(windowed).max_seq_len == 16


@pytest.mark.parametrize("name", ["missing", "no-config", "bin-only", "no-weights", "corrupt"])
def test_missing_pieces_name_the_folder(tmp_path, name):
    folder = tmp_path / "model"
    if name != "missing":
        folder.mkdir()
    if name in ("bin-only", "no-weights", "corrupt"):
        (folder / "config.json").write_text(json.dumps({**hf_kwargs(), "model_type": "llama"}))
    if name == "bin-only":
        (folder / "pytorch_model.bin").write_bytes(b"")
    if name == "corrupt":
        (folder / "model.safetensors").write_bytes(b"not safetensors at all")
    expected = {
        "missing": "no Hugging Face model folder",
        "no-config": "has no config.json",
        "bin-only": "only PyTorch .bin weights",
        "no-weights": "neither model.safetensors nor",
        "corrupt": "is not a readable safetensors file",
    }[name]
    with pytest.raises(CheckpointError, match=expected) as err:
        load_hf_checkpoint(folder)
    assert str(folder) in str(err.value)


def test_name_mapping_round_trips():
    model = native_model(qkv_bias=True, family="qwen2")
    for name in model.state_dict():
        hf_name = LLAMA_NAMES.to_hf(name)
        assert hf_name is not None and LLAMA_NAMES.to_native(hf_name) == name
    assert (
        LLAMA_NAMES.to_hf("layers.0.feed_forward.w1.weight")
        == "model.layers.0.mlp.gate_proj.weight"
    )
    assert (
        LLAMA_NAMES.to_hf("layers.3.feed_forward.w3.weight") == "model.layers.3.mlp.up_proj.weight"
    )
    assert LLAMA_NAMES.to_native("model.layers.0.self_attn.rotary_emb.inv_freq") is None


def test_tokenizer_template_from_transformers_files(tmp_path, tokenizer_file):
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(tmp_path)  # transformers 5 writes chat_template.jinja
    tokenizer, template = load_hf_tokenizer(tmp_path)
    assert template == CHAT_TEMPLATE
    assert tokenizer.encode("class Point").ids == hf_tokenizer("class Point").input_ids
    with pytest.raises(DataError, match=str(tmp_path / "nowhere")):
        load_hf_tokenizer(tmp_path / "nowhere")


# ------------------------------------------------------ into a configured model
def test_hf_weights_load_into_a_model_of_the_same_config(tmp_path):
    hf = save_hf(tmp_path, "qwen2", max_shard_size="40KB", tie_word_embeddings=True)
    _, config = load_hf_checkpoint(tmp_path)
    assert is_hf_folder(tmp_path) and not is_hf_folder(tmp_path / "model.safetensors")
    torch.manual_seed(3)
    model = Transformer(replace(config, name="mine", max_seq_len=64)).eval()  # random init
    load_hf_weights_into(model, tmp_path, "stage.init_from='x'")
    x = tokens(2, 60)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    assert model.output.weight is model.tok_embeddings.weight  # still tied


def test_hf_config_differences_are_listed_before_any_weight_is_read(tmp_path):
    save_hf(tmp_path, "llama")
    _, config = load_hf_checkpoint(tmp_path)
    model = Transformer(replace(config, ffn_dim=128, norm_eps=1e-5, qkv_bias=True, family="qwen2"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_hf_weights_into(model, tmp_path, "stage.init_from='hf'")
    message = str(err.value)
    assert message.startswith("stage.init_from='hf': its config.json does not match")
    assert "(4 difference(s))" in message
    assert "model.family='qwen2' vs model_type's family='llama'" in message
    assert "model.ffn_dim=128 vs intermediate_size=96" in message
    assert "model.norm_eps=1e-05 vs rms_norm_eps=1e-06" in message
    assert "model.qkv_bias=True vs q/k/v biases (model_type qwen2)=False" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    # the config fits but a tensor is missing: named, with the folder
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 missing: model\.layers\.1\.mlp\.down_proj"):
        load_hf_weights_into(Transformer(config), tmp_path, "stage.init_from='hf'")


def test_export_carries_the_template_and_eos_saved_beside_the_tokenizer(tmp_path, tokenizer_file):
    run_dir = tmp_path / "run"
    save_tokenizer_folder(
        run_dir, tokenizer_file, eos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    model = native_model()
    out = export_hf_checkpoint(model, model.config, tmp_path / "hf", run_dir)
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert written["chat_template"] == CHAT_TEMPLATE and written["eos_token"] == "<|endoftext|>"
    assert written["model_max_length"] == model.config.max_seq_len
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "def add"}, {"role": "assistant", "content": "(a)"}]
    assert (
        hf_tokenizer.apply_chat_template(messages, tokenize=False) == "<user>def add<assistant>(a)"
    )
    # an explicit template still wins
    export_hf_checkpoint(model, model.config, tmp_path / "hf", run_dir, chat_template="{{ 'x' }}")
    assert load_hf_tokenizer(tmp_path / "hf")[1] == "{{ 'x' }}"
    with pytest.raises(DataError, match="eos_token='<missing>' is not a token"):
        save_tokenizer_folder(tmp_path / "bad", tokenizer_file, eos_token="<missing>")


def test_exported_files_follow_the_umask(tmp_path, tokenizer_file):
    # safetensors and tempfile.mkstemp create files 0600; an export is meant to be shared
    previous = os.umask(0o022)
    try:
        model = native_model()
        out = export_hf_checkpoint(model, model.config, tmp_path / "hf", tokenizer_file)
        sharded = export_hf_checkpoint(model, model.config, tmp_path / "sh", max_shard_bytes=40_000)
    finally:
        os.umask(previous)
    files = [*out.iterdir(), *sharded.glob("*.safetensors")]
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in files
    }
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {
        f.name: oct(0o644) for f in files
    }


def _tokenizer_with_pad(folder, tokenizer_file, config: dict | None):
    """A tokenizer folder whose tokenizer has a ``<pad>`` token, as a downloaded one does."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.add_special_tokens(["<pad>"])
    save_tokenizer(tokenizer, folder)
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_export_keeps_the_pad_token_or_pads_with_eos(tmp_path, tokenizer_file):
    model = native_model()
    # the source names one (as an AddedToken dict, the way transformers saves it)
    source = _tokenizer_with_pad(
        tmp_path / "src",
        tokenizer_file,
        {"eos_token": "<|endoftext|>", "pad_token": {"content": "<pad>", "special": True}},
    )
    out = export_hf_checkpoint(model, model.config, tmp_path / "hf", source)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.pad_token == "<pad>"
    assert hf_tokenizer.pad_token_id == hf_tokenizer.convert_tokens_to_ids("<pad>")
    # a run's folder written from it (save_tokenizer_folder) keeps it, and so does its export
    run_dir = save_tokenizer_folder(tmp_path / "run", source, eos_token="<|endoftext|>")
    again = export_hf_checkpoint(model, model.config, tmp_path / "hf2", run_dir)
    assert transformers.AutoTokenizer.from_pretrained(again).pad_token == "<pad>"

    # none named: the EOS token, which the chat and preference data pad with
    bare = export_hf_checkpoint(model, model.config, tmp_path / "bare", tokenizer_file)
    assert transformers.AutoTokenizer.from_pretrained(bare).pad_token == "<|endoftext|>"
    chat_run = save_tokenizer_folder(tmp_path / "chat", tokenizer_file, eos_token="<|endoftext|>")
    assert json.loads((chat_run / "tokenizer_config.json").read_text())["pad_token"] == (
        "<|endoftext|>"
    )

    with pytest.raises(DataError, match=r"pad_token='<nope>' is not a token of"):
        save_tokenizer_folder(tmp_path / "x", tokenizer_file, eos_token=None, pad_token="<nope>")
