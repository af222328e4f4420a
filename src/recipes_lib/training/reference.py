"""The frozen reference a post-training objective compares its policy with (DPO's, KTO's,
GRPO's KL term): the adapted policy with its adapters bypassed, or a model of its own
built as the policy is."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from recipes_lib.adapters import adapters_disabled, has_adapter
from recipes_lib.checkpoint.source import load_model_weights
from recipes_lib.models.hf_fallback import is_fallback
from recipes_lib.training.build import build_model

REFERENCE_SOURCE_KEY = "dpo_reference_from"  # checkpoint entry: where the reference came from

if TYPE_CHECKING:
    from recipes_lib.training.module import CausalLMModule


class FrozenReference:
    """The reference policy: a frozen model of its own, or an adapted policy run with its
    adapters bypassed. A plain object, not a module: it is never registered on the
    LightningModule, so it has no place in the optimizer, the state dict or a checkpoint.
    ``source`` is the file a model of its own was loaded from (what a checkpoint records,
    so a resumed run loads it again), else None.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        adapted_policy: nn.Module | None = None,
        source: str | None = None,
    ):
        if (model is None) == (adapted_policy is None):
            raise ValueError("give exactly one of model and adapted_policy")
        self.model = model
        self.adapted_policy = adapted_policy
        self.source = source if model is not None else None
        if model is not None:
            model.eval().requires_grad_(False)

    @property
    def shares_policy(self) -> bool:
        return self.adapted_policy is not None

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, doc_ids: Tensor | None, **head: Any) -> Tensor:
        """The reference's forward: logits, or with ``head`` (``labels``, ...) what the
        model's forward gives for them."""
        if self.model is not None:
            return self.model(input_ids, doc_ids, **head)
        with adapters_disabled(self.adapted_policy) as base:  # type: ignore[arg-type]
            return base(input_ids, doc_ids, **head)

    def logits(self, input_ids: Tensor, doc_ids: Tensor | None) -> Tensor:
        return self(input_ids, doc_ids)

    def match_dtype(self, dtype: torch.dtype) -> None:
        """Cast a separate reference to ``dtype`` (the policy's, under ``*-true`` precision)."""
        if self.model is not None:
            first = next(self.model.parameters(), None)
            if first is not None and first.dtype != dtype:
                self.model.to(dtype=dtype)


def build_reference(
    module: CausalLMModule,
    source: str | None,
    key: str,
    *,
    same_base: bool = True,
    upcycle: bool = False,
) -> FrozenReference:
    """The frozen reference of ``module``'s built policy: the adapted policy with its
    adapters bypassed when it has adapters over ``source`` (``same_base``), else a model
    of its own built as the policy is (same seed, kernels, compilation and sharding; no
    adapter, float8 or activation checkpointing: it does not train) from ``source``
    (``key`` names it in errors). Without a source it starts from the policy's initial
    weights, which the shared seed already gives it.

    A reference of the weights the policy was just loaded from (DPO's and GRPO's
    default) copies them from the policy, still untrained when this runs, instead of
    reading and converting the same files a second time (:func:`_copies_policy`)."""
    policy = module.built_model()
    if has_adapter(policy) and same_base:
        return FrozenReference(adapted_policy=policy)
    copies = _copies_policy(module, source, upcycle)
    plan = dataclasses.replace(
        module.policy_build(),
        init_from=None if copies else source,
        init_label=f"{key}={source!r}" if source is not None else None,
        adapter=None,
        trains=False,
        upcycle=upcycle,
    )
    device, mesh = module.placement()
    reference = build_model(plan, device=device, mesh=mesh, attention=policy.attention_backend)
    if copies and source is not None and not _copy_weights(policy, reference):
        load_model_weights(reference, source, plan.init_label)  # unlike names: read them
    resolved = str(Path(source).expanduser().resolve()) if source is not None else None
    return FrozenReference(model=reference, source=resolved)


def _copies_policy(module: CausalLMModule, source: str | None, upcycle: bool) -> bool:
    """Whether the reference's weights are the policy's as it was loaded: the same
    source, the policy a native model without adapters (names alike) and not float8
    (its weights wrapped for the cast), nor upcycled."""
    return (
        source is not None
        and source == module.init_from
        and not upcycle
        and not has_adapter(module.built_model())
        and module.precision_config.name != "fp8"
        and not is_fallback(module.model_config)
    )


@torch.no_grad()
def _copy_weights(policy: nn.Module, reference: nn.Module) -> bool:
    """Copy ``policy``'s state into ``reference`` (cast where the reference stores its
    frozen projections narrower; shard for shard under FSDP2, both being sharded alike);
    False, copying nothing, where their entries differ."""
    theirs, ours = policy.state_dict(), reference.state_dict()
    if theirs.keys() != ours.keys() or any(
        theirs[name].shape != tensor.shape for name, tensor in ours.items()
    ):
        return False
    for name, tensor in ours.items():
        tensor.copy_(theirs[name])
    return True


def restore_reference(
    reference: FrozenReference | None,
    checkpoint: Mapping[str, Any],
    current: str | None,
    key: str,
) -> str | None:
    """A resumed run has no ``stage.init_from``: load a separate reference from the
    source the checkpoint names (its weights are never in a checkpoint), unless the run
    already loaded one; returns the reference's source. ``key`` is the setting that
    points elsewhere when the file moved."""
    saved = checkpoint.get(REFERENCE_SOURCE_KEY)
    if saved is None or current is not None or reference is None or reference.model is None:
        return current  # nothing recorded, already loaded, or the adapted policy's base
    load_model_weights(
        reference.model,
        saved,
        f"the reference of the resumed checkpoint ({saved!r}; set {key} if it moved)",
    )
    return saved
