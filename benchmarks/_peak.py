"""What is alive at the CUDA memory peak of a run, by where it was allocated.

``record()`` starts PyTorch's allocation history; ``peak_breakdown()`` replays it to the
moment of the highest allocated total and groups the blocks alive then by the first
frames of their allocation stack that are not PyTorch's own, largest first. Blocks
allocated before ``record()`` are not in the history: call it before the model is
built.
"""

from __future__ import annotations

from collections import defaultdict

import torch

SKIP = ("torch/", "lightning/", "<frozen", "contextlib", "threading")


def record(max_entries: int = 500_000) -> None:
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=max_entries)


def _where(frames: list[dict], depth: int = 3) -> str:
    python = [f for f in frames if f["filename"].endswith(".py")]
    mine = [f for f in python if not any(s in f["filename"] for s in SKIP)]
    chosen = mine[:depth] or python[:depth] or frames[:depth]
    return " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in chosen)


def peak_breakdown(top: int = 15) -> dict:
    """The peak allocated total (GiB, of what the history saw) and its largest groups."""
    snapshot = torch.cuda.memory._snapshot()
    events = [e for trace in snapshot["device_traces"] for e in trace]
    total = peak = peak_at = 0
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            total += event["size"]
        elif event["action"] == "free_completed":
            total -= event["size"]
        if total > peak:
            peak, peak_at = total, i
    live: dict[int, dict] = {}
    for event in events[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    groups: dict[str, int] = defaultdict(int)
    for event in live.values():
        groups[_where(event.get("frames", []))] += event["size"]
    largest = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    return {
        "peak_seen_gib": round(peak / 2**30, 3),
        "at_event": peak_at,
        "of_events": len(events),
        "groups_gib": {where: round(size / 2**30, 3) for where, size in largest},
    }
