"""Several optimizers over disjoint parameters, stepped and saved as one: how
``optim.name=muon`` runs Muon over the blocks' matrices beside AdamW over the rest."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch


class _PartsState(MutableMapping):
    """The parts' ``state`` as one mapping; an entry set goes to the part that owns the
    parameter (Lightning moves restored state to the device through it)."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = list(parts.values())

    def _owner(self, param: Any) -> torch.optim.Optimizer:
        for part in self.parts:
            if any(p is param for g in part.param_groups for p in g["params"]):
                return part
        raise KeyError(param)

    def __getitem__(self, param: Any) -> Any:
        for part in self.parts:
            if param in part.state:
                return part.state[param]
        raise KeyError(param)

    def __setitem__(self, param: Any, value: Any) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._owner(param).state[param]

    def __iter__(self) -> Iterator[Any]:
        return (param for part in self.parts for param in part.state)

    def __len__(self) -> int:
        return sum(len(part.state) for part in self.parts)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped as one (Muon and AdamW).

    Its ``param_groups`` are the parts' own group dicts, so a learning-rate schedule
    sets both; its ``state`` reads and writes through to the part that owns a parameter.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        params = [p for part in parts.values() for g in part.param_groups for p in g["params"]]
        self.parts: dict[str, torch.optim.Optimizer] = {}
        super().__init__(params, {})
        self.parts = parts

    # read through to the parts every time: loading a state dict gives them new ones
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts.values() for group in part.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        pass  # the base class's own, set while it is built

    # a mapping over the parts' own state, not the base's defaultdict (mypy reports the
    # override at the decorator)
    @property  # type: ignore[override]
    def state(self) -> _PartsState:
        return _PartsState(self.parts)

    @state.setter
    def state(self, value: Any) -> None:
        pass

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts.values():
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """One optimizer's layout over the parts' groups in order (``state`` by parameter
        index, ``param_groups``), which ``torch.distributed.checkpoint`` reads under
        FSDP as any optimizer's."""
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each part gets its groups (in :meth:`state_dict`'s order) and their state,
        indexed from 0 again; a state dict of one entry per part (earlier checkpoints)
        is read too."""
        if set(state_dict) == set(self.parts):
            for name, part in self.parts.items():
                part.load_state_dict(state_dict[name])
            return
        groups, state, start = state_dict["param_groups"], state_dict["state"], 0
        for part in self.parts.values():
            own = groups[start : start + len(part.param_groups)]
            start += len(own)
            local = {index: i for i, index in enumerate(p for g in own for p in g["params"])}
            part.load_state_dict(
                {
                    "state": {local[k]: v for k, v in state.items() if k in local},
                    "param_groups": [{**g, "params": [local[p] for p in g["params"]]} for g in own],
                }
            )
