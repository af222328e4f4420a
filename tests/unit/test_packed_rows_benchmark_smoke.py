"""The packed-rows benchmark runs on CPU (``--smoke``): on heavy-tailed pairs, rows as
wide as the data's longest sequence compute fewer positions than ``data.seq_len``-wide
ones, for the same real tokens."""

from __future__ import annotations

from run_helpers import benchmark_smoke


def test_packed_rows_smoke_measures_both_widths(tmp_path):
    figures = benchmark_smoke("packed_rows.py", tmp_path / "rows.json", "--shapes", "heavy")
    case = figures["cases"]["heavy"]
    wide, narrow = case["seq_len"], case["packed_width"]
    assert wide["width"] == 2048 and narrow["width"] < 2048 and narrow["width"] % 128 == 0
    assert narrow["real_tokens"] == wide["real_tokens"] > 0
    assert narrow["computed_positions"] < wide["computed_positions"]
    assert case["compute_ratio"] < 1
