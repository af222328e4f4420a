"""Gated DeltaNet's two token mixers on packed rows: a short causal depthwise convolution
and the gated delta rule.

The gated delta rule keeps, per value head, a ``(dk, dv)`` state ``S``. For each token,
with its L2-normalised query ``q`` and key ``k``, value ``v``, log-decay ``g <= 0`` and
write strength ``beta`` in ``(0, 1)``::

    S = exp(g) * S                      # forget
    S = S + k (beta * (v - S^T k))^T    # replace what S recalled for k by v
    o = S^T q / sqrt(dk)

A document of a packed row starts from an empty state and an empty convolution window,
as if it were a row of its own (:class:`Segments` marks where each one starts).

Two paths compute the same thing:

- ``fla``: flash-linear-attention's Triton kernels (``fla-core``, the ``linear`` extra):
  the chunked rule and the convolution over the packed documents flattened into one
  sequence (``cu_seqlens``), the fused recurrent rule for decoding. CUDA only. Where
  fla's backward refuses to run (:func:`fla_training_error`), a pass that needs
  gradients takes the torch rule instead, with one warning naming fla's reason.
- ``torch``: plain torch, a chunk of 64 positions at a time (CPU, or wherever fla does
  not import): exact, and much slower than fla on a GPU.

Shapes: B batch, T positions, D convolution channels, K kernel width, H value heads,
Hk query/key heads (each serving ``H // Hk`` value heads), dk key dim, dv value dim.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recipes_lib.errors import ConfigError

log = logging.getLogger(__name__)

LINEAR_PATHS = ("auto", "fla", "torch")


@functools.cache
def fla_available() -> bool:
    """Whether flash-linear-attention's gated delta rule imports (it needs Triton)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or Triton failing to find a GPU backend
        return False
    return True


@functools.cache
def fla_training_error(device: int) -> str | None:
    """Why flash-linear-attention's gated delta rule cannot take a backward pass on CUDA
    device ``device``, or None when it can: found once by running its forward and
    backward on a few tokens. Some releases refuse a backward that a GPU and Triton
    version would compute wrongly (fla-core 0.6 on Hopper under Triton 3.4-3.7.0, unless
    tilelang is installed); the refusal comes only in the backward, after the forward
    has run."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    try:
        with torch.device(f"cuda:{device}"), torch.enable_grad():
            q, k = (torch.randn(1, 64, 1, 16, dtype=torch.bfloat16) for _ in range(2))
            v = torch.randn(1, 64, 1, 16, dtype=torch.bfloat16, requires_grad=True)
            g, beta = -torch.rand(1, 64, 1), torch.rand(1, 64, 1, dtype=torch.bfloat16)
            out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            out.float().sum().backward()
    except RuntimeError as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None


@functools.cache
def _warn_fla_cannot_train(reason: str) -> None:
    log.warning(
        "flash-linear-attention cannot train on this GPU (%s): the linear layers take "
        "the torch path, much slower",
        reason,
    )


def pick_path(path: str, x: Tensor) -> str:
    """``fla`` or ``torch`` for ``x`` under the choice ``path`` (``auto``: fla on CUDA
    when it imports).

    Raises:
        ConfigError: ``path`` is unknown, or ``fla`` where it cannot run.
    """
    if path not in LINEAR_PATHS:
        raise ConfigError(
            f"linear attention path {path!r} is not one of {' | '.join(LINEAR_PATHS)}"
        )
    if path == "auto":
        return _cuda_auto_path() if x.is_cuda else "torch"
    if path == "fla" and not (x.is_cuda and fla_available()):
        raise ConfigError(
            "the fla linear attention path needs CUDA and flash-linear-attention "
            "(pip install 'recipes-lib[linear]')"
        )
    return path


@functools.cache
def _warn_slow_path() -> None:
    log.warning(
        "linear attention on CUDA without flash-linear-attention: the torch path is "
        "much slower (pip install 'recipes-lib[linear]')"
    )


@torch.compiler.assume_constant_result
def _cuda_auto_path() -> str:
    """``fla`` where it imports, else ``torch`` with one warning a process. A compiled
    block calls this once while tracing and keeps the answer as a constant: traced, the
    import attempt and the warning would each break its graph."""
    if fla_available():
        return "fla"
    _warn_slow_path()
    return "torch"


@dataclass(frozen=True)
class Segments:
    """Where the documents of packed rows start.

    Attributes:
        starts: ``(B, T)`` bool, True at each document's first token (every row's first
            position included).
        doc: ``(B, T)`` the document index within the row (a running count of starts).
    """

    starts: Tensor
    doc: Tensor

    @classmethod
    def of(cls, doc_ids: Tensor) -> Segments:
        """The segments of rows whose tokens carry ``doc_ids`` ``(B, T)``: a document
        starts wherever the id changes."""
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        return cls(starts, torch.cumsum(starts, dim=1))

    @functools.cached_property
    def cu_seqlens(self) -> Tensor:
        """The documents' boundaries in the ``(B * T)`` flattened rows, ``(N + 1,)``
        int64, as flash-linear-attention's variable-length kernels take them (found
        once: finding them waits for the device)."""
        flat = self.starts.flatten()
        ends = torch.tensor([flat.numel()], device=flat.device)
        return torch.cat([torch.nonzero(flat).flatten(), ends])


def causal_conv(
    x: Tensor,
    weight: Tensor,
    segments: Segments | None = None,
    state: Tensor | None = None,
    path: str = "torch",
) -> tuple[Tensor, Tensor]:
    """SiLU of the causal depthwise convolution of ``x`` ``(B, T, D)`` with ``weight``
    ``(D, K)`` (tap ``K - 1`` on the current position), each document of ``segments``
    convolved on its own; ``state`` ``(B, D, K - 1)``: the inputs before ``x`` (decoding;
    None: zeros). Returns ``(B, T, D)`` and the last ``K - 1`` inputs ``(B, D, K - 1)``.
    """
    B, T, D = x.shape
    K = weight.shape[1]
    if path == "fla" and state is None:
        return _fla_conv(x, weight, segments), _last_inputs(x, K)
    before = x.new_zeros(B, K - 1, D) if state is None else state.transpose(1, 2).to(x.dtype)
    full = torch.cat([before, x], dim=1)  # (B, K - 1 + T, D)
    w = weight.to(x.dtype)
    y = full[:, K - 1 :] * w[:, K - 1]
    for j in range(1, K):  # tap K - 1 - j reads the input j positions back
        back = full[:, K - 1 - j : K - 1 - j + T]
        if segments is not None:  # only within the token's own document
            same = torch.zeros_like(segments.starts)
            same[:, j:] = segments.doc[:, j:] == segments.doc[:, :-j]
            back = back * same[..., None].to(x.dtype)
        y = y + back * w[:, K - 1 - j]
    return F.silu(y), full[:, T:].transpose(1, 2)


@torch.compiler.disable  # a Triton kernel of its own, launched as it is
def _fla_conv(x: Tensor, weight: Tensor, segments: Segments | None) -> Tensor:
    """flash-linear-attention's convolution (SiLU after), over the packed documents
    flattened into one sequence."""
    from fla.modules.causal_conv1d import causal_conv1d

    B, T, D = x.shape
    cu = None if segments is None else segments.cu_seqlens
    flat = x.reshape(1, B * T, D) if cu is not None else x
    y, _ = causal_conv1d(flat, weight.to(x.dtype), activation="silu", cu_seqlens=cu)
    return y.reshape(B, T, D)


def _last_inputs(x: Tensor, K: int) -> Tensor:
    """The last ``K - 1`` positions of ``x`` ``(B, T, D)`` as ``(B, D, K - 1)``, zeros
    before the first."""
    padded = F.pad(x, (0, 0, max(K - 1 - x.shape[1], 0), 0))
    return padded[:, -(K - 1) :].transpose(1, 2)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the kernels' own, eps inside)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: Segments | None = None,
    state: Tensor | None = None,
    path: str = "torch",
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule over ``q``, ``k`` ``(B, T, Hk, dk)`` (normalised here),
    ``v`` ``(B, T, H, dv)``, ``g`` and ``beta`` ``(B, T, H)``; each document of
    ``segments`` from an empty state, or the whole row from ``state`` ``(B, H, dk, dv)``
    (decoding). Returns the outputs ``(B, T, H, dv)`` in ``v``'s dtype and, given
    ``state``, the state after the last position (float32; else None).
    """
    if path == "fla":
        return _fla_rule(q, k, v, g, beta, segments, state)
    return _torch_rule(q, k, v, g, beta, segments, state)


CHUNK = 64  # positions the torch path takes at once


# a compiled block leaves the rule eager: traced, the loop over chunks would unroll
@torch.compiler.disable
def _torch_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: Segments | None,
    state: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """The rule a chunk of ``L`` positions at a time, in float32.

    Within a chunk, with ``G`` the running sum of ``g`` and ``S0`` the state before it,
    the state a position ``t`` sees is ``exp(G_t) S0`` plus the writes ``k_s u_s^T``
    of the positions ``s < t`` decayed by ``exp(G_t - G_s)``. So the writes
    ``u_t = beta_t (v_t - (that state)^T k_t)`` solve one unit lower-triangular
    ``L x L`` system per head, and the outputs and the next chunk's state are products
    with them. A document starting inside the chunk cuts every term that reaches
    across its start: the state reaches only the positions before the chunk's first
    start, a write only the positions of its own document.

    The writes are linear in ``S0``: ``u = W_v - W_k S0``. Everything but ``S0`` is
    known for all chunks at once, so the triangular systems are solved for every chunk
    in one call, and only the passing of the state from chunk to chunk (two small
    products a chunk) runs in order.
    """
    B, T, Hk, dk = k.shape
    H, dv = v.shape[2], v.shape[3]
    groups = H // Hk  # value heads per query/key head, consecutive
    q = l2_normalize(q.float()).repeat_interleave(groups, dim=2) * dk**-0.5
    k = l2_normalize(k.float()).repeat_interleave(groups, dim=2)
    q, k, values = (t.transpose(1, 2) for t in (q, k, v.float()))  # (B, H, T, dk / dv)
    g, beta = g.float().transpose(1, 2), beta.float().transpose(1, 2)  # (B, H, T)
    L = min(CHUNK, T)
    N = -(-T // L)  # chunks; the last one padded with positions that change nothing
    pad = N * L - T  # zero keys, values and beta write nothing; zero g decays nothing
    if pad:
        q, k, values = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, values))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    q, k, values = (t.reshape(B, H, N, L, t.shape[-1]) for t in (q, k, values))
    g, beta = g.reshape(B, H, N, L), beta.reshape(B, H, N, L)
    keep = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # s <= t
    carried = torch.ones_like(g, dtype=torch.bool)  # the state reaches t
    if segments is not None:
        starts, doc = segments.starts, segments.doc  # (B, T)
        if pad:  # the padding continues the last document
            starts = F.pad(starts, (0, pad), value=False)
            doc = torch.cat([doc, doc[:, -1:].expand(B, pad)], dim=1)
        starts, doc = starts.view(B, 1, N, L), doc.view(B, 1, N, L)
        g = g.masked_fill(starts, 0.0)  # what a start would decay is cut anyway
        keep = keep & (doc[..., :, None] == doc[..., None, :])  # (B, 1, N, L, L)
        carried = (starts.cumsum(-1) == 0).expand_as(g)
    G = g.cumsum(-1)  # (B, H, N, L)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~keep, float("-inf")).exp()
    from_state = G.exp() * carried  # (B, H, N, L): the state's weight at each t
    A = (beta[..., :, None] * decay * (k @ k.transpose(-1, -2))).tril(-1)  # (B, H, N, L, L)
    eye = torch.eye(L, device=q.device)
    rhs = torch.cat([beta[..., None] * values, (beta * from_state)[..., None] * k], dim=-1)
    W = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    W_v, W_k = W.split([dv, dk], dim=-1)  # u = W_v - W_k S0
    reads = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, L, L)
    out_v = reads @ W_v  # (B, H, N, L, dv): the outputs without S0
    q_state = from_state[..., None] * q - reads @ W_k  # (B, H, N, L, dk): S0's reader
    k_last = (k * decay[..., -1, :, None]).transpose(-1, -2)  # (B, H, N, dk, L)
    to_state = k_last @ W_v  # (B, H, N, dk, dv): what a chunk writes
    through = k_last @ W_k  # (B, H, N, dk, dk): how its writes read S0
    keep_last = from_state[..., -1, None, None]  # (B, H, N, 1, 1)
    S = q.new_zeros(B, H, dk, dv) if state is None else state.float()
    outs = []
    # by chunk, unbound once: a slice a chunk would cost a whole-size gradient each
    by_chunk = (t.unbind(2) for t in (out_v, q_state, keep_last, through, to_state))
    for out_n, reader, kept, passes, written in zip(*by_chunk, strict=True):
        outs.append(out_n + reader @ S)  # (B, H, L, dv)
        S = kept * S - passes @ S + written
    out = torch.stack(outs, dim=2).reshape(B, H, N * L, dv)[:, :, :T]
    return out.transpose(1, 2).to(v.dtype), (S if state is not None else None)


@torch.compiler.disable  # Triton kernels of their own, launched as they are
def _fla_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: Segments | None,
    state: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    reason = fla_training_error(q.device.index or 0) if needs_backward else None
    if reason is not None:  # fla's backward would refuse: the exact torch path instead
        _warn_fla_cannot_train(reason)
        return _torch_rule(q, k, v, g, beta, segments, state)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    B, T = q.shape[:2]
    dtype = v.dtype
    q, k, beta = q.to(dtype), k.to(dtype), beta.to(dtype)
    g = g.float()
    kwargs = dict(use_qk_l2norm_in_kernel=True, scale=q.shape[-1] ** -0.5)
    if state is not None:  # decoding: from the cached state, keeping the new one
        rule = fused_recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule
        # by keyword: the two kernels take their gates in different orders
        out, final = rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=state.float(),
            output_final_state=True,
            **kwargs,
        )
        return out, final
    if segments is None:
        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
        return out, None
    q, k, v, g, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta))
    cu_seqlens = segments.cu_seqlens
    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, **kwargs)
    return out.reshape(B, T, *out.shape[2:]), None
