"""The transformers fallback: any causal language model transformers can build, trained
through the interface of the native :class:`~recipes_lib.models.Transformer`.

A folder whose ``model_type`` has no native family (or any folder with ``model=hf``) is
built as transformers' own ``AutoModelForCausalLM`` (``model.family=hf``), and
:class:`HFCausalLM` wraps it so that every objective calls it as it calls the native
decoder: ``model(input_ids, doc_ids, labels=..., per_token=..., loss_chunk_size=...)``,
``forward_hidden``, ``blocks`` (the decoder layers, for FSDP and activation
checkpointing), ``attention_backend.check`` and ``flops_per_token``.

- Its state dict is transformers' own (``model.layers.0.self_attn.q_proj.weight``): the
  wrapper holds the model's children as its own, so a run's ``model.safetensors`` and an
  export with ``save_pretrained`` carry the names the folder came with.
- Packed rows: document ids become position ids that restart at each document, which
  transformers' attention turns into a block-diagonal causal mask; a model whose
  attention ignores them gets an explicit 4-D mask instead (probed once, at build).
- The output head is fused with the loss (hidden states from the model's base, the
  head applied in chunks) where the model's logits are exactly ``lm_head(hidden)``;
  a model that does more to its logits (soft-capping, a scale, a bias) computes them
  whole, as transformers does (probed once, at build).
- A mixture of experts adds its router's balance loss (:class:`RouterLoss`) to a mean
  cross-entropy in training, as transformers' causal LM adds it to its own loss.
- Decoding (``forward(cache=...)``) keeps transformers' own cache in a
  :class:`FallbackCache`, which answers the generation code as a ``KVCache`` does.
- A causal LM that also reads images or audio (its shape in ``text_config``) is built
  whole and trained on text: what a text forward never reaches (the vision or audio
  tower) is frozen (:func:`freeze_other_towers`).

:func:`fallback_model_config` reads the shape fields the rest of the library estimates
with from any ``config.json``; :func:`check_fallback_folder` refuses, in one line, a
folder this path cannot train.

One concept: transformers' model as the library's decoder; the config it is read from,
the folders it refuses, the probes that decide how it is called and its decoding state
all answer to the one wrapper and change with it.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from recipes_lib.config.model import ModelConfig, head_width
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.losses import chunked_cross_entropy, linear_token_logprobs
from recipes_lib.models.head import head_loss

if TYPE_CHECKING:
    from recipes_lib.models.transformer import Transformer

log = logging.getLogger(__name__)

FALLBACK_FAMILY = "hf"
# the attention implementation transformers runs for each kernels.attention it takes
# (auto, the post-training recipes' setting: flex, which keeps the documents of packed
# rows apart, in every layer; varlen runs in the native decoders only)
ATTENTION_IMPLEMENTATIONS = {
    "sdpa": "sdpa",
    "flex": "flex_attention",
    "flash_attn": "flash_attention_2",
    "auto": "flex_attention",
}
_PROBE_TOKENS = 12  # tokens of the build-time probes (causality, head, packing)
_PROBE_TOLERANCE = 1e-4


def is_fallback(model: ModelConfig | Mapping[str, Any]) -> bool:
    """Whether ``model`` (a ModelConfig or its dict) is served by the transformers
    fallback (``model.family=hf``)."""
    family = model.get("family") if isinstance(model, Mapping) else model.family
    return family == FALLBACK_FAMILY


def _first(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value
    return default


HIDDEN_SIZE_KEYS = ("hidden_size", "n_embd", "d_model", "dim")


def is_multimodal(config: Mapping[str, Any]) -> bool:
    """Whether a config keeps its language model's shape in ``text_config`` rather than
    at its top: a causal LM that reads images or audio too (Gemma 3's and Fuyu's
    image-text folders, an audio-text model)."""
    has_top = config.get("vocab_size") and _first(config, *HIDDEN_SIZE_KEYS)
    return isinstance(config.get("text_config"), Mapping) and not has_top


def _language_shape(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config that holds the language model's shape: the whole one, or, for a
    multimodal one, its ``text_config`` with transformers' defaults filled in, as
    transformers' ``get_text_config`` gives it (a folder saved by transformers 4, such as
    the published Gemma 3 ones, writes only the values that differ from them)."""
    if not is_multimodal(config):
        return config
    text = dict(config["text_config"])
    try:
        from transformers import AutoConfig

        values = {k: v for k, v in config.items() if k != "model_type"}
        full = AutoConfig.for_model(str(config.get("model_type")), **values)
        return {**full.get_text_config().to_dict(), **text}
    except Exception:  # noqa: BLE001 - an unknown type or a config of its own code
        return text


def fallback_model_config(
    hf_config: Mapping[str, Any],
    *,
    name: str | None = None,
    max_seq_len: int | None = None,
    trust_remote_code: bool = False,
) -> ModelConfig:
    """The :class:`ModelConfig` of the fallback for a ``config.json``: ``family=hf``,
    the whole config in ``hf_config`` (what the model is built from), and the shape
    fields the estimates and data checks read, taken from the keys most configs use.

    Raises:
        CheckpointError: the config names no ``vocab_size`` or hidden size.
    """
    config = dict(hf_config)
    shape = _language_shape(config)
    vocab = shape.get("vocab_size")
    dim = _first(shape, *HIDDEN_SIZE_KEYS)
    if not vocab or not dim:
        raise CheckpointError(
            f"model_type={config.get('model_type')!r}: its config.json names no vocab_size or "
            "hidden size (hidden_size, n_embd, d_model), at its top or in its text_config, "
            "so it is not a language model's"
        )
    n_heads = int(_first(shape, "num_attention_heads", "n_head", "num_heads", default=1))
    head_dim = _first(shape, "head_dim")
    positions = _first(
        shape, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"
    )
    context = int(max_seq_len or positions or 2048)
    return ModelConfig(
        name=str(name or config.get("_name_or_path") or config.get("model_type") or "hf"),
        family=FALLBACK_FAMILY,
        vocab_size=int(vocab),
        dim=int(dim),
        n_layers=int(_first(shape, "num_hidden_layers", "n_layer", "num_layers", default=1)),
        n_heads=n_heads,
        n_kv_heads=_first(shape, "num_key_value_heads"),
        head_dim=int(head_dim) if head_dim else None,
        ffn_dim=int(_first(shape, "intermediate_size", "n_inner", "ffn_dim", default=4 * dim)),
        max_seq_len=context,
        tie_embeddings=bool(
            config.get("tie_word_embeddings", shape.get("tie_word_embeddings", True))
        ),
        hf_config=config,
        trust_remote_code=trust_remote_code,
    )


# ------------------------------------------------------------------ bad input
def causal_lm_types() -> frozenset[str]:
    """The ``model_type`` values transformers has an ``AutoModelForCausalLM`` for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def remote_code_of(hf_config: Mapping[str, Any]) -> str | None:
    """The folder's own causal-LM class (``auto_map``), which runs the folder's code."""
    auto_map = hf_config.get("auto_map") or {}
    return auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, Mapping) else None


def check_fallback_config(
    hf_config: Mapping[str, Any], trust_remote_code: bool, where: str
) -> None:
    """Refuse, in one line naming ``where``, a config the fallback cannot build: a model
    type transformers builds no causal LM for (an encoder, a diffusion model), or a model
    whose code is the folder's own without ``model.trust_remote_code=true``.

    Raises:
        ConfigError: as above.
    """
    model_type = hf_config.get("model_type")
    remote = remote_code_of(hf_config)
    if remote is not None:
        if not trust_remote_code:
            raise ConfigError(
                f"{where}: its config.json runs the folder's own code ({remote}); set "
                "model.trust_remote_code=true to run it (the run records the flag)"
            )
        return
    if model_type not in causal_lm_types():
        architectures = ", ".join(hf_config.get("architectures") or []) or "none named"
        raise ConfigError(
            f"{where}: model_type={model_type!r} (architectures: {architectures}) is not a "
            "causal language model: transformers has no AutoModelForCausalLM for it"
        )
    if hf_config.get("is_encoder_decoder"):
        raise ConfigError(
            f"{where}: model_type={model_type!r} is an encoder-decoder model, not a "
            "decoder-only causal language model"
        )


def tokenizer_size(folder: Path) -> int | None:
    """Tokens of the folder's ``tokenizer.json`` (added ones included), or None."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def check_fallback_folder(folder: Path, vocab_size: int, where: str) -> None:
    """Refuse a folder whose tokenizer has more tokens than the model has embeddings.

    Raises:
        ConfigError: in one line naming ``where``.
    """
    tokens = tokenizer_size(folder)
    if tokens is not None and tokens > vocab_size:
        raise ConfigError(
            f"{where}: its tokenizer.json has {tokens} tokens but the model embeds "
            f"{vocab_size} (vocab_size in config.json): ids past {vocab_size - 1} have no "
            "embedding; use the tokenizer the model was trained with"
        )


# --------------------------------------------------------------- the wrapper
@dataclass(frozen=True)
class FallbackAttention:
    """What the base module asks of an attention backend, for transformers' own
    attention (``name`` is transformers' ``attn_implementation``)."""

    name: str
    packs_documents: bool

    def check(self, *, device: torch.device, dtype: torch.dtype, document_mask: bool) -> None:
        """Raises ConfigError: document masking on a model that cannot keep documents apart."""
        del device, dtype
        if document_mask and not self.packs_documents:
            raise ConfigError(
                "data.document_mask=true: this transformers model does not keep the "
                "documents of a packed row apart (neither by position ids nor by a 4-D "
                "mask); set data.document_mask=false data.chat.packing=false (a row each)"
            )


PER_TOKEN_WITHOUT_BALANCE = "this objective's per-token losses train without it"
MASKED_WITHOUT_BALANCE = (
    "this model's packed rows (a 4-D document mask) and its logits (more than its head's "
    "product) train without it"
)


@dataclass
class RouterLoss:
    """A transformers mixture of experts' load-balancing loss, as its causal LM adds
    it to the loss: ``coef`` times its modeling module's ``load_balancing_loss_func``
    of the router logits, over ``experts`` experts of which each token takes ``top_k``.
    """

    balance: Callable[..., Tensor]
    experts: int
    top_k: int
    coef: float
    warned: bool = False  # the line of :meth:`warn_once` was said

    @classmethod
    def of(cls, hf_model: nn.Module) -> RouterLoss | None:
        """The balance loss ``hf_model`` adds to its loss, or None: a dense model, one
        whose coefficient is 0 (``router_aux_loss_coef``), or one whose modeling code
        names no ``load_balancing_loss_func``."""
        module = sys.modules.get(type(hf_model).__module__)
        balance = getattr(module, "load_balancing_loss_func", None)
        coef = getattr(hf_model, "router_aux_loss_coef", None)
        experts = getattr(hf_model, "num_experts", None)
        top_k = getattr(hf_model, "num_experts_per_tok", None)
        if not callable(balance) or not coef or not experts or not top_k:
            return None
        return cls(balance, int(experts), int(top_k), float(coef))

    def loss(self, router_logits: Any, token_mask: Tensor | None) -> Tensor:
        """``coef`` times the balance loss of ``router_logits`` (one tensor per mixture
        layer), over the tokens ``token_mask`` ``(B, T)`` marks (None: every token)."""
        mask = None if token_mask is None else token_mask.long()
        return self.coef * self.balance(router_logits, self.experts, self.top_k, mask)

    def warn_once(self, why: str = PER_TOKEN_WITHOUT_BALANCE) -> None:
        """Say once that the run trains without the balance loss, and ``why``."""
        if not self.warned:
            self.warned = True
            log.warning(
                "the transformers fallback adds a mixture of experts' balance loss "
                "(router_aux_loss_coef=%s) to mean cross-entropy losses (SFT, pretraining); "
                "%s",
                self.coef,
                why,
            )


class FallbackCache:
    """Decoding state of the transformers fallback: transformers' own cache object
    (made by the model's first cached call, so a hybrid or state-space model makes its
    own kind) behind the interface of :class:`~recipes_lib.models.KVCache`: ``length``
    positions held, ``key_mask`` (``(B, S)`` bool or None) marking each row's real
    tokens, ``batch_size``, ``max_len`` and :meth:`reset`."""

    def __init__(self, batch_size: int, max_len: int):
        self.state: Any = None  # transformers' Cache
        self.length = 0
        self.key_mask: Tensor | None = None  # (B, S): positions holding real tokens
        self._batch_size, self._max_len = batch_size, max_len

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def max_len(self) -> int:
        return self._max_len

    def rewind(self, start: int) -> None:
        """Keep the first ``start`` positions only: all (``start == length``) or none.

        Raises:
            ConfigError: a rewind to a position in between (transformers' caches of
                different kinds drop positions in different ways, some not at all).
        """
        if start == 0:
            self.reset()
        elif start != self.length:
            raise ConfigError(
                f"start_pos={start}: the transformers fallback's cache holds {self.length} "
                "positions and restarts at 0 or continues at the end, nowhere between"
            )

    def reset(self) -> None:
        """Forget every cached position."""
        self.state, self.length = None, 0


def document_positions(doc_ids: Tensor) -> Tensor:
    """Position ids ``(B, T)`` that restart at 0 where each document of a packed row
    starts (where ``doc_ids`` changes)."""
    B, T = doc_ids.shape
    index = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_mask_4d(doc_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """An additive ``(B, 1, T, T)`` mask: each token sees the earlier tokens of its own
    document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    allowed = (same & causal)[:, None]
    zero = torch.zeros((), dtype=dtype, device=doc_ids.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def decoder_layers(hf_model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules of the classes transformers declares as
    never split (``_no_split_modules``), else the longest ``nn.ModuleList``."""
    kinds = set(getattr(hf_model, "_no_split_modules", None) or [])
    layers = [m for m in hf_model.modules() if type(m).__name__ in kinds]
    if layers:
        return layers
    lists = [list(m) for m in hf_model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else []


def base_model(hf_model: nn.Module) -> nn.Module:
    """The decoder under the head: transformers' ``get_decoder()``, else its
    ``base_model``."""
    get_decoder = getattr(hf_model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if isinstance(decoder, nn.Module) and decoder is not hf_model:
        return decoder
    base = getattr(hf_model, "base_model", hf_model)
    if base is not hf_model:
        return base
    # a model whose prefix names no child (Llama 4's text model): its first child that
    # is a transformers model of its own
    from transformers import PreTrainedModel

    inner = [m for m in hf_model.children() if isinstance(m, PreTrainedModel)]
    return inner[0] if inner else hf_model


def freeze_other_towers(hf_model: Any) -> int:
    """Freeze what a text-only forward of a multimodal causal LM never reaches: every
    parameter outside its decoder (``get_decoder``, the language model) and its input
    and output embeddings, such as a vision or audio tower and its projector. They would
    get no gradient (DDP waits for one), are no optimizer's to keep, and are written back
    as they came. ``hf_model``: transformers' ``PreTrainedModel``. Returns the number of
    parameters frozen."""
    reached = [hf_model.get_decoder(), hf_model.get_input_embeddings()]
    reached.append(hf_model.get_output_embeddings())
    kept = {id(p) for module in reached if module is not None for p in module.parameters()}
    frozen = 0
    for param in hf_model.parameters():
        if id(param) not in kept and param.requires_grad:
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the native decoder's interface.

    Args:
        config: the run's ``model`` (``family=hf``).
        hf_model: transformers' ``...ForCausalLM``.
        attention: the attention implementation it runs (transformers' name).
    """

    hf: Any  # transformers' model (a PreTrainedModel)
    _base: Any  # its base model: the decoder without the head

    @property
    def loss_beyond_logits(self) -> bool:
        """Whether its training loss holds more than the cross-entropy of its logits (a
        mixture's balance loss, which its forward adds given ``labels``); see
        :attr:`recipes_lib.models.Transformer.loss_beyond_logits`."""
        return self.router is not None

    def __init__(self, config: ModelConfig, hf_model: nn.Module, attention: str = "sdpa"):
        super().__init__()
        self.config = config
        # transformers' model, held outside the module tree: its children are this
        # module's own, so the state dict has transformers' names
        self.__dict__["hf"] = hf_model
        for name, child in hf_model.named_children():
            if hasattr(type(self), name):  # its name would hide the interface's own
                model_type = (config.hf_config or {}).get("model_type")
                raise ConfigError(
                    f"model_type={model_type!r}: its module {name!r} has the name of the "
                    f"fallback's own {type(self).__name__}.{name}, so the fallback cannot "
                    "hold it under transformers' name; this model type is not supported"
                )
            self.add_module(name, child)
        for name, param in hf_model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        # not a child either: its modules would have a second name
        self.__dict__["_base"] = base_model(hf_model)
        if is_multimodal(config.hf_config or {}):
            freeze_other_towers(hf_model)
        self._layers = decoder_layers(hf_model)
        self.fused_head = False
        self.attention_backend = FallbackAttention(attention, packs_documents=True)
        self._packing = "positions"  # | "mask": a 4-D block mask
        # what its forward takes when decoding: the cache under transformers' name for
        # it (``cache``; ``past_key_values`` in older code), position ids, a logits cut
        takes = set(inspect.signature(hf_model.forward).parameters)
        # a mixture of experts' balance loss, added to the training loss
        self.router = RouterLoss.of(hf_model) if "output_router_logits" in takes else None
        self._cache_key = "cache" if "cache" in takes else "past_key_values"
        self._takes_positions = "position_ids" in takes
        self._takes_logits_to_keep = "logits_to_keep" in takes
        # the first training batch's loss, the library's and transformers' own
        self.load_check: dict[str, float] | None = None
        self.train(hf_model.training)
        self.probe()

    # -------------------------------------------------------------- interface
    @property
    def blocks(self) -> list[nn.Module]:
        """The decoder layers (FSDP's units, activation checkpointing's)."""
        return list(self._layers)

    @property
    def packing(self) -> str:
        """How packed rows keep their documents apart: ``positions`` (position ids that
        restart per document) or ``mask`` (a 4-D block mask)."""
        return self._packing

    @property
    def tok_embeddings(self) -> nn.Embedding:
        """The input embeddings, under the native decoder's name (where decoding finds
        the model's device and dtype)."""
        return self.hf.get_input_embeddings()

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> FallbackCache:
        """An empty decoding cache for ``batch_size`` rows of up to ``max_len`` positions
        (default ``model.max_seq_len``), as :meth:`KVCache.for_model
        <recipes_lib.models.KVCache.for_model>` makes one for the native decoder.

        Raises:
            ConfigError: ``max_len`` exceeds ``model.max_seq_len``.
        """
        limit = self.config.max_seq_len
        max_len = limit if max_len is None else max_len
        if not 0 < max_len <= limit:
            raise ConfigError(
                f"a KV cache of {max_len} positions does not fit model.max_seq_len={limit}"
            )
        return FallbackCache(batch_size, max_len)

    @property
    def head_weight(self) -> Tensor:
        head = self.hf.get_output_embeddings()
        return head.weight

    def set_activation_checkpointing(self, enabled: bool, stride: int = 1) -> None:
        """Recompute the activations of every ``stride``-th decoder layer in the
        backward pass (transformers' own checkpointing, non-reentrant)."""
        if not enabled:
            self.hf.gradient_checkpointing_disable()
            return
        self.hf.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        layers: list[Any] = self._layers  # transformers' GradientCheckpointingLayer
        for index, layer in enumerate(layers):
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = index % stride == 0

    def _inputs(self, input_ids: Tensor, doc_ids: Tensor | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
        if doc_ids is None:
            return kwargs
        if doc_ids.shape != input_ids.shape:
            raise ValueError(
                f"doc_ids {tuple(doc_ids.shape)} must have the shape of input_ids "
                f"{tuple(input_ids.shape)}"
            )
        kwargs["position_ids"] = document_positions(doc_ids)
        if self._packing == "mask":
            dtype = self.head_weight.dtype
            if torch.is_autocast_enabled(input_ids.device.type):
                dtype = torch.get_autocast_dtype(input_ids.device.type)
            kwargs["attention_mask"] = document_mask_4d(doc_ids, dtype)
        return kwargs

    def forward_hidden(
        self,
        input_ids: Tensor,
        doc_ids: Tensor | None = None,
        *,
        cache: Any = None,
        start_pos: int | None = None,
        token_mask: Tensor | None = None,
    ) -> Tensor:
        """Hidden states after the model's final norm, ``(B, T, C)``."""
        del token_mask  # a mixture's balance loss is added to the loss (forward)
        if cache is not None or start_pos:
            raise ValueError(
                "the transformers fallback decodes through forward(cache=...), which gives "
                "its logits: its hidden states may not be all its head sees"
            )
        self._check_length(input_ids)
        return self._base(**self._inputs(input_ids, doc_ids)).last_hidden_state

    def output(self, hidden: Tensor) -> Tensor:
        """The logits of hidden states ``(..., C)`` from :meth:`forward_hidden`: the
        model's head, where its logits are the head's product with them.

        Raises:
            ConfigError: a model that does more to its logits (soft-capping, a scale).
        """
        if not self.fused_head:
            raise ConfigError(
                "this transformers model's logits are not its head's product with the hidden "
                "states (soft-capping, a scale or a bias): take them from forward()"
            )
        return self.hf.get_output_embeddings()(hidden)

    def _check_length(self, input_ids: Tensor) -> None:
        if input_ids.shape[1] > self.config.max_seq_len:
            raise ConfigError(
                f"input of length {input_ids.shape[1]} is longer than "
                f"model.max_seq_len={self.config.max_seq_len}"
            )

    def logits(self, input_ids: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """transformers' own logits ``(B, T, V)``."""
        self._check_length(input_ids)
        return self.hf(**self._inputs(input_ids, doc_ids)).logits

    def forward(
        self,
        input_ids: Tensor,
        doc_ids: Tensor | None = None,
        *,
        cache: Any = None,
        start_pos: int | None = None,
        labels: Tensor | None = None,
        per_token: bool = False,
        loss_chunk_size: int | None = None,
        last_only: bool = False,
        temperature: float = 1.0,
        token_mask: Tensor | None = None,
        fused: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:
        """As :meth:`recipes_lib.models.Transformer.forward`: logits, or with ``labels``
        the mean cross-entropy (``per_token``: each label's log-prob), the head fused
        with the loss in chunks of ``loss_chunk_size`` rows where the model allows it."""
        if cache is not None:
            if labels is not None or doc_ids is not None:
                raise ValueError("a KV cache decodes: it takes neither labels nor doc_ids")
            return self.decode(input_ids, cache, start_pos, last_only)
        if start_pos:
            raise ValueError(f"start_pos={start_pos} needs a KV cache holding the earlier tokens")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have the shape of input_ids "
                f"{tuple(input_ids.shape)}"
            )
        if labels is not None and self.training and self.load_check is None:
            self.first_batch_check(input_ids, doc_ids, labels, loss_chunk_size)
        return self._forward(
            input_ids,
            doc_ids,
            labels,
            per_token,
            loss_chunk_size,
            last_only,
            temperature,
            fused,
            token_mask=token_mask,
            router=self.training,
        )

    def decode(
        self, input_ids: Tensor, cache: FallbackCache, start_pos: int | None, last_only: bool
    ) -> Tensor:
        """The logits of ``input_ids`` ``(B, T)`` continuing the ``cache.length`` positions
        ``cache`` holds (``start_pos`` 0: starting again), which then holds them too.

        A row's position ids count its real tokens (``cache.key_mask``), as transformers'
        ``generate`` counts them under its attention mask, so a left-padded row decodes
        as it would alone, with absolute position embeddings too.

        Raises:
            ConfigError: the positions run past the cache or ``model.max_seq_len``.
        """
        B, T = input_ids.shape
        start = cache.length if start_pos is None else start_pos
        if T < 1 or not 0 <= start <= cache.length:
            raise ValueError(
                f"start_pos={start} with {T} tokens: the cache holds {cache.length} positions"
            )
        if B > cache.batch_size:
            raise ValueError(f"a batch of {B} rows does not fit a cache of {cache.batch_size}")
        end = start + T
        if end > min(cache.max_len, self.config.max_seq_len):
            raise ConfigError(
                f"positions up to {end} do not fit the KV cache of {cache.max_len} "
                f"positions and model.max_seq_len={self.config.max_seq_len}"
            )
        cache.rewind(start)
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "use_cache": True,
            self._cache_key: cache.state,
        }
        device = input_ids.device
        if cache.key_mask is not None:
            real = cache.key_mask[:B, :end].to(device)  # (B, end)
            kwargs["attention_mask"] = real.long()
            positions = (real.long().cumsum(-1) - 1).clamp(min=0)[:, start:end]  # (B, T)
        else:
            positions = torch.arange(start, end, device=device).expand(B, T)
        if self._takes_positions:
            kwargs["position_ids"] = positions
        if last_only and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.hf(**kwargs)
        state = getattr(out, "cache", None)
        state = state if state is not None else getattr(out, "past_key_values", None)
        if state is None:
            raise ConfigError(
                f"{type(self.hf).__name__} returns no cache to decode with (use_cache=True); "
                "generate from it without one (use_cache=false)"
            )
        cache.state, cache.length = state, end
        return out.logits[:, -1:] if last_only else out.logits

    def _forward(
        self,
        input_ids: Tensor,
        doc_ids: Tensor | None,
        labels: Tensor | None,
        per_token: bool = False,
        loss_chunk_size: int | None = None,
        last_only: bool = False,
        temperature: float = 1.0,
        fused: Callable[[Tensor, Tensor], Tensor] | None = None,
        *,
        token_mask: Tensor | None = None,
        router: bool = False,
    ) -> Tensor:
        # the body of forward, also called from inside it (a sharded model's weights are
        # gathered around the outer call only)
        fuse = self.fused_head and (fused is not None or loss_chunk_size is not None)
        if fused is not None and not self.fused_head:
            raise ConfigError(
                "this transformers model's logits are not its head's product with the hidden "
                "states (soft-capping, a scale or a bias), so a loss fused with the head "
                "cannot be computed on it"
            )
        # a mixture's balance loss joins a mean cross-entropy, as transformers adds it
        mean_loss = labels is not None and not per_token and fused is None
        route = router and self.router is not None and mean_loss
        if router and self.router is not None and not mean_loss and labels is not None:
            self.router.warn_once()
        if not fuse or labels is None:
            logits, routed = self._outputs(input_ids, doc_ids, head=True, router=route)
            if last_only:
                logits = logits[:, -1:]
            if labels is None:
                return logits
            if temperature != 1.0:
                logits = logits / temperature
            return self._with_router(head_loss(logits, labels, per_token), routed, token_mask)
        hidden, routed = self._outputs(input_ids, doc_ids, head=False, router=route)
        weight = self.head_weight
        if fused is not None:
            return fused(hidden, weight)
        if temperature != 1.0:
            hidden = hidden / temperature
        assert loss_chunk_size is not None
        flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()
        if per_token:
            out = linear_token_logprobs(flat_hidden, weight, flat_labels, loss_chunk_size)
            return out.view(labels.shape)
        loss = chunked_cross_entropy(flat_hidden, weight, flat_labels, loss_chunk_size)
        return self._with_router(loss, routed, token_mask)

    def _outputs(
        self, input_ids: Tensor, doc_ids: Tensor | None, *, head: bool, router: bool
    ) -> tuple[Tensor, Any]:
        """The logits (``head``) or the hidden states after the final norm, and with
        ``router`` the router logits of every mixture layer (else None)."""
        if not router:
            if head:
                return self.logits(input_ids, doc_ids), None
            return self.forward_hidden(input_ids, doc_ids), None
        self._check_length(input_ids)
        inputs = self._inputs(input_ids, doc_ids)
        if head and "attention_mask" not in inputs:
            out = self.hf(**inputs, output_router_logits=True)
            return out.logits, out.router_logits
        # the causal LM would read a 4-D document mask as its own balance loss's (B, T)
        # padding mask: the head goes on the base's hidden states instead, where it may
        if head and not self.fused_head:
            assert self.router is not None  # router is asked only of a mixture
            self.router.warn_once(MASKED_WITHOUT_BALANCE)
            return self.logits(input_ids, doc_ids), None
        out = self._base(**inputs, output_router_logits=True)
        if head:
            return self.hf.get_output_embeddings()(out.last_hidden_state), out.router_logits
        return out.last_hidden_state, out.router_logits

    def _with_router(self, loss: Tensor, routed: Any, token_mask: Tensor | None) -> Tensor:
        """``loss`` plus the router's balance loss times its coefficient, where routed."""
        if routed is None or self.router is None:
            return loss
        return loss + self.router.loss(routed, token_mask).to(loss.dtype)

    @torch.no_grad()
    def first_batch_check(
        self, input_ids: Tensor, doc_ids: Tensor | None, labels: Tensor, chunk: int | None
    ) -> dict[str, float]:
        """The mean cross-entropy of a batch as the library computes it (``chunk``: the
        head fused with the loss) and as transformers' own forward does (its
        ``labels``, shifted inside), in eval mode; kept as :attr:`load_check`.

        transformers shifts the labels itself, so the last position's label (which it
        cannot see) counts in neither.
        """
        was_training = self.training
        self.eval()
        try:
            ours_labels = labels.clone()
            ours_labels[:, -1] = -100
            kwargs = self._inputs(input_ids, doc_ids)
            # transformers takes a padding mask for the balance loss: with a 4-D one, the
            # two losses are compared without it
            router = self.router is not None and "attention_mask" not in kwargs
            if router:
                kwargs["output_router_logits"] = True
            ours = self._forward(
                input_ids, doc_ids, ours_labels, loss_chunk_size=chunk, router=router
            )
            theirs_labels = torch.full_like(labels, -100)
            theirs_labels[:, 1:] = labels[:, :-1]
            theirs = self.hf(**kwargs, labels=theirs_labels).loss
        finally:
            self.train(was_training)
        self.load_check = {
            "library_loss": float(ours),
            "transformers_loss": float(theirs),
            "difference": abs(float(ours) - float(theirs)),
        }
        if self.load_check["difference"] > 1e-3 * max(1.0, abs(float(theirs))):
            log.warning(
                "the transformers fallback's first batch: the library's loss %.6f differs "
                "from transformers' own %.6f",
                float(ours),
                float(theirs),
            )
        return self.load_check

    # --------------------------------------------------------------- numbers
    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters, each counted once (a tied head with its embeddings)."""
        seen = {id(p): p for p in self.parameters()}
        n = sum(p.numel() for p in seen.values())
        if exclude_embeddings:
            n -= self.hf.get_input_embeddings().weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, the native decoder's convention: ``6 * N`` over the
        non-embedding parameters (the head counted) plus the attention's
        ``12 * layers * heads * head_dim * seq_len``."""
        c = self.config
        n = self.num_params(exclude_embeddings=True)
        if c.tie_embeddings:
            n += self.head_weight.numel()
        head_dim = head_width(c)
        return 6.0 * n + 12.0 * c.n_layers * c.n_heads * head_dim * seq_len

    # ---------------------------------------------------------------- probes
    @torch.no_grad()
    def probe(self) -> None:
        """Decide, on a few random tokens, how the model is called: refuse one whose
        outputs see later tokens (an encoder); fuse the head with the loss where the
        logits are ``lm_head(hidden)``; keep packed documents apart by position ids, or
        by a 4-D mask where the attention ignores them (or neither: no document masking).

        Raises:
            ConfigError: the model is not causal.
        """
        weight = self.head_weight
        if weight.is_meta:
            return
        was_training = self.training
        self.eval()
        try:
            self._probe(weight)
        finally:
            self.train(was_training)

    def _probe(self, weight: Tensor) -> None:
        g = torch.Generator().manual_seed(0)
        T, vocab = _PROBE_TOKENS, self.config.vocab_size
        # made on the CPU with its generator, whatever device the model is built under
        ids = torch.randint(0, vocab, (1, T), generator=g, device="cpu").to(weight.device)
        logits = self.hf(input_ids=ids, use_cache=False).logits.float()
        changed = ids.clone()
        changed[0, -1] = (changed[0, -1] + 1) % vocab
        later = self.hf(input_ids=changed, use_cache=False).logits.float()
        if not torch.allclose(logits[:, :-1], later[:, :-1], atol=_PROBE_TOLERANCE):
            raise ConfigError(
                f"model_type={self.config.hf_config and self.config.hf_config.get('model_type')!r}"
                ": its outputs at a position depend on later tokens, so it is not a causal "
                "language model (an encoder; one with a decoder mode needs is_decoder=true "
                "in its config.json)"
            )
        head = self.hf.get_output_embeddings()
        if isinstance(head, nn.Linear) and head.bias is None:
            # a head 100x larger makes logits large enough that soft-capping shows
            kept = head.weight.detach().clone()
            head.weight.mul_(100.0)
            try:
                hidden = self._base(input_ids=ids, use_cache=False).last_hidden_state
                ours = (hidden @ head.weight.T).float()
                theirs = self.hf(input_ids=ids, use_cache=False).logits.float()
                self.fused_head = ours.shape == theirs.shape and torch.allclose(
                    ours, theirs, atol=_PROBE_TOLERANCE * 100, rtol=_PROBE_TOLERANCE
                )
            finally:
                head.weight.copy_(kept)
        # packed documents: two documents in one row, each as if alone
        cut = T // 2
        doc_ids = torch.zeros_like(ids)
        doc_ids[:, cut:] = 1
        alone = torch.cat(
            [
                self.hf(input_ids=ids[:, :cut], use_cache=False).logits,
                self.hf(input_ids=ids[:, cut:], use_cache=False).logits,
            ],
            dim=1,
        ).float()
        for packing in ("positions", "mask"):
            self._packing = packing
            try:
                packed = self.logits(ids, doc_ids).float()
            except Exception:  # noqa: BLE001 - a model that takes no 4-D mask cannot pack
                continue
            if torch.allclose(packed, alone, atol=_PROBE_TOLERANCE, rtol=_PROBE_TOLERANCE):
                return
        self._packing = "positions"
        self.attention_backend = FallbackAttention(self.attention_backend.name, False)


# ------------------------------------------------------------------ building
def hf_config_object(config: ModelConfig, folder: Path | None = None):
    """transformers' config object of ``config.hf_config`` (with remote code, read from
    ``folder``)."""
    from transformers import AutoConfig

    if folder is not None and config.trust_remote_code:
        return AutoConfig.from_pretrained(folder, trust_remote_code=True)
    values = dict(config.hf_config or {})
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise CheckpointError("model.hf_config names no model_type")
    for key in ("transformers_version", "architectures", "auto_map"):
        values.pop(key, None)
    return AutoConfig.for_model(model_type, **values)


def _with_attention(build: Callable[[str], nn.Module], attention: str) -> tuple[nn.Module, str]:
    """Build with transformers' implementation of ``attention``, or eager attention
    where the model has none of that kind."""
    implementation = ATTENTION_IMPLEMENTATIONS.get(attention, attention)
    try:
        return build(implementation), implementation
    except (ValueError, ImportError) as err:
        if "attn_implementation" not in str(err) and "does not support" not in str(err):
            raise
        return build("eager"), "eager"


def build_hf_model(
    config: ModelConfig,
    *,
    folder: Path | None,
    attention: str = "sdpa",
    where: str = "model",
) -> HFCausalLM:
    """transformers' causal LM of ``config`` in float32 on the default device: with the
    weights of the Hugging Face ``folder``, else freshly initialised (from the torch
    seed), wrapped as :class:`HFCausalLM`.

    Raises:
        ConfigError: a folder the fallback refuses (see :func:`check_fallback_config`,
            :func:`check_fallback_folder`), or one that does not hold every parameter.
    """
    from transformers import AutoModelForCausalLM

    check_fallback_config(config.hf_config or {}, config.trust_remote_code, where)
    remote = config.trust_remote_code
    if folder is not None:
        check_fallback_folder(folder, config.vocab_size, where)

        def load(implementation: str) -> nn.Module:
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                folder,
                dtype=torch.float32,
                trust_remote_code=remote,
                attn_implementation=implementation,
                output_loading_info=True,
            )
            model, info = loaded
            missing = list(info.get("missing_keys") or [])
            if missing:
                shown = ", ".join(sorted(missing)[:3])
                raise ConfigError(
                    f"{where}: {len(missing)} parameter(s) of {type(model).__name__} have no "
                    f"weights in the folder ({shown}{', ...' if len(missing) > 3 else ''})"
                )
            return model

        hf_model, implementation = _with_attention(load, attention)
    else:
        hf_config = hf_config_object(config)

        def fresh(implementation: str) -> nn.Module:
            return AutoModelForCausalLM.from_config(
                hf_config,
                dtype=torch.float32,
                trust_remote_code=remote,
                attn_implementation=implementation,
            )

        hf_model, implementation = _with_attention(fresh, attention)
    hf_model.to(torch.get_default_device())
    return HFCausalLM(config, hf_model, implementation)


def model_shapes(config: ModelConfig) -> Transformer | HFCausalLM:
    """The model ``config`` describes on the meta device (shapes only, no memory): the
    native decoder, or transformers' own for the fallback. What the estimates count."""
    with torch.device("meta"):
        if is_fallback(config):
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_config(
                hf_config_object(config), trust_remote_code=config.trust_remote_code
            )
            return HFCausalLM(config, hf_model)
        from recipes_lib.models.transformer import Transformer

        return Transformer(config)


def fallback_line(where: str, model_type: object) -> str:
    """The one line a run prints when a folder goes through the fallback on its own."""
    return (
        f"{where}: model_type={model_type!r} has no native path; training it as transformers' "
        "own AutoModelForCausalLM (model.family=hf, the transformers fallback)"
    )


__all__ = [
    "FALLBACK_FAMILY",
    "FallbackAttention",
    "FallbackCache",
    "HFCausalLM",
    "RouterLoss",
    "build_hf_model",
    "check_fallback_config",
    "check_fallback_folder",
    "document_positions",
    "fallback_model_config",
    "is_fallback",
]
