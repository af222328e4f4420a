"""Linear attention's torch path against transformers' own reference implementations of
the gated delta rule and the causal convolution (grouped value heads, a state carried in
and out), documents of packed rows on their own, and the fla path refused where it
cannot run."""

import pytest
import torch
import torch.nn.functional as F

from recipes_lib.errors import ConfigError
from recipes_lib.kernels.linear_attention import (
    Segments,
    causal_conv,
    gated_delta_rule,
    pick_path,
)

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

B, T, HK, H, DK, DV = 2, 37, 2, 4, 8, 12


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, DV, generator=gen)
    g = -torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def test_the_rule_is_transformers_chunked_reference_with_a_state_in_and_out():
    q, k, v, g, beta = _inputs()
    state = torch.randn(B, H, DK, DV, generator=torch.Generator().manual_seed(1)) * 0.1
    ours, ours_after = gated_delta_rule(q, k, v, g, beta, state=state.clone())
    theirs, after = qwen3_5.torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=state.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours_after, after, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("length", [1, 37, 150])  # one token (decoding), chunks and a part
def test_the_rule_is_transformers_token_by_token_reference(length):
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(B, length, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(B, length, H, DV, generator=gen)
    g, beta = -torch.rand(B, length, H, generator=gen) * 2, torch.rand(B, length, H, generator=gen)
    state = torch.randn(B, H, DK, DV, generator=gen) * 0.1
    ours, ours_after = gated_delta_rule(q, k, v, g, beta, state=state.clone())
    theirs, after = qwen3_5.torch_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=state.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours_after, after, atol=1e-5, rtol=1e-4)


def test_the_gradients_are_the_token_by_token_references_with_documents_apart():
    """Two rows of 150 positions (chunks and a part), the second packing documents of
    70, 2 and 78 tokens: each input's gradient matches transformers' recurrent rule run
    over each document alone."""
    gen = torch.Generator().manual_seed(7)
    length = 150
    q, k = (torch.randn(2, length, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(2, length, H, DV, generator=gen)
    g, beta = -torch.rand(2, length, H, generator=gen), torch.rand(2, length, H, generator=gen)
    doc_ids = torch.zeros(2, length, dtype=torch.long)
    doc_ids[1, 70:72], doc_ids[1, 72:] = 1, 2
    weights = torch.randn(2, length, H, DV, generator=gen)

    def grads(rule):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        (rule(*leaves) * weights).sum().backward()
        return [t.grad for t in leaves]

    def reference(*tensors):
        rows = []
        for row in range(2):
            bounds = torch.nonzero(Segments.of(doc_ids[row : row + 1]).starts[0]).flatten()
            ends = [*bounds[1:].tolist(), length]
            rows.append(
                torch.cat(
                    [
                        qwen3_5.torch_recurrent_gated_delta_rule(
                            *(t[row : row + 1, lo:hi] for t in tensors[:3]),
                            g=tensors[3][row : row + 1, lo:hi],
                            beta=tensors[4][row : row + 1, lo:hi],
                            initial_state=None,
                            output_final_state=False,
                            use_qk_l2norm_in_kernel=True,
                        )[0]
                        for lo, hi in zip(bounds.tolist(), ends, strict=True)
                    ],
                    dim=1,
                )
            )
        return torch.cat(rows)

    segments = Segments.of(doc_ids)
    ours = grads(lambda *t: gated_delta_rule(*t, segments=segments)[0])
    for mine, theirs in zip(ours, grads(reference), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-3)


def test_the_convolution_is_a_causal_depthwise_conv1d_with_silu():
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(B, T, 6, generator=gen), torch.randn(6, 4, generator=gen)
    ours, last = causal_conv(x, weight)
    conv = F.conv1d(x.transpose(1, 2), weight[:, None], padding=3, groups=6)[..., :T]
    torch.testing.assert_close(ours, F.silu(conv).transpose(1, 2), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(last, x[:, -3:].transpose(1, 2))
    # continued from its last inputs, the rest of a sequence is the whole's
    head, _ = causal_conv(x[:, :20], weight)
    _, state = causal_conv(x[:, :20], weight)
    tail, _ = causal_conv(x[:, 20:], weight, state=state)
    torch.testing.assert_close(torch.cat([head, tail], 1), ours, atol=1e-6, rtol=1e-5)


def test_each_document_of_a_packed_row_is_its_own_sequence():
    """Documents that start and end inside chunks and across their edges (64 positions),
    one shorter than the convolution."""
    lengths = [70, 2, 100, 28]
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 200, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(2, 200, H, DV, generator=gen)
    g, beta = -torch.rand(2, 200, H, generator=gen), torch.rand(2, 200, H, generator=gen)
    row = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    segments = Segments.of(torch.stack([row, torch.zeros_like(row)]))
    packed, _ = gated_delta_rule(q, k, v, g, beta, segments)
    x, weight = v.flatten(2), torch.randn(H * DV, 3, generator=gen)
    conv_packed, _ = causal_conv(x, weight, segments)
    start = 0
    for n in lengths:
        end = start + n
        alone, _ = gated_delta_rule(*(t[:1, start:end] for t in (q, k, v, g, beta)))
        torch.testing.assert_close(packed[:1, start:end], alone, atol=1e-5, rtol=1e-4)
        conv_alone, _ = causal_conv(x[:1, start:end], weight)
        torch.testing.assert_close(conv_packed[:1, start:end], conv_alone, atol=1e-6, rtol=1e-5)
        start = end
    whole, _ = gated_delta_rule(*(t[1:] for t in (q, k, v, g, beta)))  # one document
    torch.testing.assert_close(packed[1:], whole, atol=1e-6, rtol=1e-5)
    assert segments.cu_seqlens.tolist() == [0, 70, 72, 172, 200, 400]


def test_the_fla_path_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="needs CUDA and flash-linear-attention"):
        pick_path("fla", torch.zeros(1))
    with pytest.raises(ConfigError, match="is not one of auto | fla | torch"):
        pick_path("triton", torch.zeros(1))
    assert pick_path("auto", torch.zeros(1)) == "torch"


def test_a_pass_whose_backward_fla_refuses_takes_the_torch_rule_with_one_warning(
    monkeypatch, caplog
):
    import recipes_lib.kernels.linear_attention as linear

    reason = "Triton 3.5 on Hopper computes this backward wrongly"
    monkeypatch.setattr(linear, "fla_training_error", lambda device: reason)
    inputs = tuple(t.requires_grad_() for t in _inputs())
    with caplog.at_level("WARNING", logger=linear.__name__):
        ours, _ = linear._fla_rule(*inputs, None, None)  # no fla kernel is reached
        linear._fla_rule(*inputs, None, None)
    reference, _ = gated_delta_rule(*inputs)
    torch.testing.assert_close(ours, reference)
    grads = torch.autograd.grad(ours.sum(), inputs)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    warned = [r for r in caplog.records if reason in r.getMessage()]
    assert len(warned) == 1 and "torch path" in warned[0].getMessage()


def test_a_compiled_block_takes_the_cuda_path_choice_as_a_constant(monkeypatch, caplog):
    """The choice tries an import and may warn: inside a compiled block both would break
    the graph (on the GPU, a resumed frame for every linear layer). Found once, it is a
    constant to dynamo, so a whole-graph compile of a caller succeeds."""
    import recipes_lib.kernels.linear_attention as linear

    linear._warn_slow_path.cache_clear()
    monkeypatch.setattr(linear, "fla_available", lambda: False)

    def block(x):
        return x * (2.0 if linear._cuda_auto_path() == "torch" else 3.0)

    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger=linear.__name__):
        out = torch.compile(block, fullgraph=True, backend="eager")(torch.ones(3))
        assert linear._cuda_auto_path() == "torch"
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    assert sum("torch path is much slower" in r.getMessage() for r in caplog.records) == 1
