"""A small model of every kind of parameter an optimizer meets, one step over it, and the
bytes its ``optimizer.state`` then holds: what the optimizer specs' estimates are checked
against (``tests/unit/optim/test_optimizer_state.py`` and its GPU twin)."""

from __future__ import annotations

import torch
from torch import nn

from recipes_lib.config.schema import OptimConfig
from recipes_lib.optim import build_optimizer, optimizer_state_bytes
from recipes_lib.optim.state import optimizer_state_storage


class ProbeModel(nn.Module):
    """An embedding, a block of matrices (one of 4096 elements or more, where 8-bit
    moments begin, one of a size that is no multiple of 256), biases, a norm gain, a
    stack of expert matrices (3-D) and an untied output head."""

    def __init__(self, vocab: int = 300, dim: int = 64, hidden: int = 130):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)  # 8,320 weights: 32.5 blocks of 256
        self.down = nn.Linear(hidden, dim, bias=False)
        self.gate = nn.Linear(dim, 24, bias=False)  # 1,536: below min_8bit_size
        self.norm = nn.RMSNorm(dim)
        self.experts = nn.Parameter(torch.randn(3, dim, 24) * 0.02)  # (E, C, F)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, C)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + torch.einsum("btf,ecf->btc", self.gate(h), self.experts) / 3
        return self.output(self.norm(h))  # (B, T, V)


def measured_and_estimated(
    config: OptimConfig, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[int, int]:
    """(bytes of state after one step, the spec's estimate) for ``config`` over a
    :class:`ProbeModel` on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    model = ProbeModel().to(device=device, dtype=dtype)
    optimizer = build_optimizer(model, config)
    tokens = torch.randint(0, 300, (2, 8), device=device)
    model(tokens).float().square().mean().backward()
    optimizer.step()
    with torch.device("meta"):  # the estimate needs shapes only
        shapes = ProbeModel().to(dtype=dtype)
    return optimizer_state_storage(optimizer), optimizer_state_bytes(shapes, config)
