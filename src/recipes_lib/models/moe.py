"""Mixture-of-experts MLP: a router picks ``model.moe_top_k`` of ``model.moe_experts``
gated MLPs for each token; their outputs, weighted by the router, are summed.
One concept: the mixture layer, its router, experts and shared experts with what its
losses are taken from, and the exchange of expert parallelism, which only it calls.

- Router (``model.moe_router``): ``softmax`` over every expert's logit, the top k taken
  and, with ``model.moe_renormalize``, their weights divided by their sum (Mixtral,
  Qwen3-MoE's ``norm_topk_prob``, OLMoE without it); or ``sigmoid``: each expert's score
  on its own, the top k chosen by score plus a per-expert bias that is not trained by
  the gradient but moved after each optimizer step towards balance
  (``model.moe_bias_update_rate``; DeepSeek-V3's auxiliary-loss-free balancing), with
  DeepSeek-V3's group limit: the experts split into ``model.moe_groups`` groups, each
  scored by the sum of its two best biased scores, and a token's k experts chosen
  within its ``model.moe_top_groups`` best groups. Either router's chosen weights are
  then multiplied by ``model.moe_routed_scale`` (DeepSeek-V3's routed scaling factor).
  The sigmoid router computes its logits in float32 whatever the model's dtype or
  autocast (as transformers computes DeepSeek-V3's and GLM-4.5's), so near-tied experts
  are chosen alike; its weight keeps the model's dtype (FSDP2 shards a block's
  parameters in one dtype), and only the model's-dtype input and weight are kept for
  the backward (:class:`Float32Linear`).
- Experts: ``w2(act(w1 x) * w3 x)`` per expert, their weights stacked in
  ``experts.w1/w3`` ``(E, F, C)`` and ``experts.w2`` ``(E, C, F)``. Dropless: every
  token reaches its k experts. Tokens are sorted by expert and each expert multiplies
  its contiguous rows: on CUDA in one grouped GEMM (``torch._grouped_mm``) per weight,
  elsewhere in a plain loop over the experts (exact, the reference).
- Shared experts (``model.moe_shared_experts``): one dense MLP every token also goes through,
  its output scaled by ``sigmoid(shared_gate x)`` with ``model.moe_shared_gate`` (Qwen3.5-MoE).
- Biases (``model.moe_bias``, gpt-oss): on the router's logits and on each expert's
  three projections (``experts.w1/w3`` ``(E, F)``, ``experts.w2`` ``(E, C)``).

A training forward leaves on the module what the objective and the logs need:
``balance_loss`` (Switch Transformer's ``E * sum_e f_e * P_e`` with ``f_e`` the tokens
expert ``e`` took over the tokens and ``P_e`` its mean router probability: ``k`` when
balanced, transformers' convention, so a checkpoint's ``router_aux_loss_coef`` means here
what it meant there),
``z_loss`` (the mean squared log-sum-exp of the router logits) and
``expert_counts`` (tokens per expert), with ``mean_probs`` and ``routed_tokens`` so that
the balance can be taken over every rank's tokens
(:func:`recipes_lib.training.experts.moe_losses` weighs and collects them);
they are not returned, so the block's signature stays one tensor in, one out (compiled
blocks and activation checkpointing keep them, as the tests check).

Shapes: N tokens (B * T), C model dim, E experts, k experts per token, F expert hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from recipes_lib.config.model import is_layer_list
from recipes_lib.errors import ConfigError

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig

ROUTERS = ("softmax", "sigmoid")
EXPERT_PATHS = ("auto", "grouped", "loop")  # kernels.experts: see Experts.path


def is_moe_layer(config: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` has experts instead of the dense MLP."""
    return config.moe_experts > 0 and layer not in config.moe_dense_layers


def check_moe(config: ModelConfig) -> None:
    """Refuse mixture-of-experts options that do not fit together, naming the keys."""
    experts, k = config.moe_experts, config.moe_top_k
    if not (isinstance(experts, int) and experts >= 0):
        raise ConfigError(f"model.moe_experts={experts!r} must be 0 (dense) or a number of experts")
    if experts == 0:
        return
    if not (isinstance(k, int) and 1 <= k <= experts):
        raise ConfigError(
            f"model.moe_top_k={k!r} must be between 1 and model.moe_experts={experts}"
        )
    if config.moe_router not in ROUTERS:
        raise ConfigError(
            f"model.moe_router={config.moe_router!r} is not one of {' | '.join(ROUTERS)}"
        )
    ffn = config.moe_ffn_dim
    if ffn is not None and not (isinstance(ffn, int) and ffn >= 1):
        raise ConfigError(f"model.moe_ffn_dim={ffn!r} must be a positive width or null (ffn_dim)")
    if not is_layer_list(config.moe_dense_layers, config.n_layers):
        raise ConfigError(
            f"model.moe_dense_layers={config.moe_dense_layers!r} must list layers in increasing "
            f"order, each in 0..{config.n_layers - 1} (model.n_layers={config.n_layers})"
        )
    if config.moe_shared_experts < 0:
        raise ConfigError(f"model.moe_shared_experts={config.moe_shared_experts} is negative")
    if config.moe_shared_gate and not config.moe_shared_experts:
        raise ConfigError(
            "model.moe_shared_gate=true gates the shared experts; model.moe_shared_experts=0"
        )
    if config.moe_bias_update_rate and config.moe_router != "sigmoid":
        raise ConfigError(
            f"model.moe_bias_update_rate={config.moe_bias_update_rate} balances the sigmoid "
            f"router's choice; model.moe_router={config.moe_router} has no bias "
            "(use model.moe_aux_loss_coef)"
        )
    _check_groups(config)
    for key in ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_update_rate"):
        if getattr(config, key) < 0:
            raise ConfigError(f"model.{key}={getattr(config, key)} must not be negative")


def _check_groups(config: ModelConfig) -> None:
    """Refuse a group limit the sigmoid router cannot apply, naming the keys."""
    groups, top = config.moe_groups, config.moe_top_groups
    if not (isinstance(groups, int) and groups >= 1 and isinstance(top, int) and top >= 1):
        raise ConfigError(
            f"model.moe_groups={groups!r} and model.moe_top_groups={top!r} must be positive"
        )
    if config.moe_routed_scale <= 0:
        raise ConfigError(f"model.moe_routed_scale={config.moe_routed_scale} must be positive")
    if groups == 1:
        return
    experts = config.moe_experts
    if config.moe_router != "sigmoid":
        raise ConfigError(
            f"model.moe_groups={groups} limits the sigmoid router's choice; "
            f"model.moe_router={config.moe_router} has no group limit"
        )
    if experts % groups or experts // groups < 2:
        raise ConfigError(
            f"model.moe_groups={groups} must split model.moe_experts={experts} into equal "
            "groups of at least two (each group is scored by its two best experts)"
        )
    if top > groups or config.moe_top_k > top * (experts // groups):
        raise ConfigError(
            f"model.moe_top_groups={top} must be at most model.moe_groups={groups} and hold "
            f"model.moe_top_k={config.moe_top_k} experts"
        )


@dataclass(frozen=True)
class GatedActivation:
    """The gate of a gated MLP (``model.activation``) with its settings: ``clamped_swiglu``
    (gpt-oss) reads ``alpha`` and ``limit`` (``model.swiglu_alpha``, ``model.swiglu_limit``)."""

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, config: ModelConfig) -> GatedActivation:
        return cls(config.activation, config.swiglu_alpha, config.swiglu_limit)


def gated_mlp(gate: Tensor, up: Tensor, activation: str | GatedActivation) -> Tensor:
    """``act(gate) * up``, ``act`` SiLU or the tanh-approximated GELU; gpt-oss's clamped
    SwiGLU: ``(up + 1) * g * sigmoid(alpha * g)`` with ``g`` the gate clamped above at
    ``limit`` and ``up`` clamped to ``[-limit, limit]``."""
    if isinstance(activation, str):
        activation = GatedActivation(activation)
    if activation.name == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation.name == "clamped_swiglu":
        limit = activation.limit
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * gate * torch.sigmoid(activation.alpha * gate)
    return F.silu(gate) * up


class GroupedLinear(nn.Module):
    """``E`` linear maps, stacked: ``weight`` is ``(E, out, in)``, ``bias`` ``(E, out)``
    or None.

    Calling it with the rows it is about to multiply gives the weight to multiply them
    with: an adapter on the experts (PEFT's ``target_parameters``, whose wrapper of this
    module takes the call's input first) makes that ``W + delta`` for the call. The
    ``(E, out, in)`` layout is the one PEFT and transformers take by default (their
    ``is_transposed`` marks ``(E, in, out)``).
    """

    def __init__(self, n: int, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(n, out_features)) if bias else None

    def forward(self, rows: Tensor) -> Tensor:
        return self.weight


def _compute_dtype(x: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Experts(nn.Module):
    """``E`` gated MLPs over rows sorted by expert (``counts[e]`` rows for expert ``e``)."""

    def __init__(
        self,
        n: int,
        dim: int,
        hidden: int,
        activation: str | GatedActivation,
        bias: bool = False,
    ):
        super().__init__()
        self.w1 = GroupedLinear(n, dim, hidden, bias)  # gate
        self.w3 = GroupedLinear(n, dim, hidden, bias)  # up
        self.w2 = GroupedLinear(n, hidden, dim, bias)  # down
        self.activation = activation
        # grouped: one grouped GEMM per weight; loop: one matmul per expert; auto:
        # grouped on CUDA in bf16, the loop elsewhere (kernels.experts)
        self.path = "auto"
        self.parallel: ExpertParallel | None = None  # set by expert-parallel sharding

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """``(M, C)`` rows sorted by expert -> ``(M, C)``."""
        if self.path == "grouped" or (self.path == "auto" and self._grouped_fits(x)):
            return self._grouped(x, counts)
        return self._loop(x, counts)

    def _grouped_fits(self, x: Tensor) -> bool:
        """Whether CUDA's grouped GEMM takes these rows: bf16, widths of whole 16 bytes."""
        widths = (self.w1.weight.shape[-1], self.w1.weight.shape[-2])
        return (
            x.is_cuda
            and hasattr(torch, "_grouped_mm")
            and _compute_dtype(x) == torch.bfloat16
            and all(w % 8 == 0 for w in widths)
        )

    def weights(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """``w1``, ``w3``, ``w2`` for rows ``x``, in ``dtype``: under expert parallelism
        this rank's experts only (see :class:`ExpertParallel`)."""
        found = []
        for linear in (self.w1, self.w3, self.w2):
            w = linear(x)  # with an adapter on the experts: its weight update added
            if self.parallel is not None:
                w = self.parallel.local(w)
            found.append(w.to(dtype))
        return found[0], found[1], found[2]

    def biases(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor] | None:
        """``w1``'s, ``w3``'s and ``w2``'s biases in ``dtype`` (this rank's experts under
        expert parallelism), or None without biases."""
        found = []
        for linear in (self.w1, self.w3, self.w2):
            if linear.bias is None:
                return None
            b: Tensor = linear.bias
            if self.parallel is not None:
                b = self.parallel.local(b)
            found.append(b.to(dtype))
        return found[0], found[1], found[2]

    # Eager under torch.compile: the loop reads every expert's row count on the host,
    # and a compiled loop would be specialized on them (a count of 0 or 1 is a graph of
    # its own), so a run with many experts hit dynamo's recompile limit within steps.
    @torch.compiler.disable
    def _loop(self, x: Tensor, counts: Tensor) -> Tensor:
        w1, w3, w2 = self.weights(x, x.dtype)
        b = self.biases(x.dtype)
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            # an idle expert's empty rows are multiplied too: the output then depends on
            # ``x`` and every weight even when no row came, so every rank's backward runs
            # the same collectives (the expert-parallel exchange's all-to-alls)
            rows = x[start : start + n]
            b1, b3, b2 = (None, None, None) if b is None else (b[0][e], b[1][e], b[2][e])
            gate, up = F.linear(rows, w1[e], b1), F.linear(rows, w3[e], b3)
            outs.append(F.linear(gated_mlp(gate, up, self.activation), w2[e], b2))
            start += n
        return torch.cat(outs)

    def _grouped(self, x: Tensor, counts: Tensor) -> Tensor:
        dtype = _compute_dtype(x)  # autocast does not reach _grouped_mm: cast as it would
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        w1, w3, w2 = self.weights(x, dtype)
        b = self.biases(dtype)
        x = x.to(dtype)
        if b is not None:  # each row's expert, to add its biases
            experts = torch.arange(len(counts), device=x.device)
            row_expert = torch.repeat_interleave(experts, counts, output_size=x.shape[0])

        def mm(a: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
            out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
            return out if bias is None else out + bias[row_expert]

        b1, b3, b2 = (None, None, None) if b is None else b
        return mm(gated_mlp(mm(x, w1, b1), mm(x, w3, b3), self.activation), w2, b2)


class _ScaleGrad(torch.autograd.Function):
    """The identity, its gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class ExpertParallel:
    """Expert parallelism over a process group of ``size`` ranks: rank ``r`` holds experts
    ``r * E / size`` up to the next rank's (its dim-0 shard of the stacked weights, a
    ``DTensor`` placed ``Shard(0)``), and the tokens travel to their experts' rank and
    back by two all-to-alls.

    Every rank's tokens add to its experts' gradients, which are therefore a sum over the
    ranks; they are divided by ``size`` to be the mean that data parallelism takes of
    every other gradient.
    """

    def __init__(self, group: Any, size: int):
        self.group, self.size = group, size

    def local(self, weight: Tensor) -> Tensor:
        """This rank's experts of a stacked weight, gradients scaled by ``1 / size``."""
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        return _ScaleGrad.apply(local, 1.0 / self.size)

    @torch.compiler.disable  # host-side split sizes and collectives: run eagerly
    def exchange(self, experts: Experts, x: Tensor, counts: Tensor) -> Tensor:
        """The experts' outputs for rows ``x`` sorted by expert (``counts`` per expert),
        computed on the ranks that hold them."""
        from torch.distributed import all_to_all_single
        from torch.distributed._functional_collectives import (  # differentiable
            all_to_all_single_autograd as exchange,
        )

        per_rank = counts.view(self.size, -1)  # (ranks, local experts): rows to send
        received = torch.empty_like(per_rank)  # rows from each rank for each local expert
        all_to_all_single(received, per_rank.contiguous(), group=self.group)
        # the host's one wait of the layer: both split lists in one copy
        send, receive = torch.stack([per_rank.sum(1), received.sum(1)]).tolist()
        rows = exchange(x, receive, send, self.group)
        local = received.shape[1]
        expert = torch.arange(local, device=x.device).repeat(self.size)
        by_expert = torch.repeat_interleave(expert, received.flatten(), output_size=sum(receive))
        order = torch.argsort(by_expert, stable=True)
        y = experts(rows[order], received.sum(0))  # by local expert
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return exchange(y[back].contiguous(), send, receive, self.group)


class Float32Linear(torch.autograd.Function):
    """``x W^T + b`` computed in float32 whatever the dtypes of ``x`` and ``W`` and any
    autocast. The backward keeps ``x`` and ``W`` as they came (no float32 copy of the
    tokens is held between the forward and the backward) and upcasts them again; the
    gradients come back in each input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        with torch.autocast(x.device.type, enabled=False):
            wide_bias = None if bias is None else bias.float()
            return F.linear(x.float(), weight.float(), wide_bias)  # (N, E)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.float()
        grad_x = grad_weight = grad_bias = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (grad @ weight.float()).to(x.dtype)  # (N, C)
            if ctx.needs_input_grad[1]:
                grad_weight = (grad.t() @ x.float()).to(weight.dtype)  # (E, C)
            if ctx.needs_input_grad[2]:
                grad_bias = grad.sum(0).to(ctx.bias_dtype)  # (E,)
        return grad_x, grad_weight, grad_bias


class MoEFeedForward(nn.Module):
    """The router, the routed experts and the optional shared ones of one layer."""

    expert_bias: Tensor  # a buffer, present with the sigmoid router only

    # dense: the dense feed-forward class (blocks.FeedForward), passed in because blocks
    # imports this module: (dim, hidden, activation) -> the module
    def __init__(
        self, config: ModelConfig, dense: Callable[[int, int, GatedActivation], nn.Module]
    ):
        super().__init__()
        self.n_experts, self.top_k = config.moe_experts, config.moe_top_k
        self.router_kind, self.renormalize = config.moe_router, config.moe_renormalize
        self.groups, self.top_groups = config.moe_groups, config.moe_top_groups
        self.routed_scale = config.moe_routed_scale
        hidden = config.moe_ffn_dim or config.ffn_dim
        activation = GatedActivation.of(config)
        self.router = nn.Linear(config.dim, self.n_experts, bias=config.moe_bias)
        self.experts = Experts(self.n_experts, config.dim, hidden, activation, config.moe_bias)
        self.shared: nn.Module | None = None
        if config.moe_shared_experts:
            self.shared = dense(config.dim, config.moe_shared_experts * hidden, activation)
        # a token's weight on the shared experts, sigmoid(shared_gate x) (Qwen3.5-MoE)
        self.shared_gate = nn.Linear(config.dim, 1, bias=False) if config.moe_shared_gate else None
        if self.router_kind == "sigmoid":  # moved by update_bias, never by the gradient
            self.register_buffer("expert_bias", torch.zeros(self.n_experts))
        self.z_loss: Tensor | None = None
        self.expert_counts: Tensor | None = None
        self.mean_probs: Tensor | None = None  # P_e, and the tokens f_e divides by
        self.routed_tokens: Tensor | int = 0

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Router logits ``(N, E)``, each token's experts ``(N, k)`` and weights
        ``(N, k)`` (float32), and the probabilities the balance loss reads ``(N, E)``."""
        logits = self._logits(x)  # (N, E)
        if self.router_kind == "softmax":
            probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        else:
            scores = torch.sigmoid(logits.float())  # (N, E)
            choice = scores + self.expert_bias
            if self.groups > 1:
                choice = self._within_best_groups(choice)
            chosen = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)  # (N, k): the bias only chooses
            probs = scores / scores.sum(-1, keepdim=True)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scale != 1:
            weights = weights * self.routed_scale
        return logits, chosen, weights, probs

    def _logits(self, x: Tensor) -> Tensor:
        """The router's logits: the sigmoid router's in float32; a router another layer
        wraps (a LoRA adapter, a float8 layer) computes its own."""
        router = self.router
        if self.router_kind != "sigmoid" or type(router) is not nn.Linear:
            return router(x)
        return Float32Linear.apply(x, router.weight, router.bias)

    def _within_best_groups(self, choice: Tensor) -> Tensor:
        """``choice`` ``(N, E)`` with every expert outside the token's
        ``top_groups`` best groups at ``-inf``; a group's score is the sum of its two best
        experts' choice scores."""
        N = choice.shape[0]
        grouped = choice.view(N, self.groups, -1)  # (N, G, E / G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        best = group_scores.topk(self.top_groups, dim=-1).indices  # (N, top groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, -1)

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``; ``token_mask`` ``(B, T)``: the tokens the
        balance loss, the z-loss and the counts are taken over (padding routes, as every
        token does, but is not counted); None: all."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        logits, chosen, weights, probs = self.route(flat)
        assignments = chosen.flatten()  # (N * k,)
        order = torch.argsort(assignments, stable=True)  # the assignments by expert
        token = order // self.top_k  # (N * k,): the token of each sorted assignment
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, assignments, torch.ones_like(assignments))  # (E,): static shape
        if self.experts.parallel is None:
            y = self.experts(flat[token], counts)  # (N * k, C), by expert
        else:  # to the ranks holding the experts and back
            y = self.experts.parallel.exchange(self.experts, flat[token], counts)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        y = y[back].view(-1, self.top_k, C)  # (N, k, C): each token's experts, in its order
        out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)  # (N, C), no atomic adds
        if self.shared is not None:
            shared = self.shared(flat)  # (N, C)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        if self.training and torch.is_grad_enabled():
            self._keep_losses(logits, probs, assignments, counts, token_mask)
        return out.view(B, T, C)

    def _keep_losses(
        self,
        logits: Tensor,
        probs: Tensor,
        assignments: Tensor,
        counts: Tensor,
        token_mask: Tensor | None,
    ) -> None:
        """What the balance loss, the z-loss and the counts of the tokens ``token_mask``
        keeps are taken from."""
        z = torch.logsumexp(logits.float(), dim=-1).square()  # (N,)
        tokens: Tensor | int
        if token_mask is None:
            tokens, mean_probs, z = probs.shape[0], probs.mean(0), z.mean()
        else:
            keep = token_mask.reshape(-1)  # (N,)
            if keep.numel() != probs.shape[0]:
                raise ValueError(f"token_mask {tuple(token_mask.shape)} is not one per token")
            weight = keep.to(probs.dtype)
            tokens = weight.sum().clamp_min(1.0)
            mean_probs = (probs * weight[:, None]).sum(0) / tokens
            z = (z * weight).sum() / tokens
            counts = torch.zeros_like(counts).scatter_add_(
                0, assignments, keep.long().repeat_interleave(self.top_k)
            )
        # all at once: activation checkpointing's recomputation may stop early
        self.z_loss, self.expert_counts = z, counts.detach()
        self.mean_probs, self.routed_tokens = mean_probs, tokens

    @property
    def balance_loss(self) -> Tensor | None:
        """The balance loss over this layer's last training forward's tokens (None when
        none is kept)."""
        if self.mean_probs is None or self.expert_counts is None:
            return None
        counts = self.expert_counts.float()
        return balance_loss(counts, self.routed_tokens, self.mean_probs, self.n_experts)

    def _apply(self, fn, recurse=True):
        # the sigmoid router's choice bias stays float32 whatever dtype the model is cast
        # to (as transformers keeps DeepSeek-V3's e_score_correction_bias): in bfloat16 a
        # bias of a few units moves in steps of 1/64, which reorders close experts, and
        # update_bias's small steps would round away
        bias = self.expert_bias if self.router_kind == "sigmoid" else None
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            kept = torch.empty_like(bias, dtype=torch.float32, device=self.expert_bias.device)
            self.expert_bias = kept if bias.is_meta or kept.is_meta else kept.copy_(bias)
        return self

    @torch.no_grad()
    def update_bias(self, counts: Tensor, rate: float) -> None:
        """Move the sigmoid router's bias by ``rate`` towards balance: up for the experts
        that took fewer than the mean of ``counts`` (one step's tokens), down for more."""
        self.expert_bias += rate * torch.sign(counts.float().mean() - counts.float())


def balance_loss(counts: Tensor, tokens: Tensor | int, mean_probs: Tensor, experts: int) -> Tensor:
    """Switch Transformer's ``E * sum_e f_e * P_e`` (``f_e``: ``counts`` over ``tokens``,
    ``k`` in all; ``P_e``: ``mean_probs``), over the last dimension."""
    return experts * (counts / tokens * mean_probs).sum(-1)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The model's mixture-of-experts layers, in order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def check_expert_path(path: str) -> None:
    """Refuse a ``kernels.experts`` that is not one of :data:`EXPERT_PATHS`."""
    if path not in EXPERT_PATHS:
        raise ConfigError(f"kernels.experts={path!r} is not one of {' | '.join(EXPERT_PATHS)}")


def set_expert_path(model: nn.Module, path: str) -> None:
    """How every mixture layer of ``model`` computes its experts (``kernels.experts``)."""
    check_expert_path(path)
    for layer in moe_layers(model):
        layer.experts.path = path
