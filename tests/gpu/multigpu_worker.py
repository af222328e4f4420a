"""One training run under ``torchrun``, recording what the multi-GPU tests compare.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/gpu/multigpu_worker.py --out result.json [--logits logits.pt] OVERRIDES...

Runs ``recipes_lib.train.run(compose_config(OVERRIDES))`` and, on global rank 0, writes
``result.json``: the training loss of every optimizer step averaged over all ranks
(the loss of the whole global batch, which is what a one-GPU run with the same global
batch logs), the run's metrics and output paths. With ``--logits``, the logits of a
fixed random batch from the final model (the trained, possibly sharded module, in its
training precision) are saved there, to compare with the exported weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

import lightning as L
import torch

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.train import run

LOGITS_SEED = 4321
LOGITS_SHAPE = (2, 64)  # (B, T)


def probe_tokens(vocab_size: int) -> torch.Tensor:
    """The fixed ``(B, T)`` batch whose logits are compared."""
    generator = torch.Generator().manual_seed(LOGITS_SEED)
    return torch.randint(0, vocab_size, LOGITS_SHAPE, generator=generator)


class GlobalLoss(L.Callback):
    """The loss of each optimizer step, averaged over the ranks (a collective)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        mean = trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")
        self.losses[trainer.global_step] = float(mean)


class FinalLogits(L.Callback):
    """Logits of :func:`probe_tokens` from the trained model, saved by rank 0."""

    def __init__(self, path: str, vocab_size: int) -> None:
        self.path, self.tokens = path, probe_tokens(vocab_size)

    def on_train_end(self, trainer, pl_module) -> None:
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            logits = pl_module(self.tokens.to(pl_module.device))  # (B, T, V)
        if trainer.is_global_zero:
            torch.save(logits.float().cpu(), self.path)
        pl_module.train(was_training)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="result JSON (written by rank 0)")
    parser.add_argument("--logits", default=None, help="save the final logits here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    cfg = compose_config(args.overrides)
    losses = GlobalLoss()
    callbacks: list[L.Callback] = [losses]
    if args.logits:
        callbacks.append(FinalLogits(args.logits, to_run_config(cfg).model.vocab_size))
    result = run(cfg, callbacks=callbacks)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        report = {
            "losses": {str(step): loss for step, loss in sorted(losses.losses.items())},
            "global_step": result.global_step,
            "metrics": result.metrics,
            "output_dir": str(result.output_dir),
            "weights_path": str(result.weights_path) if result.weights_path else None,
            "tokenizer_path": str(result.tokenizer_path) if result.tokenizer_path else None,
            "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
            "world_size": torch.distributed.get_world_size()
            if torch.distributed.is_initialized()
            else 1,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
