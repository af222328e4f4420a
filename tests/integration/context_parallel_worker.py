"""Run by ``torchrun`` from ``test_context_parallel.py``: the loss and gradients of a
tiny decoder with each row split over every process (context parallelism) must equal
those of the whole rows on one process.

Every rank computes the one-process reference itself (same seed, same batch), then its
share as the module computes it (:func:`recipes_lib.parallel.context.sharded_loss`),
backward, and the gradients averaged over the group as DDP averages them. Exits
non-zero with the largest differences otherwise.

With a fourth argument ``cuda`` each process takes its GPU over NCCL and the rows are
1,024 tokens long, so that ``flex`` runs its BlockMask path (chunks of whole 128-token
blocks) with the compiled kernel; the tolerance is then 1e-3 (the kernel's TF32 dots).

Several cases, separated by ``+``, run one after another in the same processes (which
start and join the group once); each line a case prints begins with the case in
brackets, and the exit status is non-zero when any case fails.

Usage: ``torchrun --nproc_per_node=N context_parallel_worker.py <attention> <documents>
<window> [cuda] [+ <attention> <documents> <window> ...]``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipes_lib.config.schema import ModelConfig
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.models.families import get_family
from recipes_lib.models.transformer import Transformer
from recipes_lib.parallel.context import sharded_loss

TOLERANCE = 1e-5  # fp32: the same sums in a different order


def token_losses(model: Transformer, input_ids, labels, doc_ids) -> tuple[torch.Tensor, int]:
    logits = model(input_ids, doc_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return loss, int((labels != -100).sum())


def main() -> None:
    cases, case = [], []
    for arg in [*sys.argv[1:], "+"]:
        if arg == "+":
            cases.append(case)
            case = []
        else:
            case.append(arg)
    dist.init_process_group("nccl" if cases[0][3:] == ["cuda"] else "gloo")
    ok = [check(case) for case in cases]
    dist.destroy_process_group()
    sys.exit(0 if all(ok) else 1)


def check(case: list[str]) -> bool:
    """One case (``<attention> <documents> <window> [cuda]``): its line, and whether the
    split rows gave the one-process loss and gradients."""
    attention, documents, window = case[0], case[1] == "docs", case[2] == "window"
    cuda = case[3:] == ["cuda"]
    rank, world = dist.get_rank(), dist.get_world_size()
    scale = 32 if cuda else 1  # rows of 1,024 tokens on GPUs
    T, B = 32 * scale, 2
    tolerance = 1e-3 if cuda else TOLERANCE
    if cuda:
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    config = ModelConfig(
        vocab_size=64,
        dim=32 * (2 if cuda else 1),  # flex's CUDA kernel needs heads of 16 or more
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=T,
        # Gemma 3's local layers: a window that crosses the shards' boundaries
        **(
            dict(
                **get_family("gemma3").fixed,
                family="gemma3",
                sliding_window=5 * scale,
                window_layers=[0],
            )
            if window
            else {}
        ),
    )
    torch.manual_seed(0)
    model = Transformer(config, attention)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (B, T), generator=generator, device="cpu")
    labels = torch.randint(0, 64, (B, T), generator=generator, device="cpu")
    labels[0, :3] = -100  # some positions carry no loss
    doc_ids = None
    if documents:  # documents that cross the shards' boundaries
        bounds = torch.tensor([[0] * 7 + [1] * 13 + [2] * 12, [0] * 20 + [1] * 3 + [2] * 9])
        doc_ids = bounds.repeat_interleave(scale, dim=1)
    if cuda:
        input_ids, labels = input_ids.cuda(), labels.cuda()
        doc_ids = None if doc_ids is None else doc_ids.cuda()

    loss, count = token_losses(model, input_ids, labels, doc_ids)
    (loss / count).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    reference_loss = (loss / count).item()
    model.zero_grad()

    shard = ContextShard(seq_len=T, degree=world, rank=rank)
    model.set_context_shard(shard)
    local_docs = None if doc_ids is None else shard.shard(doc_ids)
    local_loss, local_count = token_losses(
        model, shard.shard(input_ids), shard.shard(labels), local_docs
    )
    # the loss the module backpropagates (parallel.context.sharded_loss), and the
    # gradients averaged over the world as DDP averages them
    loss = sharded_loss(local_loss, torch.tensor(local_count), shard)
    loss.backward()
    cp_loss = loss.item()
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, (grad / world - reference[name]).abs().max().item())
    # one write of the whole line: the ranks share the pipe, and print() writes its end
    # of line apart, so two ranks' lines could run together
    sys.stdout.write(
        f"[{' '.join(case)}] rank {rank}: loss {cp_loss:.8f} vs {reference_loss:.8f}, "
        f"worst grad diff {worst:.2e}\n"
    )
    sys.stdout.flush()
    return abs(cp_loss - reference_loss) < tolerance and worst < tolerance


if __name__ == "__main__":
    main()
