"""What every model family declares, and the Hugging Face config pieces they share.

A :class:`Family` is one place for one architecture: the model options it turns on
(checked by :attr:`Family.check`) and its Hugging Face adapter (the ``model_type`` values
it reads, the ``config.json`` mapping both ways, the tensor names). The generic
folder I/O (safetensors files, shards, tokenizer) is ``recipes_lib.checkpoint.hf``'s.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor

from recipes_lib.config.model import head_width
from recipes_lib.config.schema import ModelConfig, RopeScalingConfig
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.models.families.image_text import ImageText

log = logging.getLogger(__name__)

# the decoder's own names inside a block, and outside the blocks: the layer, the name in
# it and its suffix (".weight", ".bias", or none: a parameter of its own, gpt-oss's sinks)
_NATIVE_LAYER = re.compile(r"layers\.(\d+)\.(.+?)(\.weight|\.bias|)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+?)(\.weight|\.bias|)")
# the layer and the whole name inside it
_NATIVE_PREFIX = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER_PREFIX = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Rearranged:
    """A Hugging Face tensor inside a block that holds native ones in another layout
    (gpt-oss's experts: gate and up interleaved in one ``(E, in, 2 * out)`` tensor).

    Attributes:
        parts: the native names inside the block, with their suffix
            (``feed_forward.experts.w1.weight``), in the order ``split`` returns them.
        split: the Hugging Face tensor -> the native ones (views are fine).
        join: the native tensors -> the Hugging Face one; ``join(split(t))`` is ``t``.
    """

    parts: tuple[str, ...]
    split: Callable[[Tensor], list[Tensor]]
    join: Callable[[list[Tensor]], Tensor]


@dataclass(frozen=True)
class TensorNames:
    """The Hugging Face name of each native tensor, as two rename tables.

    Attributes:
        layer: inside block ``N``: Hugging Face ``model.layers.N.<hf>`` <-> native
            ``layers.N.<native>`` (without the ``.weight``/``.bias`` suffix).
        top: whole names outside the blocks, Hugging Face -> native.
        ignored: Hugging Face names that hold nothing the model needs (a RoPE table
            some exports kept).
        fused: inside block ``N``: a Hugging Face tensor that holds several native ones
            stacked along dim 0, in order (Phi-3's ``self_attn.qkv_proj`` is ``wq``,
            ``wk``, ``wv``); it is split by the native tensors' shapes on import and
            concatenated on export.
        experts: inside block ``N``: the Hugging Face name of one expert's tensor, with
            ``{}`` for the expert's number (``mlp.experts.{}.gate_proj``) -> the native
            tensor that stacks every expert's along dim 0 (``feed_forward.experts.w1``).
            Expert ``e``'s slice is named ``<native name>[e]`` (:func:`expert_slice`).
        experts_module: inside block ``N``: transformers' (5+) module of the stacked
            experts, ``gate_up_proj`` and ``down_proj``, which PEFT adapters target.
        rearranged: inside block ``N``: the whole Hugging Face name (suffix included,
            if it has one) of a tensor holding native ones in another layout
            (:class:`Rearranged`), converted both ways.
        prediction_layers: the layers a folder stores past the model's last one are
            multi-token-prediction modules (DeepSeek-V3's, GLM-4.5's), which the decoder
            does not compute: they are skipped on import.
    """

    layer: Mapping[str, str]
    top: Mapping[str, str]
    ignored: re.Pattern = re.compile(r".*rotary_emb\.inv_freq")
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    experts: Mapping[str, str] = field(default_factory=dict)
    experts_module: str = ""
    rearranged: Mapping[str, Rearranged] = field(default_factory=dict)
    prediction_layers: bool = False
    _native_layer: dict[str, str] = field(init=False, repr=False)
    _native_top: dict[str, str] = field(init=False, repr=False)
    _native_fused: dict[str, tuple[str, int, int]] = field(init=False, repr=False)
    _hf_experts: dict[re.Pattern, str] = field(init=False, repr=False)
    _native_experts: dict[str, str] = field(init=False, repr=False)
    _native_rearranged: dict[str, tuple[str, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_native_layer", {v: k for k, v in self.layer.items()})
        object.__setattr__(self, "_native_top", {v: k for k, v in self.top.items()})
        parts = {
            part: (hf, i, len(natives))
            for hf, natives in self.fused.items()
            for i, part in enumerate(natives)
        }
        object.__setattr__(self, "_native_fused", parts)
        hf_experts = {
            re.compile(re.escape(hf).replace(r"\{\}", r"(\d+)")): native
            for hf, native in self.experts.items()
        }
        object.__setattr__(self, "_hf_experts", hf_experts)
        object.__setattr__(self, "_native_experts", {v: k for k, v in self.experts.items()})
        rearranged_parts = {
            part: (hf, i)
            for hf, rearranged in self.rearranged.items()
            for i, part in enumerate(rearranged.parts)
        }
        object.__setattr__(self, "_native_rearranged", rearranged_parts)

    def for_head(self, head: str) -> TensorNames:
        """These names for a model with ``head`` (``model.head``): a score head is
        Hugging Face's ``score.weight`` (``...ForSequenceClassification``), an LM head
        its ``lm_head.weight``."""
        if head == "lm":
            return self
        top = {("score.weight" if v == "output.weight" else k): v for k, v in self.top.items()}
        return replace(self, top=top)

    def is_stacked(self, name: str) -> bool:
        """Whether a native tensor stacks the experts' (one Hugging Face tensor each)."""
        match = _NATIVE_LAYER.fullmatch(name)
        return bool(match and match[2] in self._native_experts)

    def fused_parts(self, name: str) -> list[str] | None:
        """The native names a fused Hugging Face tensor holds, in order, or None."""
        match = _HF_LAYER.fullmatch(name)
        if not (match and match[2] in self.fused):
            return None
        return [f"layers.{match[1]}.{part}{match[3]}" for part in self.fused[match[2]]]

    def fused_of(self, name: str) -> tuple[str, int, int] | None:
        """The fused Hugging Face tensor a native one goes into, its place in it and the
        number of parts, or None."""
        match = _NATIVE_LAYER.fullmatch(name)
        if not (match and match[2] in self._native_fused):
            return None
        hf, index, count = self._native_fused[match[2]]
        return f"model.layers.{match[1]}.{hf}{match[3]}", index, count

    def rearranged_parts(self, name: str) -> tuple[Rearranged, list[str]] | None:
        """The rearrangement of a Hugging Face tensor and the native names it holds, in
        its order, or None."""
        match = _LAYER_PREFIX.fullmatch(name)
        if not (match and match[2] in self.rearranged):
            return None
        rearranged = self.rearranged[match[2]]
        return rearranged, [f"layers.{match[1]}.{part}" for part in rearranged.parts]

    def rearranged_of(self, name: str) -> tuple[str, int, Rearranged] | None:
        """The Hugging Face tensor a native one is rearranged into, its place among the
        parts and the rearrangement, or None."""
        match = _NATIVE_PREFIX.fullmatch(name)
        if not (match and match[2] in self._native_rearranged):
            return None
        hf, index = self._native_rearranged[match[2]]
        return f"model.layers.{match[1]}.{hf}", index, self.rearranged[hf]

    def to_native(self, name: str) -> str | None:
        """The native name of a Hugging Face tensor name, or None if it has none."""
        if name in self.top:
            return self.top[name]
        match = _HF_LAYER.fullmatch(name)
        if match and match[2] in self.layer:
            return f"layers.{match[1]}.{self.layer[match[2]]}{match[3]}"
        if match:
            for pattern, native in self._hf_experts.items():
                expert = pattern.fullmatch(match[2])
                if expert:
                    return expert_slice(f"layers.{match[1]}.{native}{match[3]}", int(expert[1]))
        return None

    def to_hf(self, name: str) -> str | None:
        """The Hugging Face name of a native tensor name, or None if it has none."""
        if name in self._native_top:
            return self._native_top[name]
        stacked, expert = split_expert_slice(name)
        match = _NATIVE_LAYER.fullmatch(stacked)
        if expert is not None:
            if not (match and match[2] in self._native_experts):
                return None
            hf = self._native_experts[match[2]].replace("{}", str(expert))
            return f"model.layers.{match[1]}.{hf}{match[3]}"
        if match and match[2] in self._native_layer:
            return f"model.layers.{match[1]}.{self._native_layer[match[2]]}{match[3]}"
        return None


def expert_slice(stacked: str, expert: int) -> str:
    """The name of expert ``expert``'s slice of a stacked native tensor."""
    return f"{stacked}[{expert}]"


def split_expert_slice(name: str) -> tuple[str, int | None]:
    """``(stacked tensor, expert)`` of an expert slice's name; ``(name, None)`` otherwise."""
    if name.endswith("]") and "[" in name:
        stacked, expert = name[:-1].rsplit("[", 1)
        return stacked, int(expert)
    return name, None


@dataclass(frozen=True)
class Family:
    """One model family: its options and its Hugging Face adapter.

    Attributes:
        name: ``model.family``.
        hf_model_types: the ``config.json`` ``model_type`` values it reads.
        hf_architecture: the ``architectures`` entry its export writes.
        names: its tensors' Hugging Face names.
        from_hf: ``config.json`` -> ModelConfig fields (name and context aside).
        to_hf: ModelConfig -> the family's own ``config.json`` fields (the common ones
            are :func:`common_hf_fields`).
        fixed: the block options (``config.model.BLOCK_OPTIONS``) the family holds at a
            value other than their default; every option it neither fixes nor ``reads``
            holds its default. ``from_hf`` need not return them, and a config that
            differs is refused naming the key (``models.families.check_block_options``).
        reads: the block options its models may vary, read from ``config.json`` by
            ``from_hf`` (SmolLM3's ``nope_layers``, Phi-3's ``partial_rotary_factor``).
        check: refuses what else the family cannot compute or export, naming keys.
        sliding_window: the attention window some layers of a ``config.json`` use, or
            None when every layer attends fully (the model is then built with full
            attention over at most that many tokens: equal within the window).
        extended_rope: whether its models may rotate part of each head
            (``model.partial_rotary_factor`` < 1) and use ``rope_scaling.type=longrope``
            (transformers computes both for its model type: Phi-3).
        hf_score_class: the ``architectures`` entry of a score head's export
            (``model.head=score``); None: the ``...ForSequenceClassification`` of
            ``hf_architecture``; empty: transformers has none for the family.
        image_text: the image-text folder whose text tower is one of its models
            (Gemma 3's ``Gemma3ForConditionalGeneration``), or None.
    """

    name: str
    hf_model_types: tuple[str, ...]
    hf_architecture: str
    names: TensorNames
    from_hf: Callable[[Mapping[str, Any]], dict[str, Any]]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    reads: tuple[str, ...] = ()
    check: Callable[[ModelConfig], None] = lambda config: None
    sliding_window: Callable[[Mapping[str, Any]], int | None] = lambda config: None
    extended_rope: bool = False
    hf_score_class: str | None = None
    image_text: ImageText | None = None

    def architecture(self, head: str) -> str | None:
        """The ``architectures`` entry of an export of a model with ``model.head=head``,
        or None when transformers has no class for it."""
        if head == "lm":
            return self.hf_architecture
        if self.hf_score_class is None:
            return self.hf_architecture.replace("ForCausalLM", "ForSequenceClassification")
        return self.hf_score_class or None


def required(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, refusing a missing one in a message naming it."""
    value = config.get(key)
    if value is None:
        raise CheckpointError(f"the Hugging Face config has no {key!r}")
    return value


def rope_from_hf(config: Mapping[str, Any]) -> tuple[float, RopeScalingConfig]:
    """RoPE theta and scaling from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "rope_type" not in params and any(isinstance(v, Mapping) for v in params.values()):
        raise CheckpointError(
            f"per-layer-type rope_parameters ({sorted(params)}) are not supported"
        )
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1:
        raise CheckpointError("partial_rotary_factor != 1 (partial RoPE) is not supported")
    # a top-level original_max_position_embeddings comes first, as transformers reads it
    original = config.get("original_max_position_embeddings")
    if original is not None:
        params = {**params, "original_max_position_embeddings": original}
    return theta, scaling_from_hf(params, config.get("max_position_embeddings"))


def scaling_from_hf(params: Mapping[str, Any], max_positions: Any) -> RopeScalingConfig:
    """The scaling one ``rope_parameters`` entry (or ``rope_scaling``) describes; YaRN's
    keys as transformers 5 reads them (``original_max_position_embeddings`` defaults to
    ``max_positions``, ``factor`` to their ratio, a zero or missing beta to 32 and 1).

    Raises:
        CheckpointError: a rope type the decoder does not compute, or a missing key.
    """
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeScalingConfig()
    if rope_type == "linear":
        return RopeScalingConfig(type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return RopeScalingConfig(
            type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_seq_len=int(params["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        return _yarn_from_hf(params, max_positions)
    raise CheckpointError(
        f"rope scaling type {rope_type!r} is not supported; supported: "
        f"{', '.join(HF_ROPE_TYPES)} (longrope: model_type phi3)"
    )


HF_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # what scaling_from_hf reads


def _yarn_from_hf(params: Mapping[str, Any], max_positions: Any) -> RopeScalingConfig:
    original = params.get("original_max_position_embeddings") or max_positions
    if original is None:
        raise CheckpointError(
            "the Hugging Face config's yarn rope scaling has no "
            "'original_max_position_embeddings' (nor 'max_position_embeddings')"
        )
    factor = params.get("factor")
    if factor is None:
        if max_positions is None:
            raise CheckpointError("the Hugging Face config's yarn rope scaling has no 'factor'")
        factor = int(max_positions) / int(original)

    def optional(key: str) -> float | None:  # transformers reads a zero as unset
        value = params.get(key)
        return float(value) if value else None

    attention = params.get("attention_factor")
    return RopeScalingConfig(
        type="yarn",
        factor=float(factor),
        original_max_seq_len=int(original),
        attention_factor=None if attention is None else float(attention),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def rope_to_hf(scaling: RopeScalingConfig) -> dict[str, Any] | None:
    """``rope_scaling`` as transformers 4 reads it (and transformers 5 converts)."""
    if scaling.type == "linear":
        return {"rope_type": "linear", "type": "linear", "factor": scaling.factor}
    if scaling.type == "llama3":
        return {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        }
    if scaling.type == "yarn":
        optional = {
            key: getattr(scaling, key)
            for key in ("attention_factor", "mscale", "mscale_all_dim")
            if getattr(scaling, key) is not None
        }
        return {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "truncate": scaling.truncate,
            **optional,
        }
    return None


def common_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every decoder's ``config.json`` spells the same way."""
    model_type = config.get("model_type")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise CheckpointError(f"{model_type}: hidden_act={activation!r}; only silu is supported")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{model_type}: mlp_bias=true is not supported")
    dim = int(required(config, "hidden_size"))
    n_heads = int(required(config, "num_attention_heads"))
    head_dim = config.get("head_dim") or dim // n_heads
    theta, scaling = rope_from_hf(config)
    return dict(
        vocab_size=int(required(config, "vocab_size")),
        dim=dim,
        n_layers=int(required(config, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=None if head_dim * n_heads == dim else int(head_dim),
        ffn_dim=int(required(config, "intermediate_size")),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=float(config.get("initializer_range", 0.02)),
    )


def sliding_layers(family: str, config: Mapping[str, Any], pattern: int) -> list[int]:
    """The ``sliding_attention`` layers of ``config.json``'s ``layer_types``; without the
    list, all but every ``pattern``-th layer (transformers' default for the family).

    Raises:
        CheckpointError: ``layer_types`` that is not one entry per layer of the two kinds.
    """
    n_layers = int(required(config, "num_hidden_layers"))
    types = config.get("layer_types")
    if types is None:
        return [layer for layer in range(n_layers) if (layer + 1) % pattern]
    kinds = {"sliding_attention", "full_attention"}
    if len(types) < n_layers or not set(types[:n_layers]) <= kinds:
        raise CheckpointError(
            f"{family}: layer_types must name sliding_attention or full_attention for each of "
            f"the num_hidden_layers={n_layers} layers, got {list(types)!r}"
        )
    return [layer for layer, kind in enumerate(types[:n_layers]) if kind == "sliding_attention"]


def without_attention_bias(family: str, config: Mapping[str, Any]) -> None:
    """Refuse a ``config.json`` with ``attention_bias`` (biases on q, k, v and o, which
    the decoder does not have), naming the family.

    Raises:
        CheckpointError: ``attention_bias`` is true.
    """
    if config.get("attention_bias"):
        raise CheckpointError(
            f"{family}: attention_bias=true (biases on q_proj, k_proj, v_proj and o_proj) "
            "is not supported"
        )


def common_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields every family writes the same way."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads or config.n_heads,
        "head_dim": head_width(config),
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_to_hf(config.rope_scaling),
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "attention_dropout": 0.0,
        "use_cache": True,
    }


def refuse(family: str, key: str, value: Any, why: str) -> ConfigError:
    """The one-line error of a model option a family cannot have."""
    return ConfigError(f"model.family={family} with model.{key}={value!r}: {why}")


def skip_prediction_layers(family: str, config: Mapping[str, Any]) -> None:
    """Say, in one line, that a folder's multi-token-prediction layers
    (``num_nextn_predict_layers``, stored past the last layer) are not read."""
    extra = int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)
    if extra:
        log.warning(
            "%s: num_nextn_predict_layers=%d: its multi-token-prediction layers (stored from "
            "model.layers.%s on) are not read; the model predicts the next token only",
            family,
            extra,
            config.get("num_hidden_layers"),
        )
