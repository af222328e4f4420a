"""The generated benchmark results page reads a file's card and names each listed case."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "gen"))

from benchmark_tables import _section  # noqa: E402


def test_a_file_of_listed_cases_gets_its_card_and_a_row_per_case(tmp_path):
    path = tmp_path / "start_time_h200.json"
    cases = [
        {"objective": "sft_lora", "data": "long", "cold": {"first_step_s": 45.8}},
        {"objective": "dpo_live", "data": "heavy", "warm": {"first_step_s": 28.9}},
    ]
    steps = [{"tokens_per_sec": 1.0}, {"tokens_per_sec": 2.0}]  # a series, not cases
    path.write_text(
        json.dumps({"card": "h200", "date": "2026-11-29", "cases": cases, "steps": steps})
    )
    lines = _section(path)
    assert "- card: h200" in lines
    assert "| sft_lora long / cold | 45.8 |" in lines
    assert "| dpo_live heavy / warm | 28.9 |" in lines
    assert not any("steps" in line for line in lines)
