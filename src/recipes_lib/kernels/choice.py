"""Which attention backend each kind of layer runs: the backends by name, and the
choice per kind of layer.

A decoder's attention layers are of two kinds: ``local`` ones attend within a sliding
window (Gemma 3's five of every six, gpt-oss's and OLMo 3's every other one), ``global``
ones to every earlier key (the linear-attention layers of Qwen3.5 are neither: they take
no backend). The two kinds are fastest with different kernels. On an H100 at 8,192
tokens (``benchmarks/results/NOTES.md``), ``flex`` does a Gemma-3-1B local layer in
4.45 ms against SDPA's 8.07 ms (a window is a dense mask to SDPA, which rules its flash
kernel out), while SDPA's flash kernel does a global causal layer in 4.74 ms against
flex's 7.89 ms.

The keys, each one of :data:`ATTENTION_CHOICES`:

- ``kernels.attention``: the backend of every kind (``sdpa`` | ``flex`` | ``varlen`` |
  ``flash_attn``), or ``auto``;
- ``kernels.attention_local`` / ``kernels.attention_global``: one kind's, in place of
  ``kernels.attention`` (null: as ``kernels.attention``).

``auto`` takes, for a kind, the first backend of :data:`AUTO_ORDER` that can do what the
kind needs: a local layer takes ``flex``; a global layer takes ``sdpa`` (its flash
kernel), or ``flex`` when rows are packed with a document mask, which SDPA cannot apply.
Both run on CPU and CUDA, in every float dtype. ``varlen`` (FlashAttention-2 over the
documents) is not in the order: on an H200 it took 9-17% longer than flex's kernel over
packed rows of 8,192 tokens (as long at 2,048), and 1.7x SDPA's time over causal rows
(``benchmarks/results/attention_h200.json``); what it saves is flex's kernel compile.

On a CUDA GPU in bf16, ``auto`` makes one more choice, from the run rather than
the layer (:func:`packed_rows_backend`, applied by
:func:`recipes_lib.parallel.precision.resolve_device_choices`): the global layers of rows
packed with a document mask, at most :data:`VARLEN_ROWS_UP_TO` tokens long, take
``varlen``. There the two kernels take the same time (rows of 2,048 tokens, documents of
512 and 1,024 on average: 1.11 against 1.06 ms and 1.18 against 1.18 on an H200), and
``varlen`` compiles no kernel for those layers where flex's first call took 6.7-8.0 s. A
whole run's first step has not been shown to come sooner for it (one call, varlen first:
49.3 s cold against flex's 38.5; ``benchmarks/results/start_time_h200.json``). Longer
rows keep flex, and so do window layers.

A model builds each kind's mask once per batch, with that kind's backend
(:meth:`AttentionChoice.build_mask`): two backends build a mask each, never one per
layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from recipes_lib.errors import ConfigError, UnsupportedKernelError
from recipes_lib.kernels.attention import AttentionBackend, FlexAttention, SDPAAttention
from recipes_lib.kernels.flash import FlashAttention, TorchVarlenAttention

_BACKENDS: dict[str, type[AttentionBackend]] = {
    SDPAAttention.name: SDPAAttention,
    FlexAttention.name: FlexAttention,
    TorchVarlenAttention.name: TorchVarlenAttention,
    FlashAttention.name: FlashAttention,
}
ATTENTION_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)
AUTO = "auto"
ATTENTION_CHOICES: tuple[str, ...] = (*ATTENTION_BACKENDS, AUTO)

GLOBAL, LOCAL = "global", "local"
LAYER_KINDS: tuple[str, ...] = (GLOBAL, LOCAL)
ATTENTION_KEY = "kernels.attention"
KIND_KEYS = {GLOBAL: "kernels.attention_global", LOCAL: "kernels.attention_local"}

# what auto tries for a kind of layer, fastest first (see the module docstring); the
# first whose capabilities cover the kind's needs is taken
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    LOCAL: (FlexAttention.name, SDPAAttention.name),
    GLOBAL: (SDPAAttention.name, FlexAttention.name),
}


# packed rows up to this long take varlen for global layers under auto on a CUDA GPU
# (see the module docstring); FlashAttention-2 takes heads up to FLASH_MAX_HEAD_DIM wide,
# a multiple of 8
VARLEN_ROWS_UP_TO = 2048
FLASH_MAX_HEAD_DIM = 256


def packed_rows_backend(
    row_len: int, head_dim: int, capability: tuple[int, int] | None
) -> str | None:
    """The backend ``auto`` takes for the global layers of rows packed with a document
    mask, ``row_len`` tokens long, on the run's device; None where the per-layer order
    (:data:`AUTO_ORDER`) stands.

    Args:
        row_len: the packed rows' length (``data.seq_len``).
        head_dim: the query, key and value heads' width.
        capability: the lowest compute capability of the CUDA GPUs the run computes on
            in bf16; None for any other run.
    """
    backend = TorchVarlenAttention()
    needed = backend.capabilities.min_cuda_capability or (0, 0)
    if capability is None or capability < needed or backend.unavailable_reason() is not None:
        return None
    if torch.version.hip is not None:  # measured on NVIDIA GPUs only
        return None
    if row_len > VARLEN_ROWS_UP_TO or head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
        return None
    return backend.name


def get_attention_backend(name: str, key: str = ATTENTION_KEY) -> AttentionBackend:
    """A new instance of the attention backend called ``name``.

    Args:
        name: one of :data:`ATTENTION_BACKENDS`.
        key: the config key that named it, for the error.

    Raises:
        ConfigError: ``name`` is not one of :data:`ATTENTION_BACKENDS`.
    """
    if name not in _BACKENDS:
        choices = " | ".join(ATTENTION_BACKENDS)
        raise ConfigError(
            f"{key}={name!r} is not an attention backend; choose one of: {choices} "
            f"(e.g. {key}=sdpa)"
        )
    return _BACKENDS[name]()


def layer_kind(window: int | None) -> str:
    """The kind of a layer attending to ``window`` keys (None: every earlier one)."""
    return GLOBAL if window is None else LOCAL


@dataclass
class AttentionChoice:
    """The attention backend of each kind of layer, and the key that chose it.

    Kinds that name the same backend share one instance (and so its cached masks).
    ``kinds`` are the kinds a model has: :meth:`check` and :meth:`line` cover those
    alone, while every kind has a backend (a frozen model of another shape may share
    the choice).

    Attributes:
        backends: kind -> backend, for every kind of :data:`LAYER_KINDS`.
        keys: kind -> the setting that chose it, e.g. ``kernels.attention=auto``.
        kinds: the kinds of layer in use.
    """

    backends: dict[str, AttentionBackend]
    keys: dict[str, str]
    kinds: tuple[str, ...] = LAYER_KINDS

    @classmethod
    def single(cls, backend: AttentionBackend) -> AttentionChoice:
        """Every kind of layer on ``backend`` (``kernels.attention=<its name>``)."""
        key = f"{ATTENTION_KEY}={backend.name}"
        return cls(dict.fromkeys(LAYER_KINDS, backend), dict.fromkeys(LAYER_KINDS, key))

    def for_kinds(self, kinds: Iterable[str]) -> AttentionChoice:
        """This choice for a model with the layers of ``kinds`` (the same backends)."""
        present = set(kinds)
        in_order = tuple(kind for kind in LAYER_KINDS if kind in present)
        return AttentionChoice(self.backends, self.keys, in_order)

    def for_window(self, window: int | None) -> AttentionBackend:
        """The backend of the layers attending to ``window`` keys."""
        return self.backends[layer_kind(window)]

    def lacking(self, capability: str) -> list[str]:
        """The kinds in use whose backend lacks ``capability``, a field of
        :class:`~recipes_lib.kernels.attention.AttentionCapabilities` such as
        ``context_parallel``."""
        return [k for k in self.kinds if not getattr(self.backends[k].capabilities, capability)]

    def names(self) -> dict[str, str]:
        """kind -> backend name, for the kinds in use."""
        return {kind: self.backends[kind].name for kind in self.kinds}

    @property
    def name(self) -> str:
        """The one backend's name when every kind in use runs it, else ``mixed``."""
        names = set(self.names().values())
        return names.pop() if len(names) == 1 else "mixed"

    def line(self) -> str:
        """``attention: sdpa``, or each kind's backend and the key that chose it:
        ``attention: global layers sdpa, local layers flex (kernels.attention=auto)``."""
        names = self.names()
        if not names:
            return "attention: none (no attention layers)"
        keys = sorted({self.keys[kind] for kind in self.kinds})
        if len(set(names.values())) == 1 and keys == [f"{ATTENTION_KEY}={self.name}"]:
            return f"attention: {self.name}"
        kinds = ", ".join(f"{kind} layers {name}" for kind, name in names.items())
        return f"attention: {kinds} ({', '.join(keys)})"

    def check(self, *, device: torch.device | str, dtype: torch.dtype, document_mask: bool) -> None:
        """Each backend in use checked as :meth:`AttentionBackend.check` does, its
        error naming the key that chose it."""
        checked: set[int] = set()
        for kind in self.kinds:
            backend = self.backends[kind]
            if id(backend) not in checked:
                checked.add(id(backend))
                backend.check(
                    device=device, dtype=dtype, document_mask=document_mask, key=self.key(kind)
                )

    def unavailable_reason(self) -> str | None:
        """Why a backend in use cannot be used in this environment, or None."""
        for kind in self.kinds:
            reason = self.backends[kind].unavailable_reason()
            if reason is not None:
                return f"{self.key(kind)}={self.backends[kind].name}: {reason}"
        return None

    def build_mask(
        self,
        doc_ids: Tensor | None,
        seq_len: int,
        *,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> object | None:
        """The mask of the layers attending to ``window`` keys, built by their backend
        (:meth:`AttentionBackend.build_mask`).

        Raises:
            UnsupportedKernelError: ``doc_ids`` given to a kind whose backend cannot
                mask documents, naming the kind's key.
        """
        kind = layer_kind(window)
        backend = self.backends[kind]
        if doc_ids is not None and not backend.capabilities.document_mask:
            raise UnsupportedKernelError(
                f"{self.chosen(kind)} cannot mask attention to documents (doc_ids given "
                f"to the {kind} layers); use {self.key(kind)}=flex, or set "
                "data.document_mask=false."
            )
        return backend.build_mask(doc_ids, seq_len, device=device, window=window)

    def row_tensors(self, mask: object | None, window: int | None) -> list[Tensor]:
        """The per-row tensors of the mask of ``window``'s layers
        (:meth:`AttentionBackend.row_tensors`)."""
        return self.for_window(window).row_tensors(mask)

    def wrapped(self, wrap) -> AttentionChoice:
        """This choice with each distinct backend in use replaced by ``wrap(backend)``
        (the sharded attention of context parallelism), kinds that shared one still
        sharing; a kind the model lacks keeps its own."""
        done: dict[int, AttentionBackend] = {}
        for kind in self.kinds:
            backend = self.backends[kind]
            if id(backend) not in done:
                done[id(backend)] = wrap(backend)
        backends = {kind: done.get(id(b), b) for kind, b in self.backends.items()}
        return AttentionChoice(backends, self.keys, self.kinds)

    def key(self, kind: str) -> str:
        """The key that chose ``kind``'s backend (without its value)."""
        return self.keys[kind].split("=", 1)[0]

    def chosen(self, kind: str) -> str:
        """``kind``'s setting and, when ``auto`` chose, the backend it took:
        ``kernels.attention_local=flex``, ``kernels.attention=auto (sdpa)``."""
        name = self.backends[kind].name
        setting = self.keys[kind]
        return setting if setting.endswith(f"={name}") else f"{setting} ({name})"


def choose_attention(
    attention: str = SDPAAttention.name,
    *,
    local: str | None = None,
    global_: str | None = None,
    document_mask: bool = False,
) -> AttentionChoice:
    """The backend of each kind of layer, as the keys name them (see the module docstring).

    Args:
        attention: ``kernels.attention``: a backend for every kind, or ``auto``.
        local: ``kernels.attention_local``; None: as ``attention``.
        global_: ``kernels.attention_global``; None: as ``attention``.
        document_mask: rows are packed with a document mask (``data.document_mask``):
            ``auto`` takes a backend that can apply it.

    Raises:
        ConfigError: a name that is not one of :data:`ATTENTION_CHOICES`, naming its key.
    """
    given = {GLOBAL: global_, LOCAL: local}
    names: dict[str, str] = {}
    keys: dict[str, str] = {}
    for kind in LAYER_KINDS:
        key, value = KIND_KEYS[kind], given[kind]
        if value is None:  # as kernels.attention
            key, value = ATTENTION_KEY, attention
        if value not in ATTENTION_CHOICES:
            raise ConfigError(
                f"{key}={value!r} is not an attention backend; choose one of: "
                f"{' | '.join(ATTENTION_CHOICES)} (e.g. {key}=sdpa)"
            )
        names[kind] = _auto(kind, document_mask) if value == AUTO else value
        keys[kind] = f"{key}={value}"
    instances = {name: _BACKENDS[name]() for name in dict.fromkeys(names.values())}
    return AttentionChoice({kind: instances[name] for kind, name in names.items()}, keys)


def _auto(kind: str, document_mask: bool) -> str:
    """``auto``'s backend for ``kind``: the first of :data:`AUTO_ORDER` that can do it."""
    for name in AUTO_ORDER[kind]:
        if not document_mask or _BACKENDS[name].capabilities.document_mask:
            return name
    raise AssertionError(f"no backend of {AUTO_ORDER[kind]} masks documents")  # flex does
