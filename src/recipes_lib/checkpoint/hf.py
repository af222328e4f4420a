"""Hugging Face checkpoints in and out: Llama, Qwen2 and Mistral folders.

A Hugging Face model folder holds ``config.json`` and its weights as ``model.safetensors``
or as shards listed by ``model.safetensors.index.json``. The native
:class:`~recipes_lib.models.Transformer` uses Meta's parameter names and the same
rotate-half RoPE as ``transformers``, so converting is a rename, with no permutation:

    model.embed_tokens              <-> tok_embeddings
    model.layers.N.self_attn.q_proj <-> layers.N.attention.wq   (k_proj, v_proj, o_proj alike)
    model.layers.N.mlp.gate_proj    <-> layers.N.feed_forward.w1
    model.layers.N.mlp.up_proj      <-> layers.N.feed_forward.w3
    model.layers.N.mlp.down_proj    <-> layers.N.feed_forward.w2
    model.layers.N.input_layernorm  <-> layers.N.attention_norm
    model.layers.N.post_attention_layernorm <-> layers.N.ffn_norm
    model.norm                      <-> norm
    lm_head                         <-> output   (absent when the embeddings are tied)

:func:`load_hf_checkpoint` reads a downloaded folder into a model; :func:`load_hf_weights_into`
fills a model built from a run's config (``stage.init_from=<folder>``) after checking that the
folder's ``config.json`` describes it; :func:`export_hf_checkpoint` writes one that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (as ``llama``, or ``qwen2`` when
the model has q/k/v biases), with the tokenizer and chat template a run saved beside it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import Tensor, nn

from recipes_lib.checkpoint.weights import chmod_as_umask
from recipes_lib.config.schema import ModelConfig, RopeScalingConfig, resolved_model_fields
from recipes_lib.data.tokenizer import (
    load_tokenizer,
    resolve_tokenizer_file,
    save_tokenizer_folder,
    tokenizer_vocab_size,
)
from recipes_lib.errors import CheckpointError
from recipes_lib.models import Transformer
from recipes_lib.models.llama import rope_cos_sin

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
HF_CONFIG_NAME = "config.json"
HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
HF_TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_MAX_LISTED = 5  # mismatches named in an error message

_LAYER_NAMES = {  # Hugging Face name inside a layer -> native name
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
_NATIVE_LAYER_NAMES = {native: hf for hf, native in _LAYER_NAMES.items()}
_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_NATIVE_TOP_NAMES = {native: hf for hf, native in _TOP_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_NATIVE_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_IGNORED_HF_NAMES = re.compile(r".*rotary_emb\.inv_freq")  # RoPE tables some old exports kept
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------------- tensor names
def hf_to_native_name(name: str) -> str | None:
    """The native parameter name of a Hugging Face tensor name, or None if it has none."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _HF_LAYER.fullmatch(name)
    if match and match[2] in _LAYER_NAMES:
        return f"layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    return None


def native_to_hf_name(name: str) -> str | None:
    """The Hugging Face tensor name of a native parameter name, or None if it has none."""
    if name in _NATIVE_TOP_NAMES:
        return _NATIVE_TOP_NAMES[name]
    match = _NATIVE_LAYER.fullmatch(name)
    if match and match[2] in _NATIVE_LAYER_NAMES:
        return f"model.layers.{match[1]}.{_NATIVE_LAYER_NAMES[match[2]]}.{match[3]}"
    return None


# ------------------------------------------------------------------------ config
def _required(config: Mapping[str, Any], key: str) -> Any:
    value = config.get(key)
    if value is None:
        raise CheckpointError(f"the Hugging Face config has no {key!r}")
    return value


def _rope_from_hf(config: Mapping[str, Any]) -> tuple[float, RopeScalingConfig]:
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
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, RopeScalingConfig()
    if rope_type == "linear":
        return theta, RopeScalingConfig(type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return theta, RopeScalingConfig(
            type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_seq_len=int(params["original_max_position_embeddings"]),
        )
    raise CheckpointError(
        f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


def _sliding_window(config: Mapping[str, Any], model_type: str) -> int | None:
    """The attention window some layers use, or None when every layer attends fully."""
    window = config.get("sliding_window")
    if window is None or model_type == "llama":
        return None
    if model_type == "qwen2":
        layer_types = config.get("layer_types")
        if layer_types is not None:
            return window if "sliding_attention" in layer_types else None
        uses = config.get("use_sliding_window", False)
        if not uses or config.get("max_window_layers", 0) >= config["num_hidden_layers"]:
            return None
    return int(window)


def model_config_from_hf(
    config: Mapping[str, Any], *, name: str | None = None, max_seq_len: int | None = None
) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` (llama, qwen2, mistral).

    Qwen2 has biases on q/k/v (``qkv_bias``); a Llama config with ``attention_bias``
    also puts one on ``o_proj``, which the native model lacks, and is refused.

    Sliding-window attention (Mistral v0.1, Qwen2 with ``use_sliding_window``) over a
    window of ``W`` tokens equals full causal attention on sequences of at most ``W``
    tokens, so the model is built with full attention and a context of at most ``W``:
    ``max_seq_len`` defaults to ``min(max_position_embeddings, W)``, and a longer one
    is an error rather than a silently different model.

    Args:
        config: the parsed ``config.json``.
        name: the model's name (default: ``_name_or_path`` or the model type).
        max_seq_len: the context to build for (default: ``max_position_embeddings``);
            RoPE tables of that length are allocated, so a smaller value saves memory.

    Raises:
        CheckpointError: an unsupported model type, activation, bias, RoPE scaling or a
            context longer than the sliding window; or a missing key.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"model_type={model_type!r} is not supported; supported: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise CheckpointError(f"{model_type}: hidden_act={activation!r}; only silu is supported")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{model_type}: mlp_bias=true is not supported")
    if model_type == "llama" and config.get("attention_bias"):
        raise CheckpointError(
            "llama: attention_bias=true also adds a bias to o_proj, which is not supported "
            "(q/k/v biases alone are: model_type qwen2)"
        )
    dim = int(_required(config, "hidden_size"))
    n_heads = int(_required(config, "num_attention_heads"))
    head_dim = config.get("head_dim") or dim // n_heads
    theta, scaling = _rope_from_hf(config)
    max_positions = int(_required(config, "max_position_embeddings"))
    window = _sliding_window(config, model_type)
    if max_seq_len is None:
        max_seq_len = max_positions
        if window is not None and window < max_seq_len:
            log.info(
                "%s: sliding_window=%d < max_position_embeddings=%d: using full attention "
                "over at most %d tokens",
                model_type,
                window,
                max_positions,
                window,
            )
            max_seq_len = window
    elif window is not None and max_seq_len > window:
        raise CheckpointError(
            f"{model_type}: max_seq_len={max_seq_len} exceeds sliding_window={window}; "
            "sliding-window attention is not supported, so the context must stay within "
            f"the window (max_seq_len <= {window})"
        )
    return ModelConfig(
        name=name or config.get("_name_or_path") or model_type,
        vocab_size=int(_required(config, "vocab_size")),
        dim=dim,
        n_layers=int(_required(config, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=None if head_dim * n_heads == dim else int(head_dim),
        ffn_dim=int(_required(config, "intermediate_size")),
        max_seq_len=int(max_seq_len),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=float(config.get("initializer_range", 0.02)),
    )


def hf_config_from_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None
) -> dict[str, Any]:
    """A ``config.json`` for ``transformers``: ``qwen2`` when the model has q/k/v biases,
    ``llama`` otherwise. RoPE is written in the ``rope_theta``/``rope_scaling`` form that
    transformers 4 reads and transformers 5 converts."""
    scaling = config.rope_scaling
    rope_scaling: dict[str, Any] | None = None
    if scaling.type == "linear":
        rope_scaling = {"rope_type": "linear", "type": "linear", "factor": scaling.factor}
    elif scaling.type == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        }
    qwen2 = config.qkv_bias
    out: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads or config.n_heads,
        "head_dim": config.head_dim or config.dim // config.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES[dtype],  # transformers 4
        "dtype": _DTYPE_NAMES[dtype],  # transformers 5
    }
    if qwen2:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layers)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    return out


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model folder.

    Raises:
        CheckpointError: the folder or its config.json is missing or not JSON.
    """
    folder = Path(path).expanduser()
    file = folder / HF_CONFIG_NAME
    if not folder.is_dir():
        raise CheckpointError(f"no Hugging Face model folder at '{folder}'")
    if not file.is_file():
        raise CheckpointError(f"'{folder}' has no {HF_CONFIG_NAME}; not a Hugging Face model")
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"'{file}' is not readable JSON: {err}") from err


# ----------------------------------------------------------------------- loading
def hf_weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a Hugging Face model folder (shards in index order).

    Raises:
        CheckpointError: no safetensors weights, or an index naming a missing shard.
    """
    folder = Path(path).expanduser()
    index = folder / HF_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"'{index}' is not a safetensors index: {err}") from err
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"'{index}' names missing shards: {', '.join(missing[:5])}")
        return files
    single = folder / HF_WEIGHTS_NAME
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")):
        raise CheckpointError(
            f"'{folder}' holds only PyTorch .bin weights; save it with safetensors "
            "(save_pretrained(..., safe_serialization=True))"
        )
    raise CheckpointError(f"'{folder}' has neither {HF_WEIGHTS_NAME} nor {HF_INDEX_NAME}")


def _locate_tensors(
    files: list[Path], tied: bool
) -> tuple[dict[str, tuple[Path, str, tuple[int, ...], str]], list[str]]:
    """native name -> (file, Hugging Face name, shape, dtype), and unmapped names."""
    located: dict[str, tuple[Path, str, tuple[int, ...], str]] = {}
    unexpected: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    native = hf_to_native_name(hf_name)
                    if native is None:
                        if not _IGNORED_HF_NAMES.fullmatch(hf_name):
                            unexpected.append(hf_name)
                        continue
                    if tied and native == "output.weight":
                        continue  # a tied head stored anyway: the embeddings are the head
                    piece = f.get_slice(hf_name)
                    located[native] = (file, hf_name, tuple(piece.get_shape()), piece.get_dtype())
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"'{file}' is not a readable safetensors file: {err}") from err
    return located, unexpected


def _mismatches(
    expected: Mapping[str, tuple[int, ...]],
    located: Mapping[str, tuple[Path, str, tuple[int, ...], str]],
    unexpected: list[str],
) -> list[str]:
    shapes = [
        f"{located[name][1]}: checkpoint {located[name][2]} vs model {shape}"
        for name, shape in expected.items()
        if name in located and located[name][2] != shape
    ]
    missing = [native_to_hf_name(name) or name for name in expected if name not in located]
    unexpected = unexpected + [located[name][1] for name in located if name not in expected]
    lines = []
    if shapes:
        lines.append(f"{len(shapes)} shape mismatch(es): " + "; ".join(shapes[:_MAX_LISTED]))
    if missing:
        lines.append(f"{len(missing)} missing: " + ", ".join(missing[:_MAX_LISTED]))
    if unexpected:
        lines.append(f"{len(unexpected)} unexpected: " + ", ".join(unexpected[:_MAX_LISTED]))
    return lines


def empty_model(
    config: ModelConfig,
    attention: str = "sdpa",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """A model with uninitialised weights on ``device``, to load a checkpoint into.

    Built on the meta device, so no random initialisation runs; the RoPE tables are
    computed (in float32, whatever ``dtype``).
    """
    with torch.device("meta"):
        model = Transformer(config, attention)
    model.to(dtype).to_empty(device=device)
    cos, sin = rope_cos_sin(
        config.max_seq_len, model.head_dim, config.rope_theta, config.rope_scaling, device
    )
    model.rope_cos, model.rope_sin = cos, sin
    return model


def _checked_tensors(
    folder: Path, model: nn.Module, tied: bool, what: str
) -> dict[str, tuple[Path, str, tuple[int, ...], str]]:
    """The folder's tensors located by native name, after checking that every tensor of
    ``model`` (a tied output head aside) is there with its shape and nothing else is."""
    located, unexpected = _locate_tensors(hf_weight_files(folder), tied)
    expected = {
        name: tuple(t.shape)
        for name, t in model.state_dict().items()
        if not (tied and name == "output.weight")
    }
    problems = _mismatches(expected, located, unexpected)
    if problems:
        raise CheckpointError(f"'{folder}' does not fit {what}: " + " | ".join(problems))
    return located


def _copy_tensors(
    params: Mapping[str, Tensor], located: Mapping[str, tuple[Path, str, tuple[int, ...], str]]
) -> None:
    """Copy each located tensor into ``params[name]`` (in place, cast to its dtype),
    opening every file once."""
    by_file: dict[Path, list[str]] = {}
    for name, (file, _, _, _) in located.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    params[name].copy_(f.get_tensor(located[name][1]))


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model folder (a folder holding config.json)."""
    folder = Path(path).expanduser()
    return folder.is_dir() and (folder / HF_CONFIG_NAME).is_file()


# ModelConfig field -> how config.json says it, for messages
_HF_KEY_NAMES = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "norm_eps": "rms_norm_eps",
    "qkv_bias": "q/k/v biases (model_type qwen2)",
    "tie_embeddings": "tie_word_embeddings",
}
# Everything that decides what the weights compute must match a checkpoint's config;
# the context length may differ (RoPE tables are built for whatever is configured).
_FREE_FIELDS = ("max_seq_len",)


def hf_config_mismatches(hf: ModelConfig, configured: ModelConfig) -> list[str]:
    """``model.<key>=<ours> vs <config.json key>=<theirs>`` for every field in which a
    Hugging Face model's config differs from the configured model's (label fields and
    ``max_seq_len`` are free to differ)."""
    roles = ("shape", "compute", "context")
    ours, theirs = resolved_model_fields(configured, *roles), resolved_model_fields(hf, *roles)
    return [
        f"model.{name}={ours[name]!r} vs {_HF_KEY_NAMES.get(name, name)}={theirs[name]!r}"
        for name in ours
        if name not in _FREE_FIELDS and ours[name] != theirs[name]
    ]


def load_hf_weights_into(model: Transformer, path: str | os.PathLike, label: str) -> None:
    """Copy a Hugging Face model folder's weights into an already built ``model``.

    The folder's ``config.json`` must describe the same model as ``model.config`` (the
    shapes, RoPE, norm epsilon, biases and tied embeddings; the context length may
    differ), and its tensors must be exactly the model's. Each tensor is read once and
    cast to the parameter's dtype and device.

    Args:
        model: the model to load into (built from the run's ``model`` config).
        path: the folder with ``config.json`` and ``model.safetensors`` or its shards.
        label: how the caller names the source in errors (``stage.init_from='...'``).

    Raises:
        CheckpointError: naming ``label``: the folder is missing or unsupported, its
            config differs from the configured model (the first differences are
            listed), or its tensors' names or shapes do not fit.
    """
    folder = Path(path).expanduser()
    configured: ModelConfig = model.config
    try:
        hf = model_config_from_hf(
            read_hf_config(folder), name=configured.name, max_seq_len=configured.max_seq_len
        )
        differences = hf_config_mismatches(hf, configured)
        if differences:
            raise CheckpointError(
                f"its {HF_CONFIG_NAME} does not match the configured model "
                f"({len(differences)} difference(s)): "
                + "; ".join(differences)
                + "; leave model= out to take the checkpoint's shape (model=from_init)"
            )
        located = _checked_tensors(folder, model, configured.tie_embeddings, "the configured model")
    except CheckpointError as err:
        raise CheckpointError(f"{label}: {err}") from err
    _copy_tensors(model.state_dict(), located)


def load_hf_checkpoint(
    path: str | os.PathLike,
    attention: str = "sdpa",
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_seq_len: int | None = None,
) -> tuple[Transformer, ModelConfig]:
    """Load a downloaded Hugging Face model folder (llama, qwen2, mistral) for inference.

    The model is built on the meta device and each tensor is copied into place as it is
    read, so no random initialisation runs and one copy of the weights is held.

    Args:
        path: the folder with ``config.json`` and ``model.safetensors`` or its shards.
        attention: the attention backend (``sdpa`` | ``flex`` | ``flash_attn``).
        dtype: the parameters' dtype; default the dtype the weights are stored in.
        device: where the model lives.
        max_seq_len: the context to build for (see :func:`model_config_from_hf`).

    Returns:
        The model in eval mode and its config.

    Raises:
        CheckpointError: a missing or unsupported folder, or tensors whose names or
            shapes do not fit the config (the first few of each kind are listed).
    """
    folder = Path(path).expanduser()
    config = model_config_from_hf(read_hf_config(folder), name=folder.name, max_seq_len=max_seq_len)
    with torch.device("meta"):  # only its names and shapes
        shapes = Transformer(config, attention)
    located = _checked_tensors(folder, shapes, config.tie_embeddings, f"its {HF_CONFIG_NAME}")
    if dtype is None:
        dtype = _DTYPES.get(located["tok_embeddings.weight"][3], torch.float32)
    model = empty_model(config, attention, dtype=dtype, device=device)
    _copy_tensors(model.state_dict(), located)
    return model.eval(), config


# ----------------------------------------------------------------------- export
def _hf_state(model: nn.Module | Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    out: dict[str, Tensor] = {}
    unknown = []
    for name, tensor in state.items():
        if config.tie_embeddings and name == "output.weight":
            continue  # transformers ties lm_head to the embeddings itself
        hf_name = native_to_hf_name(name)
        if hf_name is None:
            unknown.append(name)
        else:
            out[hf_name] = tensor
    if unknown:
        raise CheckpointError(
            f"cannot export {len(unknown)} tensor(s) with no Hugging Face name: "
            + ", ".join(unknown[:_MAX_LISTED])
        )
    return out


def _write_safetensors(tensors: dict[str, Tensor], folder: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in [*folder.glob("model-*-of-*.safetensors"), folder / HF_INDEX_NAME]:
        stale.unlink(missing_ok=True)  # an earlier export's shards
    if len(shards) == 1:
        save_file(shards[0], str(folder / HF_WEIGHTS_NAME), metadata={"format": "pt"})
        chmod_as_umask(folder / HF_WEIGHTS_NAME)
        return
    (folder / HF_WEIGHTS_NAME).unlink(missing_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        chmod_as_umask(folder / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / HF_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _first_special_token(tokenizer: Tokenizer) -> str | None:
    specials = [
        (i, t.content) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
    ]
    return min(specials)[1] if specials else None


def export_hf_checkpoint(
    model: nn.Module | Mapping[str, Tensor],
    config: ModelConfig,
    out_dir: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
    *,
    eos_token: str | None = None,
    pad_token: str | None = None,
    chat_template: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a Hugging Face model folder that ``transformers`` loads.

    Writes ``config.json``, the weights (``model.safetensors``, or shards of at most
    ``max_shard_bytes`` each with ``model.safetensors.index.json``; an earlier export's
    weight files in ``out_dir`` are replaced) and, with a tokenizer, ``tokenizer.json``
    and a ``tokenizer_config.json`` naming the EOS and padding tokens and the chat template.

    Args:
        model: a :class:`~recipes_lib.models.Transformer` or its state dict.
        config: the model's shape.
        out_dir: the folder to write (created if needed).
        tokenizer_path: a tokenizer.json, or a folder holding one, to copy (an SFT or
            DPO run's output folder carries the tokenizer and chat template it used).
        eos_token: the end-of-sequence token; default the one the tokenizer_config.json
            beside the tokenizer names, else the tokenizer's first special token.
        pad_token: the padding token; default the one the tokenizer_config.json beside
            the tokenizer names, else the EOS token (what the chat and preference data
            pad with).
        chat_template: a Jinja chat template for ``tokenizer.apply_chat_template``;
            default the one saved beside the tokenizer (see :func:`hf_chat_template`).
        max_shard_bytes: the largest shard.
        dtype: the dtype to store; default the model's.

    Returns:
        ``out_dir`` as a path.

    Raises:
        CheckpointError: a tensor without a Hugging Face name, a tokenizer larger than
            the model's vocabulary, or an EOS token that the tokenizer lacks.
        DataError: ``tokenizer_path`` holds no tokenizer, or a padding token it lacks.
    """
    folder = Path(out_dir).expanduser()
    tensors = {
        name: t.detach().to("cpu", dtype or t.dtype).contiguous()
        for name, t in _hf_state(model, config).items()
    }
    stored_dtype = dtype or tensors["model.embed_tokens.weight"].dtype
    eos_id = None
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path, key="tokenizer_path")
        if tokenizer_vocab_size(tokenizer) > config.vocab_size:
            raise CheckpointError(
                f"the tokenizer '{tokenizer_path}' has {tokenizer_vocab_size(tokenizer)} "
                f"tokens, more than model.vocab_size={config.vocab_size}"
            )
        # a run's output folder carries the template and EOS token it trained with
        beside = resolve_tokenizer_file(tokenizer_path, key="tokenizer_path").parent
        if chat_template is None:
            chat_template = hf_chat_template(beside)
        eos_token = eos_token or _token_text(
            _read_json(beside / HF_TOKENIZER_CONFIG_NAME).get("eos_token")
        )
        eos_token = eos_token or _first_special_token(tokenizer)
        eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
        if eos_token is not None and eos_id is None:
            raise CheckpointError(f"eos_token={eos_token!r} is not a token of '{tokenizer_path}'")
    folder.mkdir(parents=True, exist_ok=True)
    _write_safetensors(tensors, folder, max_shard_bytes)
    hf_config = hf_config_from_model(config, stored_dtype, eos_id)
    (folder / HF_CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer_path is not None:
        save_tokenizer_folder(
            folder,
            tokenizer_path,
            eos_token=eos_token,
            pad_token=pad_token,
            chat_template=chat_template,
            model_max_length=config.max_seq_len,
        )
    return folder


# --------------------------------------------------------------------- tokenizer
def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"'{file}' is not readable JSON: {err}") from err
    return data if isinstance(data, dict) else {}


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: text, or ``{"content": ...}``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _template_text(template: Any) -> str | None:
    """A chat template as stored: a string, or a list of named ones (``default`` wins)."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def load_hf_tokenizer(path: str | os.PathLike) -> tuple[Tokenizer, str | None]:
    """The tokenizer of a Hugging Face folder and its chat template, if it has one.

    The template is read from ``tokenizer_config.json``, or from ``chat_template.jinja``
    or ``chat_template.json`` (where transformers 5 saves it).

    Raises:
        DataError: the folder holds no valid tokenizer.json.
    """
    folder = Path(path).expanduser()
    tokenizer = load_tokenizer(folder, key="tokenizer")
    return tokenizer, hf_chat_template(folder if folder.is_dir() else folder.parent)


def hf_chat_template(folder: str | os.PathLike) -> str | None:
    """The chat template saved in a tokenizer folder, if any: ``chat_template`` of
    ``tokenizer_config.json``, else ``chat_template.jinja`` or ``chat_template.json``
    (where transformers 5 saves it).

    Raises:
        CheckpointError: one of those files is not readable JSON.
    """
    folder = Path(folder).expanduser()
    template = _template_text(_read_json(folder / HF_TOKENIZER_CONFIG_NAME).get("chat_template"))
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is None:
        template = _template_text(_read_json(folder / "chat_template.json").get("chat_template"))
    return template


def hf_eos_token_ids(path: str | os.PathLike, tokenizer: Tokenizer) -> list[int]:
    """The end-of-sequence ids of a Hugging Face folder (possibly several, as Llama 3's).

    Looked up in ``generation_config.json``, then ``config.json``, then the
    ``eos_token`` of ``tokenizer_config.json``; empty when none names one.
    """
    folder = Path(path).expanduser()
    for file in ("generation_config.json", HF_CONFIG_NAME):
        ids = _read_json(folder / file).get("eos_token_id")
        if ids is not None:
            return [int(i) for i in (ids if isinstance(ids, list) else [ids])]
    token = _token_text(_read_json(folder / HF_TOKENIZER_CONFIG_NAME).get("eos_token"))
    token_id = tokenizer.token_to_id(token) if token is not None else None
    return [] if token_id is None else [token_id]
