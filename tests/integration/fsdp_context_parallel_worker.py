"""Run by ``torchrun`` from ``test_fsdp_context_parallel.py``: FSDP2 sharding over every
process composed with context parallelism gives the one-process loss and gradients of a
tiny decoder.

The parameters are sharded with :func:`recipes_lib.parallel.fsdp.shard_model` over a
one-dimensional mesh of the whole world (a row's ranks share the sharding, as
torchtitan's ``dp_shard_cp``); groups of ``degree`` consecutive ranks
(:func:`recipes_lib.parallel.context.new_context_group`) split each row, and the
``world / degree`` replicas read rows of their own. Each rank backpropagates the loss
the module does (:func:`recipes_lib.parallel.context.sharded_loss`) and FSDP2's
reduce-scatter averages the gradients over the world. The reference, computed on every
rank from an unsharded copy: each replica's rows' mean token loss, averaged over the
replicas (what DDP with whole rows gives).

``sum`` is the module's scaling: the loss and the gathered gradients must match within
1e-5 (fp32). ``average`` divides each rank's loss by ``degree``, as if a group's partial
gradients were averaged instead of summed: the worker then checks that the gradients
come out ``degree`` times too small and that the comparison above would have failed.

With a fourth argument ``cuda`` each process takes its GPU over NCCL and the rows are
1,024 tokens long, so that ``flex`` (with documents) runs its BlockMask path with the
compiled kernel; the tolerance is then 1e-3 (the kernel's TF32 dots).

Several cases, separated by ``+``, run one after another in the same processes (which
start and join the group once); each line a case prints begins with the case in
brackets, and the exit status is non-zero when any case fails.

Usage: ``torchrun --nproc_per_node=W fsdp_context_parallel_worker.py <degree>
<plain|docs> <sum|average> [cuda] [+ <degree> <plain|docs> <sum|average> ...]``.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from recipes_lib.config.schema import ModelConfig, PrecisionConfig, StrategyConfig
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.models.transformer import Transformer
from recipes_lib.parallel.context import new_context_group, sharded_loss
from recipes_lib.parallel.fsdp import shard_model

ROWS = 2  # rows a step over all replicas


def token_losses(model, input_ids, labels, doc_ids) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids, doc_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return loss, (labels != -100).sum()


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
    """One case (``<degree> <plain|docs> <sum|average> [cuda]``): its line, and whether
    it came out as it must."""
    degree, documents, mode = int(case[0]), case[1] == "docs", case[2]
    cuda = case[3:] == ["cuda"]
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = world // degree
    scale = 32 if cuda else 1  # rows of 1,024 tokens on GPUs
    T = 32 * scale
    tolerance = 1e-3 if cuda else 1e-5  # fp32: the same sums in a different order
    if cuda:
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    config = ModelConfig(  # flex's CUDA kernel needs heads of 16 or more
        vocab_size=64,
        dim=64 if cuda else 32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=T,
    )
    torch.manual_seed(0)
    model = Transformer(config, "flex" if documents else "sdpa")
    whole = copy.deepcopy(model)  # the one-process reference
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (ROWS, T), generator=generator, device="cpu")
    labels = torch.randint(0, 64, (ROWS, T), generator=generator, device="cpu")
    labels[0, :3] = -100  # rows of different token counts: the normalization shows
    labels[1, 20 * scale :] = -100
    doc_ids = None
    if documents:  # documents that cross the shards' boundaries
        bounds = torch.tensor(
            [[0] * 7 + [1] * 13 + [2] * 12, [0] * 20 + [1] * 3 + [2] * 9], device="cpu"
        )
        doc_ids = bounds.repeat_interleave(scale, dim=1)
    if cuda:
        input_ids, labels = input_ids.cuda(), labels.cuda()
        doc_ids = None if doc_ids is None else doc_ids.cuda()

    per_replica = ROWS // replicas
    reference_loss = 0.0
    for replica in range(replicas):  # each replica's mean, averaged over the replicas
        rows = slice(replica * per_replica, (replica + 1) * per_replica)
        docs = None if doc_ids is None else doc_ids[rows]
        loss, count = token_losses(whole, input_ids[rows], labels[rows], docs)
        (loss / count / replicas).backward()
        reference_loss += (loss / count).item() / replicas
    reference = {n: p.grad for n, p in whole.named_parameters()}

    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,), mesh_dim_names=("data_parallel",))
    shard_model(model, mesh, StrategyConfig(name="fsdp"), PrecisionConfig(name="32-true"))
    group = new_context_group(degree)
    shard = ContextShard(seq_len=T, degree=degree, rank=dist.get_rank(group), group=group)
    model.set_context_shard(shard)
    rows = slice(rank // degree * per_replica, (rank // degree + 1) * per_replica)
    local_docs = None if doc_ids is None else shard.shard(doc_ids[rows])
    local_loss, local_count = token_losses(
        model, shard.shard(input_ids[rows]), shard.shard(labels[rows]), local_docs
    )
    loss = sharded_loss(local_loss, local_count, shard)
    if mode == "average":  # the group's partial gradients averaged, not summed
        loss = loss / degree
    loss.backward()
    # the group's mean; replicas are averaged as the logged loss is
    value = (loss * (degree if mode == "average" else 1)).detach().clone()
    dist.all_reduce(value)
    cp_loss = value.item() / world
    worst, ratios = 0.0, []
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor)  # sharded by FSDP2 over the world
        grad = p.grad.full_tensor()
        worst = max(worst, (grad - reference[name]).abs().max().item())
        ratios.append((grad.norm() / reference[name].norm()).item())
    # one write of the whole line: the ranks share the pipe, and print() writes its end
    # of line apart, so two ranks' lines could run together
    sys.stdout.write(
        f"[{' '.join(case)}] rank {rank}: loss {cp_loss:.8f} vs {reference_loss:.8f}, "
        f"worst grad diff {worst:.2e}, "
        f"gradient norm ratio {min(ratios):.6f}..{max(ratios):.6f}\n"
    )
    sys.stdout.flush()
    same_loss = abs(cp_loss - reference_loss) < tolerance
    if mode == "sum":
        ok = same_loss and worst < tolerance
    else:  # the comparison must catch it: gradients 1 / degree of the reference's
        # (the sum check's absolute bound fails; the reference's largest entry sets the
        # size of the miss, small on a tiny GPU model's 1,024-token rows)
        ok = worst > tolerance and all(abs(r - 1 / degree) < tolerance for r in ratios)
    return ok


if __name__ == "__main__":
    main()
