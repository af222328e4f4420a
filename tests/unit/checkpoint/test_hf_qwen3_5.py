"""Qwen3.5 (dense and MoE) against transformers: the hybrid stack of Gated DeltaNet linear
attention and gated full attention (partial RoPE, (1 + w) norms, grouped value heads,
key and value widths apart, a gated shared expert) on import, export and greedy
generation; packed documents kept apart by the linear layers; left-padded batched
decoding; the image-text folder; and the refusals."""

import json
from dataclasses import replace

import pytest
import torch
from hf_parity import PROMPT, TINY_SHAPE, VOCAB, hf_greedy, logits_of, nudged_hf_model, tokens
from safetensors.torch import load_file, save_file
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf import load_hf_checkpoint, model_config_from_hf
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.errors import CheckpointError, ConfigError, UnsupportedKernelError
from recipes_lib.generate import generate
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES
from recipes_lib.models.kv_cache import KVCache
from recipes_lib.models.sampling import sample_completions

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    TINY_SHAPE,
    num_hidden_layers=4,
    head_dim=16,
    rms_norm_eps=1e-6,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per query/key head
    linear_key_head_dim=8,
    linear_value_head_dim=12,  # key and value widths apart
)
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,  # two experts' widths
)
# case -> (moe, transformers overrides)
CASES = {
    "dense-default-pattern": (False, {}),
    "dense-own-pattern-half-rotary-tied": (
        False,
        {
            "layer_types": ["full_attention", "linear_attention"] * 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e5,
                "partial_rotary_factor": 0.5,
            },
            "tie_word_embeddings": True,
            "linear_conv_kernel_dim": 3,
        },
    ),
    "moe-gated-shared-expert": (True, MOE),
}


def hf_model(moe: bool, **overrides):
    if moe:
        classes = (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM)
    else:
        classes = (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM)
    return nudged_hf_model(*classes, **{**SHAPE, **overrides})


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A dense model transformers saved, loaded natively (flex attention: it masks
    documents): (transformers', ours)."""
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf = hf_model(False)
    hf.save_pretrained(folder)
    model, _ = load_hf_checkpoint(folder, attention="flex")
    return hf, model


@pytest.mark.parametrize("case", CASES)
def test_import_export_and_generation_match_transformers(tmp_path, case):
    moe, overrides = CASES[case]
    hf = hf_model(moe, **overrides)
    hf.save_pretrained(tmp_path / "theirs")

    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert config.family == ("qwen3_5_moe" if moe else "qwen3_5")
    types = hf.config.layer_types
    assert config.linear_layers == [i for i, t in enumerate(types) if t == "linear_attention"]
    assert (config.norm_gain_offset, config.qk_norm, config.attention_output_gate) == (
        1.0,
        "head",
        True,
    )
    assert config.moe_shared_gate == moe and config.moe_shared_experts == (2 if moe else 0)
    x = tokens(VOCAB, 2, 40)
    torch.testing.assert_close(logits_of(model, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)
    # the cached greedy decoding (recurrent state and KV cache) is transformers'
    assert generate(model, PROMPT, 10) == hf_greedy(hf, 10)

    out = export_hf_checkpoint(model, config, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again).__name__ == type(hf).__name__
    torch.testing.assert_close(
        logits_of(again.eval(), x), logits_of(model, x), atol=1e-4, rtol=1e-4
    )
    reloaded, config_again = load_hf_checkpoint(out)
    assert replace(config_again, name=config.name) == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_packed_documents_are_the_documents_one_by_one(dense):
    """The linear layers' convolution and state start afresh at each document, as the
    attention layers' mask does: a packed row is its documents run alone."""
    _, model = dense
    lengths = [7, 1, 70, 40]  # one shorter than the convolution, two across chunks of 64
    x = tokens(VOCAB, 1, sum(lengths), seed=3)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(x, doc_ids)
        labels = torch.roll(x, -1, dims=1)
        packed_loss = model(x, doc_ids, labels=labels, per_token=True)
    start = 0
    for n in lengths:
        alone = logits_of(model, x[:, start : start + n])
        torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
        piece, piece_labels = x[:, start : start + n], labels[:, start : start + n]
        with torch.no_grad():
            own = model(piece, labels=piece_labels, per_token=True)
        torch.testing.assert_close(packed_loss[:, start : start + n], own, atol=1e-5, rtol=1e-5)
        start += n
    # without the documents the later ones would see the earlier ones
    with torch.no_grad():
        whole = model(x)
    assert not torch.allclose(whole[:, lengths[0] :], packed[:, lengths[0] :], atol=1e-3)


def test_left_padded_batched_decoding_is_each_prompt_alone(dense):
    _, model = dense
    prompts = [PROMPT, PROMPT[:3], [9]]
    batched = sample_completions(model, prompts, 6, temperature=0.0)
    for prompt, tokens_ in zip(prompts, batched.tokens, strict=True):
        assert tokens_ == generate(model, prompt, 6)


def test_recipes_generate_decodes_an_exported_folder(tmp_path, dense, capsys):
    """``recipes-generate`` on an exported folder: the greedy tokens ``generate`` gives."""
    from recipes_lib.cli import generate_command
    from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer
    from recipes_lib.generate import load_for_generation

    _, model = dense
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 30
    tokenizer_file = save_tokenizer(
        train_bpe_tokenizer(texts, vocab_size=VOCAB), tmp_path / "tokenizer.json"
    )
    export_hf_checkpoint(model, model.config, tmp_path / "hf", tokenizer_file)
    args = [f"checkpoint={tmp_path / 'hf'}", "prompt=def add", "max_new_tokens=8", "device=cpu"]
    assert generate_command(args) == 0
    tokenizer = load_for_generation(tmp_path / "hf").tokenizer
    ids = tokenizer.encode("def add").ids
    expected = tokenizer.decode(ids + generate(model, ids, 8, eos_id=0))
    assert capsys.readouterr().out == expected + "\n"


def test_the_recurrent_cache_holds_no_keys_and_never_rewinds(dense):
    _, model = dense
    cache = KVCache.for_model(model, batch_size=1, max_len=16)
    linear = model.config.linear_layers
    assert all(cache.keys[i].numel() == 0 for i in linear)
    assert set(cache.states) == set(linear)
    x = tokens(VOCAB, 1, 6)
    with torch.no_grad():
        model(x, cache=cache)
        with pytest.raises(ValueError, match="never rewinds"):
            model(x[:, :2], cache=cache, start_pos=2)
        again = model(x, cache=cache, start_pos=0)  # afresh from position 0
    torch.testing.assert_close(again, logits_of(model, x), atol=1e-5, rtol=1e-5)


def test_the_cache_never_allocates_keys_for_the_linear_layers(dense, monkeypatch):
    # a cache sized for batched sampling holds only the attention layers' keys and
    # values: allocating every layer's first would need the dense cache's memory at once
    _, model = dense
    allocated = []
    zeros = torch.zeros

    def counted(*args, **kwargs):
        tensor = zeros(*args, **kwargs)
        allocated.append(tensor.numel())
        return tensor

    monkeypatch.setattr(torch, "zeros", counted)
    cache = KVCache.for_model(model, batch_size=2, max_len=16)
    monkeypatch.undo()
    attention = [i for i in range(model.config.n_layers) if i not in model.config.linear_layers]
    held = sum(cache.keys[i].numel() + cache.values[i].numel() for i in attention)
    assert held > 0 and sum(allocated) == held


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_an_image_text_folder_trains_its_text_tower_and_keeps_the_rest(tmp_path, moe):
    """A published folder's layout (``Qwen3_5ForConditionalGeneration``,
    ``Qwen3_5MoeForConditionalGeneration``): the text tensors under
    ``model.language_model.``, the experts stacked in one tensor each
    (``mlp.experts.gate_up_proj``, ``down_proj``), a vision tower and
    multi-token-prediction weights beside them, which are not read and are written back
    untouched; the trained text tensors go back under the folder's own names."""
    hf = hf_model(moe, **(MOE if moe else {}))
    folder = tmp_path / "image_text"
    folder.mkdir()
    text = {k: v.contiguous() for k, v in hf.state_dict().items()}  # transformers' layout
    assert not moe or "model.layers.0.mlp.experts.gate_up_proj" in text
    stored = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in text.items()
    }
    extra = {
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(6, 4),
        "mtp.fc.weight": torch.randn(3, 3),
    }
    save_file({**stored, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    text_config = {k: v for k, v in hf.config.to_dict().items() if k != "architectures"}
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    config = {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": model_type,
        "text_config": {**text_config, "mtp_num_hidden_layers": 1},
        "vision_config": {"depth": 1},
    }
    (folder / "config.json").write_text(json.dumps(config))

    loaded, read = load_hf_checkpoint(folder)
    assert read.family == model_type
    x = tokens(VOCAB, 2, 30)
    torch.testing.assert_close(logits_of(loaded, x), logits_of(hf, x), atol=1e-4, rtol=1e-4)

    with torch.no_grad():  # as if trained
        for p in loaded.parameters():
            p.add_(0.01)
    out = export_hf_checkpoint(loaded, read, tmp_path / "back", base=folder)
    written = load_file(str(out / "model.safetensors"))
    for name, tensor in extra.items():
        assert torch.equal(written[name], tensor), name
    assert set(written) == set(stored) | set(extra)
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    again, _ = load_hf_checkpoint(out)
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_every_tensor_has_a_name_both_ways():
    for moe, family in ((False, "qwen3_5"), (True, "qwen3_5_moe")):
        config = model_config_from_hf(hf_model(moe, **(MOE if moe else {})).config.to_dict())
        with torch.device("meta"):
            model = Transformer(config)
        names = FAMILIES[family].names
        for name in model.state_dict():
            if names.is_stacked(name):
                continue
            hf_name = names.to_hf(name)
            assert hf_name is not None and names.to_native(hf_name) == name, name


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_bias": True}, "qwen3_5: attention_bias=true"),
        ({"attn_output_gate": False}, "qwen3_5: attn_output_gate=false"),
        ({"layer_types": ["linear_attention", "bogus"] * 2}, "qwen3_5: layer_types must name"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
            "rope_parameters.rope_type='yarn' is not supported",
        ),
    ],
)
def test_what_the_decoder_cannot_compute_is_refused(changes, message):
    config = {**hf_model(False).config.to_dict(), **changes}
    with pytest.raises(CheckpointError, match=message) as err:
        model_config_from_hf(config)
    assert "\n" not in str(err.value)


def qwen3_5_config(**changes):
    options = dict(
        FAMILIES["qwen3_5"].fixed,
        family="qwen3_5",
        head_dim=16,
        partial_rotary_factor=0.25,
        linear_layers=[0],
        linear_heads=4,
        linear_key_heads=2,
        linear_key_dim=8,
        linear_value_dim=8,
    )
    return tiny_model_config(**{**options, **changes})


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"qk_norm": "full"}, ConfigError, "model.family=qwen3_5 with model.qk_norm='full'"),
        ({"linear_heads": 3}, ConfigError, "model.linear_heads=3 is not a multiple"),
        ({"linear_layers": [1, 0]}, ConfigError, "model.linear_layers=\\[1, 0\\] must list"),
        ({"linear_conv_kernel": 1}, ConfigError, "model.linear_conv_kernel=1 must be"),
        ({"moe_shared_gate": True}, ConfigError, "model.moe_shared_gate"),
    ],
)
def test_options_qwen3_5_cannot_have_are_refused(changes, error, message):
    with pytest.raises(error, match=message) as err:
        Transformer(qwen3_5_config(**changes))
    assert "\n" not in str(err.value)


def test_context_parallelism_over_linear_layers_is_refused():
    model = Transformer(qwen3_5_config())
    shard = ContextShard(seq_len=16, degree=2, rank=0)
    with pytest.raises(UnsupportedKernelError, match="does not shard linear attention"):
        model.set_context_shard(shard)
