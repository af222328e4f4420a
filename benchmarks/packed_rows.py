r"""How much of a packed preference batch is real tokens, on data of several shapes.

Compiled blocks take packed pairs in rows of one width for the whole run (the blocks
keep one graph; only the number of rows varies). This measures, on the post-training
matrix's synthetic pairs (``_peer.synthetic_records``: ``short``, ``long``, ``heavy``),
the share of the computed positions (rows x width, summed over the batches of one pass)
that are real tokens, at two widths:

- ``seq_len``: rows ``data.seq_len`` wide, as the compiled path packed them before;
- ``packed_width``: rows as wide as the data's longest sequence, rounded up to 128
  (:meth:`~recipes_lib.data.preference.module.PreferenceDataModule.packed_width`).

Every position costs the blocks' matmuls whether it holds a token or padding, so the
ratio of the two fills is the step's compute on the same pairs. CPU only (data, no
model): the data module of ``recipe=dpo/full`` as a run builds it::

    python benchmarks/packed_rows.py --out benchmarks/results/packed_rows_cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit  # noqa: E402
from _peer import make_folder, synthetic_records, write_records  # noqa: E402

SHAPES = ("short", "long", "heavy")


def fill(shape: str, args: argparse.Namespace, root: Path) -> dict:
    """The pairs of ``shape`` through ``dpo/full``'s data module at both widths."""
    from recipes_lib.checkpoint.source import fill_model_from_init
    from recipes_lib.config import compose_config, to_run_config
    from recipes_lib.data.preference.module import PreferenceDataModule
    from recipes_lib.objectives import build_data

    records = synthetic_records(shape, args.pairs, args.seq_len, args.seed)
    folder = make_folder(
        root / shape / "model",
        [r[k] for r in records for k in ("prompt", "response", "rejected")],
        model="llama_1b",
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        seed=args.seed,
        smoke=True,  # the tokenizer is what matters; the model is never run
    )
    write_records("pairs", root / shape / "pairs.jsonl", records)
    overrides = [
        "recipe=dpo/full",
        f"stage.init_from={folder}",
        f"data.path={root / shape / 'pairs.jsonl'}",
        f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch_size}",
        "data.val_fraction=0",
        f"data.cache_dir={root / shape / 'cache'}",
        "kernels.compile=true",
    ]
    cfg = to_run_config(fill_model_from_init(compose_config(overrides)))
    module = build_data(cfg, total_train_samples=args.pairs)
    module.prepare_data()
    module.setup("fit")
    result: dict = {"pairs": len(module.train_dataset), "batch_size": args.batch_size}
    widths = {"seq_len": args.seq_len, "packed_width": module.packed_width()}
    for name, width in widths.items():
        real = computed = rows = 0
        with mock.patch.object(PreferenceDataModule, "packed_width", return_value=width):
            loader = module.train_dataloader()  # a stream: one pass is its length
            for batch in itertools.islice(loader, len(loader)):
                for micro in batch if isinstance(batch, list) else [batch]:
                    real += int(micro["num_tokens"])
                    computed += micro["input_ids"].numel()
                    rows += micro["input_ids"].shape[0]
        result[name] = {
            "width": width,
            "real_fraction": round(real / computed, 4),
            "rows": rows,
            "computed_positions": computed,
            "real_tokens": real,
        }
    result["compute_ratio"] = round(
        result["packed_width"]["computed_positions"] / result["seq_len"]["computed_positions"], 4
    )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--pairs", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8, help="pairs a micro-batch (dpo/full's)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="40 pairs, a small vocabulary")
    args = p.parse_args(argv)
    if args.smoke:
        args.pairs, args.vocab_size = 40, 2048
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/packed_rows.py " + " ".join(argv or sys.argv[1:])
    result: dict = {"device": "cpu", "command": command.strip(), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="packed-rows-") as tmp:
        for shape in args.shapes.split(","):
            result["cases"][shape] = fill(shape, args, Path(tmp))
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
