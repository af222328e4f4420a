"""Per-GPU memory of a run, from its config: what :func:`estimate_memory` adds up.

The figure is the peak of ``torch.cuda.max_memory_allocated`` over a training step
once the optimizer state exists, plus what PyTorch's allocator never sees (the CUDA context).
A step passes through these moments; the largest is the peak (``P`` parameters, ``G``
gradients, ``O`` optimizer state, per rank):

- **forward**, at the loss: ``P + O`` (``+ G`` where the last step's gradients outlive
  it: inside an accumulation window, or under a strategy that keeps them, DDP's buckets
  and DeepSpeed's engine; else they are freed after the step) + the saved activations +
  the weight copies
  kept for the backward + the loss's forward tensors (or, with activation
  checkpointing or FSDP, the block being computed and its gathered weights);
- **backward start**: ``P + O`` + the saved activations and kept weight copies + the
  loss's gradient tensors;
- **backward end**: ``P + G + O`` + one recomputed block (activation checkpointing of
  every block, or of every N-th: the others keep their activations as without it) and
  its weights' copies + the embedding's dense gradient before it is accumulated;
- **build**: the whole decoder in its build dtype (a tied head is first made as its own
  tensor), before quantization (QLoRA) or sharding (FSDP builds each rank's model whole).

Storage: fp32 weights under ``32-true``, ``bf16-mixed`` and ``fp8`` (float8 casts are
transient), bf16 under ``bf16-true``; QLoRA's targeted base linears in 4-bit NF4 with
their absmax constants; under ``bf16-mixed`` the frozen projections of a LoRA base and of
a frozen model (DPO's reference, a teacher: built whole first) in bf16. Gradients and
optimizer state exist for trainable parameters only (LoRA: the adapters); the state is
what the ``optim`` choice's spec says it keeps for their shapes and dtype
(:mod:`recipes_lib.launch_check.optimizer_state`). A strategy divides what its
:class:`~recipes_lib.parallel.strategy.StrategySpec` declares in ``sharded_state`` by the
world size, and ``strategy.cpu_offload`` moves that (and the optimizer's step) to the host.

Weight copies: under bf16-mixed autocast casts each weight to bf16 at its matmul and
the matmul keeps the copy for its backward, so without activation checkpointing every
matmul weight has a bf16 copy at the loss (a bf16-stored one needs none); a recomputed
block keeps none (its copies are made again when it is recomputed; autocast's cache
does not hold them). FSDP2
gathers each block in the compute dtype and keeps the last one gathered for the
backward. Activations per block and token: :mod:`recipes_lib.launch_check.activations`.

Context parallelism (``strategy.context_parallel=N``): a rank holds ``T / N`` tokens of
each row, so every per-token term is divided by ``N``, while a sharding strategy still
divides its states by the whole world (FSDP2 shards over every rank, a row's group
included); but each attention it keeps holds the group's gathered keys and values
(the whole row's, ``N`` times its own). Where the
split attention uses a dense mask (:func:`recipes_lib.kernels.sharded.uses_block_mask`
says where it does not: flex on CUDA in whole blocks), each attention kept also holds
the additive ``(T / N, T)`` mask SDPA makes of the boolean one, and the boolean masks
themselves (one per window size, per row with document masks) live through the step.

Activation offload (``kernels.activation_offload``): the recomputed blocks' inputs live
in host memory; on the device are at most :data:`OFFLOAD_IN_FLIGHT` of them (one being
copied, one fetched back ahead of its block).

Every constant that is not a shape is in the block below, with where it comes from;
``benchmarks/memory_estimate.py`` compares the estimate with measured peaks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from recipes_lib.config.schema import RunConfig
from recipes_lib.kernels.sharded import uses_block_mask
from recipes_lib.launch_check.activations import (
    ActivationDtypes,
    DecoderShape,
    block_bytes_per_token,
)
from recipes_lib.launch_check.optimizer_state import optimizer_state_bytes
from recipes_lib.launch_check.parameters import (
    ParameterCounts,
    adapted_linears,
    frozen_model_bytes,
    weight_bytes_of,
)
from recipes_lib.models.windows import attention_choice, layer_window
from recipes_lib.objectives import objective_of
from recipes_lib.parallel.precision import device_type
from recipes_lib.parallel.strategy import StrategySpec, get_strategy

GIB = 2**30

# --------------------------------------------------------------------------- constants
# Outside PyTorch's allocator: the CUDA context with its loaded kernels and the cuBLAS /
# cuDNN handles (nvidia-smi's figure minus max_memory_reserved: about 0.5 GiB on an H100
# with torch 2.11). Part of ``total``, the card's share; not of ``allocated``.
CUDA_CONTEXT_BYTES = 600 * 2**20
# Reserved beyond allocated: the caching allocator rounds blocks up and keeps freed
# ones (max_memory_reserved / max_memory_allocated - 1 measured 0.01-0.20; the larger
# figures where big loss tensors come and go).
ALLOCATOR_SLACK = 0.10
# cuBLAS/cuBLASLt workspaces, which PyTorch's allocator hands out (a few per stream).
WORKSPACE_BYTES = 64 * 2**20
# 4-bit NF4 (bitsandbytes): half a byte per weight plus one absmax per 64-weight block,
# fp32, or with double quantization one byte plus an fp32 constant per 256 blocks.
NF4_BYTES = 0.5
NF4_BLOCK = 64
NF4_DOUBLE_QUANT_GROUP = 256
# Activation checkpointing: while a block's backward runs, its recomputed activations
# and their gradients (about as large again) exist beside the stored block inputs.
RECOMPUTED_BLOCKS = 2.0
# Activation offload: block inputs on the device at once (one copied out or fetched back
# ahead, one in use).
OFFLOAD_IN_FLIGHT = 2
# FSDP2 gathers the block being computed and prefetches the next.
GATHERED_BLOCKS = 2
# Cross-entropy (``losses.causal_lm_loss``), bytes per token and vocabulary entry, ``a``
# the logits' own bytes. Eager, the forward holds the logits, their fp32 copy and the
# fp32 log-softmax (kept for the backward); the backward the kept log-softmax, its
# incoming gradient and the logits' gradient, all fp32. Compiled (``kernels.compile``),
# the upcast is fused into the log-softmax: the logits are kept, then their gradient.
LOSS_FP32 = 4
LOSS_BACKWARD = 3 * LOSS_FP32
COMPILED_LOSS_FORWARD = 1  # times ``a``
COMPILED_LOSS_BACKWARD = 2  # times ``a``
# The fused chunked loss (``kernels.loss_chunk_size``) holds one chunk's fp32 logits and
# logsumexp's two fp32 temporaries (the shifted logits and their exponentials).
CHUNKED_LOSS_FORWARD = 3 * LOSS_FP32


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's device memory at the peak of a training step, in bytes.

    The sum of the sizes below (``parameters`` to ``buffers``) is what PyTorch
    allocates at the peak moment (``allocated``, to compare with
    ``torch.cuda.max_memory_allocated``); ``total`` adds the allocator's slack and the
    CUDA context: what the card must hold.

    Attributes:
        parameters: the weights this rank keeps on the device.
        gradients: gradients of the trainable weights at the peak (0 where the peak
            comes before they exist).
        optimizer: the optimizer's state on the device.
        activations: tensors kept for the backward at the peak.
        logits: the loss's logits and their fp32 copies and gradients at the peak.
        transient: weight copies (bf16 casts, gathered FSDP blocks) and the
            embedding's dense gradient at the peak.
        buffers: the RoPE tables and the cuBLAS workspaces.
        build: the peak while the model is built (before quantization or sharding).
        phase: the moment of the peak: ``forward``, ``backward start``,
            ``backward end`` or ``build``.
        overhead: the CUDA context and the allocator's slack (0 on a CPU).
        notes: what the figure leaves out or assumes for this config.
        gradient_bytes: every trainable parameter's gradient on this rank (what exists
            after the backward), whatever the moment of the peak.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    transient: int
    buffers: int
    build: int
    phase: str
    overhead: int
    world_size: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    gradient_bytes: int = 0

    @property
    def allocated(self) -> int:
        """Peak bytes PyTorch allocates (``max_memory_allocated``)."""
        steady = (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.transient
            + self.buffers
        )
        return max(steady, self.build)

    @property
    def total(self) -> int:
        """What the device must hold: the peak, the allocator's slack, the CUDA context."""
        return self.allocated + self.overhead

    def as_gib(self) -> dict[str, float | str | int]:
        """The breakdown in GiB (two decimals), for reports."""
        sizes = (
            "parameters",
            "gradients",
            "optimizer",
            "activations",
            "logits",
            "transient",
            "buffers",
        )
        out: dict[str, float | str | int] = {k: round(getattr(self, k) / GIB, 2) for k in sizes}
        out.update(
            build=round(self.build / GIB, 2),
            overhead=round(self.overhead / GIB, 2),
            allocated=round(self.allocated / GIB, 2),
            total=round(self.total / GIB, 2),
            phase=self.phase,
            world_size=self.world_size,
        )
        return out


def nf4_bytes_per_weight(double_quant: bool) -> float:
    """Bytes of one 4-bit NF4 weight with its share of the quantization constants."""
    if double_quant:
        return NF4_BYTES + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_DOUBLE_QUANT_GROUP)
    return NF4_BYTES + 4 / NF4_BLOCK


def rows_per_micro_batch(cfg: RunConfig) -> int:
    """Sequences in one micro-batch: the objective's sequences per example (a preference
    pair is two rows, chosen and rejected) times ``data.batch_size``."""
    return cfg.data.batch_size * objective_of(cfg).sequences_per_example


def estimate_memory(cfg: RunConfig, world_size: int = 1) -> MemoryEstimate:
    """One rank's device memory at the peak of a training step of ``cfg``, in bytes.

    The moments compared and the constants used are the module docstring's. Shapes come
    from ``model``, the micro-batch from ``data.batch_size`` x ``data.seq_len`` (gradient
    accumulation adds nothing: the gradients are counted whole anyway).

    Args:
        cfg: the typed run config (``precision=auto`` already resolved).
        world_size: processes the strategy spreads the run over.
    """
    shape, spec = DecoderShape.of(cfg), get_strategy(cfg.strategy.name)
    precision, world = cfg.precision.name, max(1, world_size)
    compiled = bool(cfg.kernels.compile)
    # blocks 0, N, 2N, ... are recomputed (kernels.checkpoint_stride: N); the rest keep theirs
    recomputing = recomputed_block_count(shape.n_layers, cfg.kernels.checkpoint_stride())
    storing, checkpointing = shape.n_layers - recomputing, recomputing > 0
    offload = cfg.strategy.cpu_offload and spec.cpu_offload
    fsdp = spec.shard is not None
    mixed = precision in ("bf16-mixed", "fp8")
    weight_bytes = weight_bytes_of(precision)
    compute_bytes = 4 if precision == "32-true" else 2
    dt = ActivationDtypes.of(precision, fsdp and mixed)
    lora = adapted_linears(cfg)
    qlora = cfg.adapter.kind == "qlora"
    weights = ParameterCounts.of(shape, cfg)
    narrowed = weights.narrowed if weight_bytes == 4 else 0  # stored in bf16, used as is

    def share(state: str, size: float) -> float:
        if state not in spec.sharded_state:
            return size
        return 0.0 if offload else size / world

    # --- what lives through the step
    dense = weights.total + weights.adapters - weights.quantized
    parameters = share("parameters", dense * weight_bytes - 2 * narrowed)
    parameters += weights.quantized * nf4_bytes_per_weight(cfg.adapter.double_quant)
    policy_parameters = parameters
    frozen_params, frozen_bytes, frozen_sharded = _frozen_model(cfg, lora)
    parameters += share("parameters", frozen_bytes) if frozen_sharded else frozen_bytes
    gradients = share("gradients", weights.trainable * weight_bytes)
    optimizer = 0.0 if offload else share("optimizer", optimizer_state_bytes(cfg))
    rope = 2 * shape.max_seq_len * shape.head_dim * 4  # cos and sin, fp32
    buffers: float = rope + (WORKSPACE_BYTES if _on_cuda(cfg) else 0)

    # --- weight copies kept from the forward to the backward, and while computing
    head = shape.head_params
    block_linear = sum(i * o for i, o in shape.linears().values())
    if fsdp:  # the last block stays gathered for the backward
        kept: float = shape.block_params() * compute_bytes
        gathering = (GATHERED_BLOCKS * shape.block_params() + shape.outer_params()) * compute_bytes
    else:
        gathering = 0
        if not mixed:
            kept = 0.0
        elif qlora:  # 4-bit bases are dequantized per use, kept by none
            kept = 2 * head
        else:  # a recomputed block's copies are made again in its backward
            kept = 2 * (storing * (block_linear - narrowed / shape.n_layers) + head)
        kept += 2 * weights.adapters if mixed else 0

    # --- activations and the loss
    # second sequences run without a gradient (KTO's twins, a dense model's): only the
    # first sequences' activations are kept
    objective = objective_of(cfg)
    twins_apart = objective.second_sequence_without_gradient and not cfg.model.moe_experts
    degree = max(1, cfg.strategy.context_parallel)  # ranks sharing each row
    sequences = rows_per_micro_batch(cfg) // (2 if twins_apart else 1)
    tokens = sequences * cfg.data.seq_len // degree  # this rank's share of every row
    block = tokens * block_bytes_per_token(
        shape,
        dt,
        lora=lora,
        dropout=bool(lora) and cfg.adapter.dropout > 0,
        quantized=qlora,
        compiled=compiled,
    )
    bias, masks = 0.0, 0.0  # an attention's additive mask; the boolean masks of the step
    if degree > 1:  # and the gathered keys and values each kept attention holds
        bias, masks = _sharded_attention(cfg, shape, dt.compute, sequences, degree)
        block += tokens * 2 * shape.kv_width * dt.compute * (degree - 1)
    buffers += masks
    head_input = ((2 if dt.casts else dt.residual) * shape.dim) if lora is None else 0
    saved: float = tokens * (dt.residual * shape.dim + head_input + 8)  # final norm, head, ids
    logit_bytes = dt.compute
    vocab_tokens = tokens * shape.vocab_size
    if cfg.kernels.loss_chunk_size is not None:
        # the fused loss keeps d(loss)/d(hidden) and an fp32 d(loss)/d(head) from the
        # forward, and holds one chunk's logits at a time
        saved += tokens * dt.residual * shape.dim + LOSS_FP32 * head
        rows = min(cfg.kernels.loss_chunk_size, tokens)
        loss_forward, loss_backward = rows * shape.vocab_size * CHUNKED_LOSS_FORWARD, 0.0
    elif compiled:
        loss_forward = vocab_tokens * logit_bytes * COMPILED_LOSS_FORWARD
        loss_backward = vocab_tokens * logit_bytes * COMPILED_LOSS_BACKWARD
    else:
        upcast = LOSS_FP32 if logit_bytes != LOSS_FP32 else 0
        loss_forward = vocab_tokens * (logit_bytes + upcast + LOSS_FP32)
        loss_backward = vocab_tokens * LOSS_BACKWARD
    offloading = cfg.kernels.activation_offload and checkpointing  # inputs on the host
    inputs = min(recomputing, OFFLOAD_IN_FLIGHT) if offloading else recomputing
    saved += inputs * tokens * dt.residual * shape.dim  # recomputed blocks' inputs
    saved += storing * (block + bias)
    if checkpointing:  # one additive mask: the block's gradients hold none
        computing, recomputed = block + bias, RECOMPUTED_BLOCKS * block + bias
    else:
        computing, recomputed = 0.0, 0.0
    computing = max(computing, block) if twins_apart else computing  # beside the saved
    computing += gathering
    embedding_grad = head * dt.residual if weights.trainable == weights.total else 0
    recast = 2 * (block_linear - narrowed / shape.n_layers) if mixed and not fsdp else 0
    recast = recast if checkpointing else 0

    # --- the moments of a step; the largest is the peak
    fixed = parameters + optimizer + buffers
    accumulating = cfg.trainer.accumulate_grad_batches > 1 or cfg.stage.batch_ramp.tokens
    kept_gradients = gradients if accumulating or not spec.frees_gradients else 0.0
    moments = {  # (gradients, activations, logits, weight copies)
        "forward": (kept_gradients, saved, max(loss_forward, computing), kept),
        "backward start": (0.0, saved, loss_backward, kept),
        "backward end": (gradients, recomputed, 0.0, embedding_grad + recast + gathering),
    }
    phase, (grads, acts, logits, transient) = max(moments.items(), key=lambda item: sum(item[1]))
    if phase == "forward" and computing > loss_forward:
        acts, logits = acts + computing - gathering, 0.0  # the peak is inside the blocks
        transient += gathering
    built = 0.0  # offloaded: built on the CPU
    if not (offload and "parameters" in spec.sharded_state):
        # a tied head is made as its own tensor before it is tied
        built = weights.total + (head if shape.tie_embeddings else 0)
    build = built * weight_bytes + buffers
    # a frozen model is built whole in the storage dtype after the policy, then narrowed
    build = max(build, policy_parameters + frozen_params * weight_bytes + buffers)
    steady = fixed + grads + acts + logits + transient
    if build > steady:
        phase = "build"
    allocated = max(build, steady)
    overhead = CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK * allocated if _on_cuda(cfg) else 0.0
    return MemoryEstimate(
        parameters=int(parameters),
        gradients=int(grads),
        optimizer=int(optimizer),
        activations=int(acts),
        logits=int(logits),
        transient=int(transient),
        buffers=int(buffers),
        build=int(build),
        phase=phase,
        overhead=int(overhead),
        world_size=world,
        notes=tuple(_notes(cfg, spec, lora, recomputing * tokens * dt.residual * shape.dim)),
        gradient_bytes=int(gradients),
    )


def recomputed_block_count(n_layers: int, stride: int) -> int:
    """Blocks recomputed in the backward when every ``stride``-th one is (0: none)."""
    return 0 if stride <= 0 else -(-n_layers // stride)


def _on_cuda(cfg: RunConfig) -> bool:
    return device_type(cfg.trainer.accelerator, torch.cuda.is_available()) == "cuda"


def _frozen_model(cfg: RunConfig, lora: dict[str, int] | None) -> tuple[int, float, bool]:
    """The frozen models beside the policy, as (parameters, bytes, sharded as the policy):
    what the objective's spec declares (a separate reference, a teacher of its own shape
    whole on each rank), summed."""
    spec = objective_of(cfg)
    params, size, sharded = 0, 0.0, False
    for frozen in spec.frozen_models(cfg, spec.settings_of(cfg)):
        if frozen.shares_policy:
            continue
        count, nbytes = frozen_model_bytes(frozen.model, cfg.precision.name)
        params, size, sharded = params + count, size + nbytes, sharded or frozen.sharded
    return params, size, sharded


def _sharded_attention(
    cfg: RunConfig, shape: DecoderShape, compute: int, rows: int, degree: int
) -> tuple[float, float]:
    """Bytes of split rows' attention masks: SDPA's additive copy that one kept attention
    holds, and the boolean masks of the step (one per window size whose kind of layer
    takes a dense one; per row with document masks, else one broadcast over the rows).
    None with a flex BlockMask (its block tables are small)."""
    seq_len = cfg.data.seq_len
    on = "cuda" if _on_cuda(cfg) else "cpu"
    choice = attention_choice(cfg.kernels, cfg.model, document_mask=cfg.data.document_mask)
    windows = {layer_window(cfg.model, i) for i in range(shape.n_layers)}
    dense = {
        w for w in windows if not uses_block_mask(choice.for_window(w).name, on, seq_len, degree)
    }
    if not dense:
        return 0.0, 0.0
    mask_rows = rows if cfg.data.document_mask else 1
    elements = mask_rows * (seq_len // degree) * seq_len  # (rows | 1, T / N, T)
    return float(elements * compute), float(len(dense) * elements)


def _notes(
    cfg: RunConfig, spec: StrategySpec, lora: dict[str, int] | None, block_inputs: float
) -> list[str]:
    """What the figure assumes beyond the measured cases."""
    notes = []
    if cfg.strategy.context_parallel > 1:
        notes.append(
            f"strategy.context_parallel={cfg.strategy.context_parallel}: a rank's share of "
            "each row counted, with the whole row's keys and values (estimated)"
        )
    if cfg.kernels.activation_offload and block_inputs:
        notes.append(
            f"kernels.activation_offload: {block_inputs / GIB:.2f} GiB of block inputs in "
            "pinned host memory per rank, not counted"
        )
    if cfg.kernels.activation_checkpointing == "auto":
        notes.append(
            "kernels.activation_checkpointing=auto: counted as off; the run picks what fits "
            "(recipes_lib.launch_check.autofit)"
        )
    if spec.needs_package is not None:
        notes.append(f"strategy={spec.name}: its partitioning counted like FSDP's (not measured)")
    if cfg.strategy.cpu_offload:
        notes.append("strategy.cpu_offload: the host's share is not counted")
    if cfg.precision.name == "fp8":
        notes.append("precision=fp8: activations counted as bf16 (float8 copies are smaller)")
    if cfg.kernels.compile and lora:
        notes.append("compiled blocks with an adapter: the adapters counted as eager")
    if objective_of(cfg).sequences_per_example == 2:
        objective = cfg.stage.objective
        notes.append(f"{objective}: each example counted as two rows of data.seq_len tokens")
        if cfg.kernels.loss_chunk_size is not None:  # it keeps no gradient from the forward
            notes.append(
                f"{objective}: its fused log-probs counted as the fused cross-entropy (at most)"
            )
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        notes.append("PYTORCH_CUDA_ALLOC_CONF is set: the allocator's slack may differ")
    return notes
