"""Train on your own text files: a folder of .txt (or .jsonl / .parquet) files.

python examples/train_on_my_files.py path/to/folder [overrides...]
"""

from __future__ import annotations

import sys

from recipes_lib import compose_config, run


def main(folder: str, overrides: list[str]) -> None:
    cfg = compose_config(
        [
            "recipe=pretrain/tiny",
            "data=local_text",
            f"data.sources.main.path={folder}",
            "data.seq_len=256",
            "model.vocab_size=4096",
            "data.tokenizer.vocab_size=4096",
            "run.name=my-files",
            *overrides,
        ]
    )
    result = run(cfg)
    print(f"checkpoint: {result.last_checkpoint}  metrics: {result.metrics}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
