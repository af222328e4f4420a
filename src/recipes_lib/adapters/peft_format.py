"""LoRA adapters written in PEFT's format, for the matching ``transformers`` model.

A PEFT adapter folder holds ``adapter_config.json`` (a ``LoraConfig`` whose target
modules are Hugging Face names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``) and ``adapter_model.safetensors`` with keys
such as ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, so

    base = AutoModelForCausalLM.from_pretrained(exported_base)   # export_hf_checkpoint
    model = PeftModel.from_pretrained(base, "<run.dir>/adapter")

gives the same outputs as the adapted native model. A family whose checkpoints fuse
layers (Phi-3's ``qkv_proj``, ``gate_up_proj``) gets one adapter per fused module that
computes what the parts' adapters do (their ranks stacked, ``rank_pattern`` and
``alpha_pattern`` set so that each part keeps its scale).

Adapters on a mixture's routed experts follow transformers (5 and later), which holds a
layer's experts stacked as ``mlp.experts.gate_up_proj`` ``(E, 2F, C)`` and ``down_proj``
``(E, C, F)``: PEFT adapts those parameters (``target_parameters``), each expert with its
own rank-r factors. ``w1`` and ``w3`` go into one ``gate_up_proj`` adapter of rank 2r,
built as a fused layer's is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from recipes_lib.adapters.lora import (
    ADAPTER_NAME,
    HF_TO_NATIVE_TARGET,
    SCORE_HEAD,
    expert_factors,
    has_score_head,
    lora_config,
    lora_factors,
    lora_layers,
    native_targets,
)
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.files import chmod_as_umask
from recipes_lib.models import Transformer
from recipes_lib.models.families import get_family
from recipes_lib.models.families.base import TensorNames
from recipes_lib.models.hf_fallback import HFCausalLM

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_NATIVE_TO_HF_TARGET = {native: hf for hf, native in HF_TO_NATIVE_TARGET.items()}
# transformers' stacked experts: each parameter and the native weights it stacks
EXPERT_PARAMETERS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}


def model_decoder(model: nn.Module) -> Transformer:
    """The decoder in ``model`` (itself, or the one a PEFT wrapper holds)."""
    return next(m for m in model.modules() if isinstance(m, Transformer))


def hf_target_modules(config: AdapterConfig) -> list[str]:
    """``adapter.target_modules`` as Hugging Face module names (of the unfused layout)."""
    return [_NATIVE_TO_HF_TARGET.get(name, name) for name in native_targets(config)]


def _factors(model: nn.Module, state: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Each adapted layer's ``(A, B)`` by native weight name."""
    factors = {}
    for layer_name, layer in lora_layers(model).items():
        a, b = (
            state.get(f"{layer_name}.lora_{f}.{ADAPTER_NAME}.weight", own)
            for f, own in zip("AB", lora_factors(layer), strict=True)
        )
        factors[f"{layer_name}.weight"] = (a.detach().cpu(), b.detach().cpu())
    return factors


def _fuse(parts: list[tuple[Tensor, Tensor] | None], rows: list[int]) -> tuple[Tensor, Tensor]:
    """One adapter on a fused layer equal to its parts' adapters: the parts' A stacked
    (rank k * r for k adapted parts), B block-diagonal with zero rows for an unadapted
    part; the caller scales alpha by k so that alpha / rank stays the parts'."""
    adapted = [part for part in parts if part is not None]
    a = torch.cat([a for a, _ in adapted], dim=0)  # (k * r, in)
    r = adapted[0][0].shape[0]
    b = torch.zeros(sum(rows), a.shape[0], dtype=adapted[0][1].dtype)  # (out, k * r)
    row, column = 0, 0
    for part, height in zip(parts, rows, strict=True):
        if part is not None:
            b[row : row + height, column : column + r] = part[1]
            column += r
        row += height
    return a, b


def _per_expert(a: Tensor, b: Tensor, experts: int) -> list[tuple[Tensor, Tensor]]:
    """PEFT's factors of stacked expert weights as each expert's own ``(A_e, B_e)``
    (see :func:`~recipes_lib.adapters.lora.expert_factors`)."""
    a, b = expert_factors(a, b, experts)  # (E, r, in), (out, r, E)
    return [(a[e], b[:, :, e]) for e in range(experts)]


def _stacked(per_expert: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`_per_expert`."""
    a = torch.stack([a for a, _ in per_expert])  # (E, r, in)
    b = torch.stack([b for _, b in per_expert], dim=-1)  # (out, r, E)
    return a.flatten(0, 1).contiguous(), b.flatten(1).contiguous()


def _expert_adapters(
    names: TensorNames, layers: dict[str, dict[str, tuple[Tensor, Tensor]]], experts: int
) -> dict[str, Tensor]:
    """PEFT's tensors for adapters on each layer's stacked experts (``layers``: native
    block prefix -> ``w1``/``w3``/``w2`` -> factors). The nested wrappers PEFT makes for
    two parameters of one module key the first one's factors under ``base_layer``."""
    out = {}
    for prefix, weights in layers.items():
        block = prefix.split(".")[1]
        module = f"{PEFT_PREFIX}model.layers.{block}.{names.experts_module}"
        for i, parts in enumerate(EXPERT_PARAMETERS.values()):  # the target adapts all three
            per_part = [_per_expert(*weights[part], experts) for part in parts]
            rows = [weights[part][1].shape[0] for part in parts]  # each B: (out, r * E)
            fused = [_fuse([p[e] for p in per_part], rows) for e in range(experts)]
            a, b = _stacked(fused)
            key = f"{module}.base_layer" if i == 0 else module
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a, b
    return out


def peft_state_dict(
    model: nn.Module, state: Mapping[str, Tensor] | None = None
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """The LoRA factors of ``model`` (or of ``state``) under PEFT's Hugging Face keys, and
    the fused Hugging Face modules (Phi-3's ``qkv_proj``, ``gate_up_proj``; the experts'
    ``gate_up_proj``) with how many adapted parts each one's adapter stacks (see
    :func:`_fuse`)."""
    decoder = model_decoder(model)
    names = get_family(decoder.config.family).names
    factors = _factors(model, state if state is not None else {})
    out: dict[str, Tensor] = {}
    fused: dict[str, list[tuple[Tensor, Tensor] | None]] = {}
    stacked: dict[str, int] = {}
    expert_layers: dict[str, dict[str, tuple[Tensor, Tensor]]] = {}
    for name, (a, b) in factors.items():
        if names.is_stacked(name):  # layers.N.feed_forward.experts.w1.weight
            prefix, weight, _ = name.rsplit(".", 2)
            expert_layers.setdefault(prefix, {})[weight] = (a, b)
            continue
        hf_name, into = names.to_hf(name), names.fused_of(name)
        if into is not None:
            fused.setdefault(into[0], [None] * into[2])[into[1]] = (a, b)
            continue
        if hf_name is None:
            raise CheckpointError(f"adapter on {name!r}, which has no Hugging Face name")
        out[f"{PEFT_PREFIX}{hf_name.removesuffix('.weight')}.lora_A.weight"] = a.contiguous()
        out[f"{PEFT_PREFIX}{hf_name.removesuffix('.weight')}.lora_B.weight"] = b.contiguous()
    for hf_name, parts in fused.items():
        rows = [  # a fused tensor's parts are each a Linear's weight
            cast(nn.Linear, decoder.get_submodule(native.removesuffix(".weight"))).out_features
            for native in names.fused_parts(hf_name) or []
        ]
        a, b = _fuse(parts, rows)
        out[f"{PEFT_PREFIX}{hf_name.removesuffix('.weight')}.lora_A.weight"] = a
        out[f"{PEFT_PREFIX}{hf_name.removesuffix('.weight')}.lora_B.weight"] = b
        stacked[hf_name.removesuffix(".weight").rsplit(".", 1)[-1]] = sum(
            part is not None for part in parts
        )
    if expert_layers:
        out.update(_expert_adapters(names, expert_layers, decoder.config.moe_experts))
        stacked["gate_up_proj"] = len(EXPERT_PARAMETERS["gate_up_proj"])
    return out, stacked


def save_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike,
    config: AdapterConfig,
    *,
    state: Mapping[str, Tensor] | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``model``'s adapters as a PEFT folder loadable by ``PeftModel.from_pretrained``
    (a reward model's: over ``...ForSequenceClassification``, its trained score head
    saved whole as PEFT's ``modules_to_save``).

    Args:
        model: the adapted native model.
        out_dir: the folder to write (created if needed).
        config: the ``adapter`` config the model was adapted with.
        state: the adapted model's state dict to take the LoRA factors from instead of
            the model's own (an average or EMA).
        base_model_name_or_path: recorded in ``adapter_config.json``.

    Raises:
        CheckpointError: ``model`` has no adapters.
    """
    if isinstance(model, HFCausalLM):  # the transformers fallback: its own names
        from recipes_lib.adapters.hf_fallback import save_fallback_adapter

        return save_fallback_adapter(model, out_dir, config, state=state)
    tensors, stacked = peft_state_dict(model, state)
    if not tensors:
        raise CheckpointError(f"cannot save an adapter to {out_dir}: the model has no LoRA layers")
    folder = Path(out_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    keys = [key.removeprefix(PEFT_PREFIX) for key in tensors]
    experts = get_family(model_decoder(model).config.family).names.experts_module
    on_experts = [key for key in keys if experts and f".{experts}." in key]
    targets = sorted({key.split(".")[-3] for key in keys if key not in on_experts})
    parameters = [f"{experts}.{name}" for name in EXPERT_PARAMETERS] if on_experts else None
    peft_config = lora_config(config, targets, parameters)
    peft_config.task_type = "CAUSAL_LM"
    if has_score_head(model):  # trained whole: saved beside the factors, as PEFT saves it
        head = (state or {}).get(SCORE_HEAD, model.get_parameter(SCORE_HEAD))
        tensors[f"{PEFT_PREFIX}score.weight"] = head.detach().cpu().contiguous()
        peft_config.modules_to_save = ["score"]
        peft_config.task_type = "SEQ_CLS"
    # a fused module's adapter stacks k parts: rank k * r, alpha k * alpha keep alpha / r
    peft_config.rank_pattern = {name: k * config.r for name, k in stacked.items()}
    peft_config.alpha_pattern = {name: k * config.alpha for name, k in stacked.items()}
    peft_config.base_model_name_or_path = base_model_name_or_path
    peft_config.inference_mode = True
    save_file(tensors, str(folder / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    chmod_as_umask(folder / ADAPTER_WEIGHTS_NAME)  # safetensors creates it 0600
    peft_config.save_pretrained(str(folder))  # adapter_config.json
    return folder
