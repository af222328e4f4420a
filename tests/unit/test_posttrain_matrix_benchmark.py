"""The post-training matrix without a GPU: its plan covers every objective, data shape
and settings; its file has the declared keys for every side (null with a note where a
side has no figures) and keeps other calls' cells; its table renders."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from matrix_table import matrix_table, matrix_table_from_file  # noqa: E402
from posttrain_matrix import (  # noqa: E402
    DATA,
    FIGURES,
    NO_PEER,
    OBJECTIVES,
    SETTINGS,
    SIDES,
    Cell,
    card_name,
    main,
    merge,
    plan,
    run_queue,
    summarise,
    write_json,
)


def figures(tokens: float, peak: float | None = 10.0) -> dict:
    return {
        "tokens_per_sec": tokens,
        "peak_gib": peak,
        "first_step_s": 30.0,
        "recompiles": 4,
        "recompile_limit_hits": 0,
    }


def test_the_plan_has_every_cell_and_every_side_of_it():
    cells, jobs = plan()
    expected = {(o, d, s) for o in OBJECTIVES for d in DATA for s in SETTINGS}
    assert {(c.objective, c.data, c.settings) for c in cells} == expected
    assert len(cells) == len(expected) == 11 * 3 * 2
    assert {(j.cell, j.side) for j in jobs} == {
        (c, side) for c in cells for side in SIDES if (side, c.objective) not in NO_PEER
    }
    assert ("trl_liger", "reward") in NO_PEER  # TRL's reward trainer fails with Liger
    assert [j.seconds for j in jobs] == sorted((j.seconds for j in jobs), reverse=True)
    _, repeated = plan(["kto"], ["short"], ["matched"], ["ours"], repeats=3)
    assert sorted(j.repeat for j in repeated) == [0, 1, 2]


def test_the_dry_run_prints_the_selected_cells(capsys):
    assert main(["--dry-run", "--objectives", "sft_full,grpo", "--data", "heavy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:-1] == [
        "sft_full.heavy.defaults",
        "sft_full.heavy.matched",
        "grpo.heavy.defaults",
        "grpo.heavy.matched",
    ]
    assert lines[-1].startswith("4 cells, 12 side processes")


def test_the_file_has_the_declared_keys_for_every_side(tmp_path):
    cell = Cell("dpo_live", "long", "matched")
    runs = {
        "ours": [figures(20_000.0)],
        "trl": [{"error": "OutOfMemoryError: CUDA out of memory"}],
        "trl_liger": [{"skipped": "not installed: No module named 'liger_kernel'"}],
    }
    entry = summarise(cell, runs)
    assert set(entry) == {"objective", "data", "settings", *SIDES, "notes"}
    assert set(entry["ours"]) == set(FIGURES)
    assert entry["trl"] is None and entry["trl_liger"] is None
    assert any("OutOfMemoryError" in note for note in entry["notes"])
    assert any("liger_kernel" in note for note in entry["notes"])

    path = tmp_path / "posttrain_matrix_h100.json"
    write_json(path, merge(path, "h100", "first", [entry]))
    other = summarise(Cell("sft_full", "short", "defaults"), {s: [figures(9.0)] for s in SIDES})
    write_json(path, merge(path, "h100", "second", [other]))
    result = json.loads(path.read_text())
    assert set(result) == {"card", "date", "command", "cases"}
    assert result["card"] == "h100" and result["command"] == "second"  # the latest call's
    assert [(c["objective"], c["data"], c["command"]) for c in result["cases"]] == [
        ("sft_full", "short", "second"),
        ("dpo_live", "long", "first"),  # each cell: the call that measured it
    ]
    for case in result["cases"]:
        for side in SIDES:
            assert case[side] is None or set(case[side]) == set(FIGURES)


def test_a_cell_run_with_overrides_is_kept_beside_the_plain_one(tmp_path):
    path = tmp_path / "posttrain_matrix_h200.json"
    cell = Cell("sft_full", "long", "defaults")
    plain = summarise(cell, {s: [figures(9.0)] for s in SIDES})
    fitted = summarise(
        cell, {s: [figures(7.0)] for s in SIDES}, overrides=["run.memory_budget_gib=16.2"]
    )
    assert fitted["settings"] == "defaults, run.memory_budget_gib=16.2"
    write_json(path, merge(path, "h200", "plain", [plain]))
    by_hand = {**json.loads(path.read_text()), "notes": ["what the budgets are"]}
    path.write_text(json.dumps(by_hand))
    write_json(path, merge(path, "h200", "fitted", [fitted]))
    result = json.loads(path.read_text())
    assert result["notes"] == ["what the budgets are"]  # a note by hand stays
    cases = result["cases"]
    assert sorted(c["settings"] for c in cases) == [
        "defaults",
        "defaults, run.memory_budget_gib=16.2",
    ]


def test_repeats_report_the_mean_and_the_spread():
    runs = {side: [figures(100.0), figures(300.0, None)] for side in SIDES}
    entry = summarise(Cell("kto", "short", "defaults"), runs)
    assert entry["ours"]["tokens_per_sec"] == 200.0 and entry["ours"]["peak_gib"] == 10.0
    assert entry["repeats"] == 2
    assert entry["spread"]["trl"]["tokens_per_sec"] == [100.0, 300.0]


def test_the_table_renders_a_small_matrix(tmp_path):
    both = summarise(
        Cell("orpo", "heavy", "matched"),
        {"ours": [figures(3000.0)], "trl": [figures(1500.0)], "trl_liger": [figures(1000.0)]},
    )
    lacking = summarise(Cell("grpo", "short", "defaults"), {"ours": [figures(50.0)]})
    result = {"card": "h200", "date": "2026-01-01", "command": "x", "cases": [both, lacking]}
    table = matrix_table(result)
    lines = table.splitlines()
    assert lines[0].startswith("Card: H200, 2026-01-01")
    header = next(i for i, line in enumerate(lines) if line.startswith("| objective"))
    assert lines[header + 1].count("---") == lines[header].count("|") - 1
    row = lines[header + 2]
    assert row.startswith("| orpo | heavy | matched | 3,000 | 1,500 | 1,000 | 3.00x |")
    assert "10.00 / 10.00 / 10.00" in row
    assert lines[header + 3].startswith("| grpo | short | defaults | 50 | - | - | - |")
    assert "- grpo / short / defaults: trl: no figures" in table
    path = tmp_path / "m.json"
    path.write_text(json.dumps(result))
    assert matrix_table_from_file(path) == table


def test_card_names():
    assert card_name("NVIDIA H100 80GB HBM3") == "h100"
    assert card_name("NVIDIA H200") == "h200"
    assert card_name("Some Card 9") == "somecard9"


def test_each_cell_is_handed_over_as_soon_as_its_sides_are_done(monkeypatch, tmp_path):
    """A call cut short keeps what it finished: the queue hands each cell over once,
    with every side's report, the moment its last side ends; a side that the budget
    held back counts as ended."""
    import posttrain_matrix

    order: list[str] = []

    def fake_spawn(args, cell, side, root, script, *, gpus, tag, log):
        order.append(tag)
        return figures(100.0)

    monkeypatch.setattr(posttrain_matrix, "spawn", fake_spawn)
    _, jobs = plan(["kto", "reward"], ["short"], ["defaults"], ["ours", "trl_liger"])
    handed: list[tuple[str, list[str], int]] = []

    def on_cell(cell, results):  # with how many sides had been spawned by then
        handed.append((cell.name, sorted(job.side for job in results), len(order)))

    class Args:
        budget_s = 0

    results = run_queue(Args(), jobs, tmp_path, [None], on_cell=on_cell)
    assert sorted(name_sides for *name_sides, _ in handed) == [
        ["kto.short.defaults", ["ours", "trl_liger"]],
        ["reward.short.defaults", ["ours"]],  # no TRL+Liger side: NO_PEER
    ]
    assert handed[0][2] < len(jobs) == 3  # the first cell before the queue's last side
    assert len(results) == 3


def test_many_gpus_hand_over_every_cell_once(monkeypatch, tmp_path):
    """Four threads drain one queue while cells are handed over: every cell once,
    with all its sides (the reports go in under the lock the hand-over reads under)."""
    import posttrain_matrix

    def fake_spawn(args, cell, side, root, script, *, gpus, tag, log):
        return figures(100.0)

    monkeypatch.setattr(posttrain_matrix, "spawn", fake_spawn)
    _, jobs = plan(list(OBJECTIVES), list(DATA), ["defaults"], ["ours", "trl_liger"], repeats=20)
    handed: list[tuple[str, int]] = []

    def on_cell(cell, results):
        handed.append((cell.name, len(list(results.items()))))

    class Args:
        budget_s = 0

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: inside a copy of the results too
    try:
        for _ in range(5):
            handed.clear()
            run_queue(Args(), jobs, tmp_path, ["0", "1", "2", "3"], on_cell=on_cell)
    finally:
        sys.setswitchinterval(switch)
    expected = collections.Counter(job.cell.name for job in jobs)
    assert sorted(handed) == sorted(expected.items())


def test_a_graph_compiled_in_the_timed_steps_is_named_in_the_cell():
    """A batch of a new shape inside the timed steps compiles there: the figure then
    holds compile time, and the cell says so."""
    from _peer import figures as step_figures

    report = step_figures([1.0, 2.0, 3.0, 13.0], [100] * 4, 1, 0.0, graphs=[4, 6, 6, 7])
    assert report["graphs_in_timed_steps"] == 1  # 6 at the warmup's end, 7 at the last
    slow = {**figures(20.0), "graphs_in_timed_steps": 1}
    entry = summarise(Cell("simpo", "heavy", "defaults"), {"ours": [slow]}, ["ours"])
    assert "ours: 1 graph(s) compiled during the timed steps" in entry["notes"]
    quiet = summarise(Cell("simpo", "heavy", "defaults"), {"ours": [figures(9.0)]}, ["ours"])
    assert not any("timed steps" in n for n in quiet["notes"])


def test_the_start_time_file_keeps_other_calls_cases_with_their_dates(tmp_path):
    from start_time import merged

    path = tmp_path / "start_time_h200.json"
    path.write_text(
        json.dumps(
            {
                "card": "h200",
                "date": "2026-11-28",
                "command": "old",
                "notes": ["kept"],
                "cases": [
                    {"objective": "dpo_live", "data": "heavy", "cold": {"first_step_s": 55.2}},
                    {"objective": "sft_lora", "data": "long", "cold": {"first_step_s": 50.2}},
                ],
            }
        )
    )
    new = [
        {
            "objective": "sft_lora",
            "data": "long",
            "date": "2026-11-29",
            "command": "new",
            "cold": {"first_step_s": 45.8},
        }
    ]
    result = merged(path, "h200", new)
    assert result["date"] == "2026-11-29" and result["notes"] == ["kept"]
    kept, replaced = result["cases"]
    assert (kept["objective"], kept["date"], kept["command"]) == ("dpo_live", "2026-11-28", "old")
    assert kept["cold"] == {"first_step_s": 55.2}
    assert replaced == new[0]  # the earlier sft_lora case is gone, not kept beside it
    assert merged(tmp_path / "none.json", "h200", new)["cases"] == new
    # another card's file keeps nothing; a failed or profiled case replaces nothing
    assert merged(path, "h100", new)["cases"] == new
    for bad in ({"error": "status 1"}, {"first_step_s": 80.0, "profiled": True}):
        case = {**new[0], "cold": bad}
        result = merged(path, "h200", [case])
        firsts = [c["cold"]["first_step_s"] for c in result["cases"]]
        assert firsts == [55.2, 50.2]
        assert result["not_kept"] == [case]


def test_the_start_times_variants_of_ours_run_right_after_it_with_their_own_names():
    from start_time import _file_safe, parse_variants, run_order

    variants, rest = parse_variants(
        [
            "--objectives",
            "sft_lora",
            "--variant",
            "kernels.attention_global=flex",
            "--sides",
            "ours,trl_liger",
            "--variant",
            "data.batch_size=2",
        ]
    )
    assert variants == ["kernels.attention_global=flex", "data.batch_size=2"]
    assert rest == ["--objectives", "sft_lora", "--sides", "ours,trl_liger"]
    assert run_order(["ours", "trl_liger"], variants) == [
        ("ours", None),
        ("ours", "kernels.attention_global=flex"),
        ("ours", "data.batch_size=2"),
        ("trl_liger", None),
    ]
    assert run_order(["trl_liger"], variants[:1]) == [
        ("ours", "kernels.attention_global=flex"),
        ("trl_liger", None),
    ]
    # a run folder's name: no character a Hydra override would read as syntax
    assert _file_safe("kernels.attention_global=flex") == "kernels.attention_global_flex"


def test_the_start_time_file_holds_each_side_as_soon_as_it_finishes(tmp_path):
    from start_time import CaseFile

    path = tmp_path / "start_time_h200.json"
    earlier = {"objective": "dpo_live", "data": "heavy", "cold": {"first_step_s": 55.2}}
    path.write_text(json.dumps({"card": "h200", "date": "2026-11-28", "cases": [earlier]}))
    record = CaseFile(path, "h200", "2026-11-29", "start_time.py --sides ours,trl_liger")
    case = {"objective": "sft_lora", "data": "long", "cold": {"first_step_s": 42.6}}
    record.put(0, case)  # ours done; the peer still to run (or cut off by the call's limit)
    written = json.loads(path.read_text())
    assert [c["objective"] for c in written["cases"]] == ["dpo_live", "sft_lora"]
    assert written["cases"][1]["command"] == "start_time.py --sides ours,trl_liger"
    record.put(0, {**case, "trl_liger_cold": {"first_step_s": 28.1}})
    written = json.loads(path.read_text())
    assert len(written["cases"]) == 2  # the same case, now with its peer
    assert written["cases"][1]["trl_liger_cold"] == {"first_step_s": 28.1}
    assert written["cases"][0]["cold"] == {"first_step_s": 55.2}


def test_a_start_run_past_its_time_is_stopped_and_named(monkeypatch, tmp_path):
    import subprocess

    import start_time

    def past(command, **kwargs):
        kwargs["stdout"].write("compiling block 3\n")
        kwargs["stdout"].flush()
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(start_time.subprocess, "run", past)
    args = argparse.Namespace(argv=[], side_timeout=7)
    report = start_time.one_run(
        args, Cell("sft_lora", "long", "defaults"), tmp_path, tmp_path, None, "cold"
    )
    assert report == {"error": "past --side-timeout=7 s: compiling block 3"}


def test_repeated_start_rounds_alternate_the_order_and_report_the_spread():
    from start_time import rounds, summary

    order = [("ours", None), ("ours", "kernels.attention_global=flex"), ("trl_liger", None)]
    ran = rounds(order, 3)
    assert [job for r, job in ran if r == 0] == order
    assert [job for r, job in ran if r == 1] == order[::-1]  # first becomes last
    assert [job for r, job in ran if r == 2] == order
    one = {"first_step_s": 42.6, "start": {"import": 12.0}}
    assert summary([one]) == one  # one round: the run as it came
    runs = [
        {"first_step_s": 49.3, "start": {"import": 14.0, "compile": 16.0}},
        {"error": "status 1: CUDA error"},
        {"first_step_s": 38.5, "start": {"import": 12.0, "compile": 12.0}},
    ]
    figure = summary(runs)
    assert figure["first_step_s"] == 43.9 and figure["spread"] == [38.5, 49.3]
    assert figure["runs"] == [49.3, None, 38.5]
    assert figure["start"] == {"import": 13.0, "compile": 14.0}
    assert summary([{"error": "a"}, {"error": "b"}]) == {"error": "b", "runs": [None, None]}
