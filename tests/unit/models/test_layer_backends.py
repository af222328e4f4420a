"""A backend per kind of attention layer (:mod:`recipes_lib.kernels.choice`): a
Gemma-3-like model's local layers on flex and its global ones on SDPA compute what one
backend computes (fp32, tight tolerance), each layer really calls its kind's backend,
each kind's mask is built once per batch, compiled blocks take one graph per kind of
block, and a backend that cannot do what its layers need is refused naming its key."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.errors import UnsupportedKernelError
from recipes_lib.kernels import choose_attention
from recipes_lib.kernels.attention import FlexAttention, SDPAAttention
from recipes_lib.kernels.compiled import compile_blocks, watch_compiles
from recipes_lib.kernels.sharded import ContextShard, ShardedAttention
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES

SEQ = 48
LOCAL_LAYERS = [0, 1, 3, 4]  # layers 2 and 5 attend to every earlier key


def gemma_like(**changes) -> object:
    """A six-layer Gemma 3 shape whose window (8 keys) is shorter than the rows."""
    fields = {
        **FAMILIES["gemma3"].fixed,
        "family": "gemma3",
        "n_layers": 6,
        "max_seq_len": SEQ,
        "sliding_window": 8,
        "window_layers": LOCAL_LAYERS,
        "local_rope_theta": 10000.0,
        "query_pre_attn_scalar": 8,
        "tie_embeddings": True,
        **changes,
    }
    return tiny_model_config(**fields)


def build(attention, config=None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config or gemma_like(), attention)
    with torch.no_grad():  # away from the initial weights, so every layer matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def same_weights(model: Transformer, attention) -> Transformer:
    other = Transformer(model.config, attention)
    other.load_state_dict(model.state_dict())
    return other


def tokens(rows: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: Transformer, x: torch.Tensor, doc_ids=None):
    model.zero_grad()
    loss = model(x, doc_ids, labels=x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_each_layer_runs_its_kinds_backend():
    model = build("auto")
    names = [layer.attention.backend.name for layer in model.blocks]
    assert names == ["flex", "flex", "sdpa", "flex", "flex", "sdpa"]
    assert model.attention_backend.line() == (
        "attention: global layers sdpa, local layers flex (kernels.attention=auto)"
    )
    # a model without local layers has global ones alone
    plain = Transformer(tiny_model_config(n_layers=2), "auto")
    assert plain.attention_backend.names() == {"global": "sdpa"}


@pytest.mark.parametrize("single", ["flex", "sdpa"])
def test_mixed_backends_give_the_logits_loss_and_gradients_of_one_backend(single):
    mixed = build(choose_attention("sdpa", local="flex"))
    reference = same_weights(mixed, single)
    x = tokens()
    torch.testing.assert_close(mixed(x), reference(x), atol=1e-5, rtol=1e-5)
    loss, grads = loss_and_grads(mixed, x)
    reference_loss, reference_grads = loss_and_grads(reference, x)
    torch.testing.assert_close(loss, reference_loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], atol=1e-5, rtol=1e-4)


def test_packed_documents_under_auto_equal_each_document_alone_on_mixed_backends():
    """With a document mask every kind runs flex (auto), a document alone runs SDPA in
    the global layers and flex in the local ones: the same logits."""
    packed_model = build(choose_attention("auto", document_mask=True))
    assert packed_model.attention_backend.names() == {"global": "flex", "local": "flex"}
    alone_model = same_weights(packed_model, "auto")
    assert alone_model.attention_backend.names() == {"global": "sdpa", "local": "flex"}
    lengths = (20, 5, 23)
    x = tokens(1)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = packed_model(x, doc_ids)
        flex_only = same_weights(packed_model, "flex")(x, doc_ids)
        torch.testing.assert_close(packed, flex_only, atol=1e-5, rtol=1e-5)
        start = 0
        for n in lengths:
            alone = alone_model(x[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
            start += n
    loss, _ = loss_and_grads(packed_model, x, doc_ids)
    flex_loss, _ = loss_and_grads(same_weights(packed_model, "flex"), x, doc_ids)
    torch.testing.assert_close(loss, flex_loss, atol=1e-6, rtol=1e-6)


def test_each_kinds_mask_is_built_once_per_batch_and_each_layer_calls_its_backend(
    monkeypatch,
):
    calls: Counter[tuple[str, str]] = Counter()
    for cls in (SDPAAttention, FlexAttention):
        for method in ("build_mask", "__call__"):
            original = getattr(cls, method)

            def spy(self, *args, _original=original, _method=method, **kwargs):
                calls[(self.name, _method)] += 1
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(cls, method, spy)
    model = build("auto")
    model(tokens())
    # four local layers on flex, two global on SDPA; one mask per kind for the batch
    assert calls == {
        ("flex", "build_mask"): 1,
        ("flex", "__call__"): 4,
        ("sdpa", "build_mask"): 1,
        ("sdpa", "__call__"): 2,
    }


def test_a_backend_missing_what_its_layers_need_is_refused_naming_its_key():
    options = {**FAMILIES["gpt_oss"].fixed, "family": "gpt_oss", "qkv_bias": True}
    options.update(attention_out_bias=True, moe_experts=4, moe_top_k=2, moe_ffn_dim=32)
    options.update(n_layers=4, sliding_window=8, window_layers=[0, 2])
    sinks = tiny_model_config(**options)  # gpt-oss: a sink logit per head, every layer
    with pytest.raises(UnsupportedKernelError) as err:
        Transformer(sinks, choose_attention("sdpa", local="flash_attn"))
    message = str(err.value)
    assert message.startswith("kernels.attention_local=flash_attn cannot add attention sinks")
    assert "use kernels.attention_local=sdpa | flex" in message and "\n" not in message
    model = Transformer(sinks, "auto")  # both take sinks
    assert [layer.attention.backend.name for layer in model.blocks] == [
        "flex",
        "sdpa",
        "flex",
        "sdpa",
    ]


def test_a_context_shard_wraps_each_kinds_backend():
    model = build("auto")
    expected = model(tokens())
    model.set_context_shard(ContextShard(seq_len=SEQ, degree=1, rank=0))
    backends = [layer.attention.backend for layer in model.blocks]
    assert all(isinstance(b, ShardedAttention) for b in backends)
    assert [b.inner.name for b in backends] == ["flex", "flex", "sdpa", "flex", "flex", "sdpa"]
    assert backends[0] is backends[1] and backends[2] is backends[5]  # one per backend
    torch.testing.assert_close(model(tokens()), expected, atol=1e-5, rtol=1e-5)
    model.set_context_shard(None)
    assert [layer.attention.backend.name for layer in model.blocks][:3] == ["flex", "flex", "sdpa"]


def test_split_rows_of_a_model_whose_every_layer_is_local_keep_their_shard():
    """Under auto a model of local layers only leaves the global kind's backend unused
    and unwrapped: the split rows still find their shard, and give whole rows' logits."""
    model = build("auto", gemma_like(window_layers=list(range(6))))
    expected = model(tokens())
    shard = ContextShard(seq_len=SEQ, degree=1, rank=0)
    model.set_context_shard(shard)
    assert model.context_shard is shard
    assert all(isinstance(layer.attention.backend, ShardedAttention) for layer in model.blocks)
    torch.testing.assert_close(model(tokens()), expected, atol=1e-5, rtol=1e-5)
    model.set_context_shard(None)
    assert model.context_shard is None


@pytest.fixture
def eager_compile(monkeypatch):
    """``Module.compile`` with dynamo's eager backend, in a fresh dynamo."""
    compile_module = torch.nn.Module.compile

    def compile_eager(self, *args, **kwargs):
        return compile_module(self, *args, **{"backend": "eager", **kwargs})

    monkeypatch.setattr(torch.nn.Module, "compile", compile_eager)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("attention", ["flex", "auto"])
def test_compiled_blocks_take_one_graph_per_kind_of_block(eager_compile, attention):
    """Six blocks of two kinds: two graphs in training, whatever the backends, and the
    compiled blocks compute what the eager ones do."""
    eager = build(attention)
    model = same_weights(eager, attention)
    compile_blocks(model.layers, varying_shapes=False)
    x = tokens()
    with watch_compiles() as stats:
        for seed in range(3):
            model(tokens(seed=seed), labels=tokens(seed=seed)).backward()
    assert stats.graphs == 2, stats
    assert stats.recompile_limit_hits == 0, stats
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x), atol=1e-5, rtol=1e-5)
