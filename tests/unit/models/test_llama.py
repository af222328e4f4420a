import copy
import math

import pytest
import torch
from hf_folders import tiny_hf_model
from tiny import tiny_model_config

from recipes_lib.config.schema import ModelConfig, RopeScalingConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.models.rope import rope_inv_freq

VOCAB = 101


def tiny(**overrides) -> ModelConfig:
    shape = {"vocab_size": VOCAB, "dim": 64, "n_kv_heads": None, "ffn_dim": 96, "max_seq_len": 64}
    return tiny_model_config(**{**shape, **overrides})


def build(config: ModelConfig, attention="sdpa", seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(config, attention).eval()


def tokens(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_shapes():
    model = build(tiny())
    x = tokens(3, 20)
    assert model(x).shape == (3, 20, VOCAB)
    assert model.forward_hidden(x).shape == (3, 20, 64)
    assert model.rope_cos.shape == (64, 16)
    assert "rope_cos" not in model.state_dict()  # derived from the config, not saved


def test_later_tokens_do_not_change_earlier_logits():
    model = build(tiny())
    x = tokens(1, 24)
    changed = x.clone()
    changed[0, 10] = (x[0, 10] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], atol=0, rtol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize(
    "overrides",
    [
        {"n_kv_heads": 2},
        {"n_kv_heads": 1, "qkv_bias": True, "family": "qwen2"},
        {"tie_embeddings": True},
        {"head_dim": 32},  # n_heads * head_dim != dim
    ],
    ids=["gqa", "mqa-bias", "tied", "head-dim"],
)
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_variants_build_run_and_train(overrides, attention):
    config = tiny(**overrides)
    model = build(config, attention).train()
    layer = model.layers[0].attention
    head_dim = overrides.get("head_dim", 16)
    assert layer.wq.weight.shape == (4 * head_dim, 64)
    assert layer.wk.weight.shape == ((config.n_kv_heads or 4) * head_dim, 64)
    assert (layer.wq.bias is not None) == config.qkv_bias
    assert (model.output.weight is model.tok_embeddings.weight) == config.tie_embeddings
    logits = model(tokens(2, 16))
    assert logits.shape == (2, 16, VOCAB) and torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_packed_documents_give_each_document_its_own_logits():
    model = build(tiny(n_kv_heads=2), "flex")
    lengths = (5, 17, 9)
    x = tokens(1, sum(lengths))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(x, doc_ids)
        start = 0
        for n in lengths:
            alone = model(x[:, start : start + n])  # positions restart at 0
            torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
            start += n
        unmasked = model(x)
    assert not torch.allclose(packed[:, 5:], unmasked[:, 5:], atol=1e-3)


def test_sdpa_model_refuses_doc_ids():
    model = build(tiny())
    with pytest.raises(ConfigError, match="kernels.attention=flex"):
        model(tokens(1, 8), torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_init_weights_is_deterministic(tie):
    config = tiny(n_kv_heads=2, qkv_bias=True, family="qwen2", tie_embeddings=tie)
    reference = build(config, seed=0)
    torch.manual_seed(7)
    reference.init_weights()

    with torch.device("meta"):
        model = Transformer(config)
    assert model.tok_embeddings.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    model.init_weights()

    assert (model.output.weight is model.tok_embeddings.weight) == tie
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(model.rope_cos, reference.rope_cos, atol=0, rtol=0)
    x = tokens(2, 12)
    torch.testing.assert_close(model.eval()(x), reference(x), atol=0, rtol=0)


def test_init_weights_distribution():
    config = tiny(n_layers=8, dim=128, ffn_dim=512, qkv_bias=True, family="qwen2", init_std=0.02)
    model = build(config)
    layer = model.layers[3]
    assert layer.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * 8)
    assert layer.attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert layer.feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.all(layer.attention.wk.bias == 0)
    assert torch.all(layer.ffn_norm.weight == 1) and torch.all(model.norm.weight == 1)


def test_llama3_rope_scaling_bands():
    scaling = RopeScalingConfig(
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_seq_len=8192,
    )  # Llama 3.1's values
    plain = rope_inv_freq(128, 500000.0, RopeScalingConfig())
    scaled = rope_inv_freq(128, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4  # short wavelengths: untouched
    low = wavelen > 8192 / 1  # long wavelengths: divided by factor
    medium = ~high & ~low
    assert high.any() and low.any() and medium.any()
    torch.testing.assert_close(scaled[high], plain[high], atol=0, rtol=0)
    torch.testing.assert_close(scaled[low], plain[low] / 8, atol=0, rtol=1e-6)
    assert torch.all(scaled[medium] < plain[medium])
    assert torch.all(scaled[medium] > plain[medium] / 8)
    assert torch.all(scaled[1:] < scaled[:-1])  # still monotone across the bands


def test_linear_rope_scaling_divides_frequencies():
    plain = rope_inv_freq(16, 10000.0, RopeScalingConfig())
    linear = rope_inv_freq(16, 10000.0, RopeScalingConfig(type="linear", factor=4.0))
    torch.testing.assert_close(linear, plain / 4)


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token(tie):
    c = tiny(n_kv_heads=2, head_dim=32, tie_embeddings=tie)
    model = build(c)
    hd, nh, nkv = 32, 4, 2
    per_layer = (
        2 * c.dim * nh * hd  # wq, wo
        + 2 * c.dim * nkv * hd  # wk, wv
        + 3 * c.dim * c.ffn_dim  # w1, w2, w3
        + 2 * c.dim  # norms
    )
    matmul_params = c.n_layers * per_layer + c.dim + VOCAB * c.dim  # + final norm + head
    expected = 6 * matmul_params + 12 * c.n_layers * nh * hd * 256
    assert model.flops_per_token(256) == expected
    embeddings = VOCAB * c.dim
    total = matmul_params + (0 if tie else embeddings)
    assert model.num_params() == total
    assert model.num_params(exclude_embeddings=True) == total - embeddings


def test_input_longer_than_max_seq_len_raises():
    model = build(tiny())
    with pytest.raises(ConfigError, match=r"length 65.*model\.max_seq_len=64"):
        model(tokens(1, 65))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dim": 66}, "model.dim=66"),
        ({"n_kv_heads": 3}, "model.n_kv_heads=3"),
        ({"rope_scaling": RopeScalingConfig(type="ntk")}, "model.rope_scaling.type='ntk'"),
        (
            {"rope_scaling": RopeScalingConfig(type="llama3", low_freq_factor=4.0)},
            "high_freq_factor",
        ),
    ],
)
def test_bad_shapes_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        Transformer(tiny(**overrides))


def test_unknown_attention_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="sdpa"):
        Transformer(tiny(), attention="paged")


def test_deepcopy_keeps_outputs():
    model = build(tiny(), "flex")
    x = tokens(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(copy.deepcopy(model)(x), model(x), atol=0, rtol=0)


# --- Hugging Face parity: proves the weight names and the RoPE convention --------------

_HF_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def hf_to_native(state_dict: dict) -> dict:
    renamed = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight":
            new = "output.weight"
        elif name.startswith("model.layers."):
            new = name.removeprefix("model.")
            for hf, ours in _HF_LAYER_NAMES.items():
                new = new.replace(f".{hf}.", f".{ours}.")
        else:
            new = {"model.embed_tokens.weight": "tok_embeddings.weight"}.get(name, name)
            new = new.replace("model.norm.", "norm.")
        renamed[new] = tensor
    return renamed


_LLAMA3_SCALING = RopeScalingConfig(
    type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=32
)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_embeddings": True, "head_dim": 32, "rope_theta": 500000.0}),
        ("llama", {"rope_scaling": _LLAMA3_SCALING}),
        ("qwen2", {"qkv_bias": True, "family": "qwen2", "norm_eps": 1e-6, "rope_theta": 1e6}),
    ],
    ids=["llama", "llama-tied-headdim", "llama3-rope", "qwen2"],
)
def test_matches_hugging_face(family, overrides):
    pytest.importorskip("transformers")
    config = tiny(n_kv_heads=2, max_seq_len=128, **overrides)
    scaling = config.rope_scaling
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if scaling.type == "llama3":
        rope.update(
            rope_type="llama3",
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_seq_len,
        )
    kwargs = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim or config.dim // config.n_heads,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=config.tie_embeddings,
        attn_implementation="eager",
    )
    hf = tiny_hf_model(family, **kwargs)
    with torch.no_grad():  # HF inits biases to zero; make them count
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)

    model = Transformer(config).eval()
    model.load_state_dict(hf_to_native(hf.state_dict()), strict=True)
    x = tokens(2, 100)  # past original_max_seq_len, so every RoPE band matters
    with torch.no_grad():
        expected = hf(input_ids=x).logits
        got = model(x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flex", "flash_attn"])
def test_model_on_cuda_matches_sdpa_and_trains(attention):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = tiny(n_kv_heads=2, max_seq_len=512)
    model = build(config, attention).cuda().to(torch.bfloat16)
    backend = model.attention_backend
    if backend.unavailable_reason() is not None:
        pytest.skip(backend.unavailable_reason())
    backend.check(device=torch.device("cuda"), dtype=torch.bfloat16, document_mask=False)
    reference = Transformer(config, "sdpa").cuda().to(torch.bfloat16).eval()
    reference.load_state_dict(model.state_dict())
    x = tokens(2, 300).cuda()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), atol=3e-2, rtol=3e-2)
    model.train()
    model(x).float().logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["flex", "flash_attn"])
def test_packed_documents_on_cuda(attention):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = build(tiny(n_kv_heads=2, max_seq_len=512), attention).cuda().to(torch.bfloat16)
    if model.attention_backend.unavailable_reason() is not None:
        pytest.skip(model.attention_backend.unavailable_reason())
    lengths = (100, 150, 50)
    x = tokens(1, sum(lengths)).cuda()
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].cuda()
    with torch.no_grad():
        packed = model(x, doc_ids)
        start = 0
        for n in lengths:
            alone = model(x[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, atol=3e-2, rtol=3e-2)
            start += n
