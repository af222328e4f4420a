"""The decoder's block options (``model.qk_norm``, ``model.norm_placement``,
``model.nope_layers``): their defaults leave the Llama block alone, each option computes
what a from-scratch reference computes, and they work with the init, the KV cache, the
attention kernels, LoRA, autocast and the optimizer's no-decay group."""

import warnings
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model_config

from recipes_lib.adapters import apply_adapter
from recipes_lib.config.schema import AdapterConfig, ModelConfig, resolved_model_fields
from recipes_lib.errors import ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import KVCache, Transformer
from recipes_lib.models.rope import apply_rope
from recipes_lib.optim.optimizer import split_parameters

VOCAB = 97
QWEN3 = {"family": "qwen3", "qk_norm": "head", "head_dim": 32}  # 4 x 32 != dim 64
OLMO2 = {"family": "olmo2", "qk_norm": "full", "norm_placement": "post"}
SMOLLM3 = {"family": "smollm3", "nope_layers": [0]}  # layer 0 without RoPE
SHAPES = {
    "llama": {},
    "qwen2": {"family": "qwen2", "qkv_bias": True, "tie_embeddings": True},
    "qwen3": QWEN3,
    "olmo2": OLMO2,
    "smollm3": SMOLLM3,
}
NEW = ["qwen3", "olmo2", "smollm3"]  # the shapes with options beyond the defaults


def tiny(**overrides) -> ModelConfig:
    shape = {"vocab_size": VOCAB, "dim": 64, "ffn_dim": 96, "max_seq_len": 64}
    return tiny_model_config(**{**shape, **overrides})


def build(config: ModelConfig, attention="sdpa", seed=0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config, attention).eval()
    with torch.no_grad():  # unit gains and zero biases would hide a misplaced norm
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def tokens(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def reference_logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The decoder written out op by op from the options (the attention kernel shared)."""
    c = model.config
    B, T = x.shape
    hs, nh, nkv = model.head_dim, c.n_heads, c.n_kv_heads or c.n_heads
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    mask = model.attention_backend.build_mask(None, T, device=x.device)

    def rms(t, norm):
        return F.rms_norm(t, (t.shape[-1],), norm.weight, c.norm_eps)

    def attend(layer, index, h):
        a = layer.attention
        q, k, v = a.wq(h), a.wk(h), a.wv(h)
        if c.qk_norm == "full":
            q, k = rms(q, a.q_norm), rms(k, a.k_norm)
        q, k, v = q.view(B, T, nh, hs), k.view(B, T, nkv, hs), v.view(B, T, nkv, hs)
        if c.qk_norm == "head":
            q, k = rms(q, a.q_norm), rms(k, a.k_norm)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if index not in c.nope_layers:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return a.wo(a.backend(q, k, v, mask).transpose(1, 2).reshape(B, T, nh * hs))

    def mlp(layer, h):
        f = layer.feed_forward
        return f.w2(F.silu(f.w1(h)) * f.w3(h))

    h = model.tok_embeddings(x)
    for index, layer in enumerate(model.layers):
        if c.norm_placement == "post":
            h = h + rms(attend(layer, index, h), layer.attention_norm)
            h = h + rms(mlp(layer, h), layer.ffn_norm)
        else:
            h = h + attend(layer, index, rms(h, layer.attention_norm))
            h = h + mlp(layer, rms(h, layer.ffn_norm))
    return model.output(rms(h, model.norm))


def test_defaults_are_llamas_block():
    config = ModelConfig()
    assert (config.qk_norm, config.norm_placement, config.nope_layers) == ("none", "pre", [])
    model = build(tiny())
    assert all(layer.attention.use_rope for layer in model.layers)
    # no new weights, the plain torch norms
    assert not [n for n in model.state_dict() if "q_norm" in n or "k_norm" in n]
    assert len(model.state_dict()) == 2 * 9 + 3
    assert type(model.layers[0].attention_norm) is torch.nn.RMSNorm
    assert type(model.layers[0].ffn_norm) is torch.nn.RMSNorm


@pytest.mark.parametrize("shape", SHAPES)
def test_each_option_computes_the_reference(shape):
    model = build(tiny(**SHAPES[shape]))
    x = tokens(2, 40)
    with torch.no_grad():
        ours, reference = model(x), reference_logits(model, x)
    if shape in ("llama", "qwen2"):  # the defaults: the very same operations
        torch.testing.assert_close(ours, reference, atol=0, rtol=0)
    else:
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"qk_norm": "per_head"}, "model.qk_norm='per_head' is not one of none | head | full"),
        (
            {"norm_placement": "sandwich"},
            "model.norm_placement='sandwich' is not one of pre | post",
        ),
        ({"qk_norm": "head", "family": "olmo2"}, "model.family=olmo2 with model.qk_norm='head'"),
        ({"nope_layers": [2]}, r"model.nope_layers=\[2\] must list .* in 0..1 \(model.n_layers=2"),
        ({"nope_layers": [1, 0]}, r"model.nope_layers=\[1, 0\] must list layers .* increasing"),
        ({"nope_layers": [1, 1]}, r"model.nope_layers=\[1, 1\] must list"),
        ({"nope_layers": 1}, "model.nope_layers=1 must list"),
        ({"nope_layers": [1]}, r"model.family=llama with model.nope_layers=\[1\]"),
    ],
)
def test_bad_option_values_are_one_line_naming_the_key(changes, message):
    with pytest.raises(ConfigError, match=message) as err:
        Transformer(tiny(**changes))
    assert "\n" not in str(err.value)


def initialised_on_meta(config: ModelConfig) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


@pytest.mark.parametrize(
    ("options", "sizes"),
    [(QWEN3, (32, 32)), ({**OLMO2, "n_kv_heads": 2}, (64, 32))],
    ids=["head", "full"],
)
def test_new_norms_are_sized_by_mode_and_initialised_to_one(options, sizes):
    config = tiny(**options)
    model = initialised_on_meta(config)
    for layer in model.layers:
        assert tuple(layer.attention.q_norm.weight.shape) == (sizes[0],)
        assert tuple(layer.attention.k_norm.weight.shape) == (sizes[1],)
        for norm in (layer.attention.q_norm, layer.attention.k_norm, layer.attention_norm):
            assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    # the new norms draw nothing: the other weights are the default model's
    plain = initialised_on_meta(
        replace(config, family="llama", qk_norm="none", norm_placement="pre")
    )
    for name, tensor in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("shape", NEW)
def test_kv_cache_decoding_equals_the_full_forward(shape):
    model = build(tiny(init_std=0.3, **SHAPES[shape]))
    prompt = [5, 17, 42, 3, 50]
    cached = generate(model, prompt, 30)
    assert cached == generate(model, prompt, 30, use_cache=False) and len(set(cached)) > 1
    sequence = tokens(2, 30, seed=1)
    # without q/k norms these weights give logits near 10, where the two paths' float32
    # sums differ by up to 3e-5 (as a Llama's do; in float64 they agree to 1e-13)
    tol = 1e-5 if "qk_norm" in SHAPES[shape] else 5e-5
    with torch.no_grad():
        full = model(sequence)
        cache = KVCache.for_model(model, batch_size=2, max_len=30)
        prefill = model(sequence[:, :9], cache=cache)  # 1.1e-5 apart on some CPUs
        torch.testing.assert_close(prefill, full[:, :9], atol=5e-5, rtol=5e-5)
        for t in range(9, 30):
            step = model(sequence[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", NEW)
def test_flex_attention_sees_ordinary_queries_and_keys(shape):
    sdpa = build(tiny(**SHAPES[shape]))
    flex = build(tiny(**SHAPES[shape]), attention="flex")
    x = tokens(2, 32)
    doc_ids = torch.tensor([[0] * 12 + [1] * 20, [0] * 32])
    with torch.no_grad():
        torch.testing.assert_close(flex(x), sdpa(x), atol=1e-5, rtol=1e-5)
        # within documents: the second document alone is the same as a fresh sequence
        packed = flex(x, doc_ids)
        torch.testing.assert_close(packed[0, 12:], sdpa(x[:1, 12:])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", ["qwen3", "olmo2"])
def test_lora_adapts_the_linears_and_leaves_the_new_norms_frozen(shape):
    torch.manual_seed(0)
    model = Transformer(tiny(**SHAPES[shape]))
    model = apply_adapter(model, AdapterConfig(kind="lora", r=4, alpha=8, dropout=0.0))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 2 and all("lora_" in n for n in trainable)
    assert not model.layers[0].attention.q_norm.weight.requires_grad
    logits = model(tokens(2, 12))
    F.cross_entropy(logits.flatten(0, 1), tokens(2, 12, seed=1).flatten()).backward()


@pytest.mark.parametrize("shape", ["qwen3", "olmo2"])
def test_new_norms_are_not_decayed_and_take_bfloat16_under_autocast(shape):
    model = build(tiny(**SHAPES[shape]))
    groups = split_parameters(model)
    assert "layers.0.attention.q_norm.weight" in groups.no_decay_names
    assert "layers.1.ffn_norm.weight" in groups.no_decay_names
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. rms_norm's "Mismatch dtype" fallback
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens(2, 16))
    assert torch.isfinite(logits).all()
    reference = model(tokens(2, 16)).detach()
    torch.testing.assert_close(logits.float(), reference, atol=0.1, rtol=0.1)


@pytest.mark.parametrize("shape", ["olmo2", "smollm3"])
def test_activation_checkpointing_gives_the_same_gradients(shape):
    grads = []
    for enabled in (False, True):
        model = build(tiny(**SHAPES[shape])).train()
        model.set_activation_checkpointing(enabled)
        model(tokens(2, 16)).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_options_a_record_leaves_out_read_as_their_defaults():
    config = tiny()
    options = ("qk_norm", "norm_placement", "nope_layers")
    record = {k: v for k, v in asdict(config).items() if k not in options}
    assert resolved_model_fields(record, "shape") == resolved_model_fields(config, "shape")
    assert resolved_model_fields(record, "shape") != resolved_model_fields(tiny(**OLMO2), "shape")
    # nope_layers is a compute option: left out, RoPE is in every layer
    compute = resolved_model_fields(record, "compute")
    assert compute == resolved_model_fields(config, "compute")
    assert compute != resolved_model_fields(tiny(nope_layers=[1]), "compute")


def test_a_heads_width_is_its_own_or_the_model_width_over_the_heads():
    from recipes_lib.config.model import head_width

    config = tiny_model_config()
    assert config.head_dim is None
    assert head_width(config) == config.dim // config.n_heads
    wide = replace(config, head_dim=3 * config.dim // config.n_heads)
    assert head_width(wide) == 3 * config.dim // config.n_heads
    model = Transformer(wide)  # the attention's projections are that wide
    assert model.layers[0].attention.wq.out_features == config.n_heads * head_width(wide)
