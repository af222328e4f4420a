r"""The long-context memory table of ``docs/long-context.md``, from the launch check's
estimate (:func:`recipes_lib.launch_check.estimate_memory`): per-GPU bytes of one
training step of the long-context recipes and their neighbours, with and without
context parallelism and activation offload. Nothing is measured: it composes each
configuration and adds up the estimate, on any machine, in seconds::

    python benchmarks/long_context_memory.py            # the markdown table
    python benchmarks/long_context_memory.py --out $OUT/long_context_memory.json

Each row is one data-parallel replica: ``strategy.context_parallel`` cards sharing
every row, so the world size is the degree (under ``strategy=fsdp`` the parameters,
gradients and optimizer state are sharded over those cards).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.launch_check import estimate_memory

GIB = 2**30
CARD_GIB = 79.1  # an 80 GB H100's memory as torch reports it: the card rows are judged on
# local files the data keys need to compose; the estimate reads no data
DATA = ("data.sources.main.path=LONG", "data.sources.short.path=SHORT")

# (what the row is, its overrides)
ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cpt/long", ("recipe=cpt/long", *DATA)),
    (
        "cpt/long without offload",
        ("recipe=cpt/long", *DATA, "kernels.activation_offload=false"),
    ),
    (
        "cpt/long with dense masks (sdpa, no document masks)",
        ("recipe=cpt/long", *DATA, "kernels.attention=sdpa", "data.document_mask=false"),
    ),
    (
        "cpt/long on 8 cards",
        ("recipe=cpt/long", *DATA, "strategy.context_parallel=8", "trainer.devices=8"),
    ),
    (
        "cpt/long at 32K on one card",
        (
            "recipe=cpt/long",
            *DATA,
            "data.seq_len=32768",
            "strategy.context_parallel=1",
            "trainer.devices=1",
        ),
    ),
    (
        "cpt/long, llama_1b at 256K",
        (
            "recipe=cpt/long",
            *DATA,
            "model=llama_1b",
            "model.max_seq_len=262144",
            "data.seq_len=262144",
        ),
    ),
    (
        "cpt/long, llama_1b at 256K on 8 cards",
        (
            "recipe=cpt/long",
            *DATA,
            "model=llama_1b",
            "model.max_seq_len=262144",
            "data.seq_len=262144",
            "strategy.context_parallel=8",
            "trainer.devices=8",
        ),
    ),
    (
        "cpt/long, llama_8b (ddp: whole model a rank)",
        ("recipe=cpt/long", *DATA, "model=llama_8b"),
    ),
    (
        "cpt/long, llama_8b under fsdp",
        ("recipe=cpt/long", *DATA, "model=llama_8b", "strategy=fsdp"),
    ),
    ("cpt/long_8b (qwen3_8b, fsdp)", ("recipe=cpt/long_8b", *DATA)),
    (
        "cpt/long_8b without offload",
        ("recipe=cpt/long_8b", *DATA, "kernels.activation_offload=false"),
    ),
    ("sft/long", ("recipe=sft/long",)),
    ("sft/long with LoRA", ("recipe=sft/long", "adapter=lora")),
    (
        "sft/long at 128K on 4 cards",
        (
            "recipe=sft/long",
            "data.seq_len=131072",
            "strategy.context_parallel=4",
            "trainer.devices=4",
        ),
    ),
)


def estimate_rows() -> list[dict]:
    """Each row's configuration and its estimate in GiB."""
    out = []
    for label, overrides in ROWS:
        cfg = to_run_config(compose_config(list(overrides)))
        degree = cfg.strategy.context_parallel
        est = estimate_memory(cfg, world_size=degree)
        sizes = est.as_gib()
        out.append(
            {
                "configuration": label,
                "model": cfg.model.name,
                "seq_len": cfg.data.seq_len,
                "context_parallel": degree,
                "activation_checkpointing": cfg.kernels.activation_checkpointing,
                "activation_offload": cfg.kernels.activation_offload,
                "document_mask": cfg.data.document_mask,
                "adapter": cfg.adapter.kind,
                "estimate_gib": sizes["total"],
                "states_gib": round(
                    float(sizes["parameters"])
                    + float(sizes["gradients"])
                    + float(sizes["optimizer"]),
                    1,
                ),
                "activations_gib": sizes["activations"],
                "buffers_gib": sizes["buffers"],
                "phase": est.phase,
            }
        )
    return out


def markdown(rows: list[dict]) -> str:
    """The table as docs/long-context.md shows it."""
    lines = [
        "| configuration | model | tokens a row | cards (CP) | offload | weights, grads, "
        "optimizer | activations | buffers and masks | per GPU (est.) | fits an 80 GB H100 |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        fits = "yes" if r["estimate_gib"] <= CARD_GIB else "no"
        lines.append(
            f"| {r['configuration']} | {r['model']} | {r['seq_len']:,} | "
            f"{r['context_parallel']} | {'yes' if r['activation_offload'] else 'no'} | "
            f"{r['states_gib']:.1f} | {r['activations_gib']:.1f} | {r['buffers_gib']:.1f} | "
            f"{r['estimate_gib']:.1f} GiB | {fits} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = estimate_rows()
    print(markdown(rows))
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
