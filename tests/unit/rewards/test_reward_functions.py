"""The built-in reward functions and the registry that builds a run's rewards."""

from __future__ import annotations

import time

import pytest
import torch

from recipes_lib.errors import ConfigError, RewardError
from recipes_lib.rewards import (
    Reward,
    build_rewards,
    defines_function,
    exact_match,
    format_match,
    function_header,
    python_syntax,
    score_completions,
    unit_tests,
)

RECORD = {
    "answer": "42",
    "name": "double",
    "tests": "assert double(2) == 4\nassert double(-1) == -2",
}


def test_exact_match_and_format():
    assert exact_match(" 42 \n", RECORD) == 1.0
    assert exact_match("41", RECORD) == 0.0
    assert exact_match("so the answer is 42.", RECORD, extract=r"answer is (\d+)") == 1.0
    assert exact_match("no number", RECORD, extract=r"answer is (\d+)") == 0.0
    assert format_match("<answer>7</answer>", RECORD, pattern=r"<answer>\d+</answer>") == 1.0
    assert format_match("7", RECORD, pattern=r"<answer>\d+</answer>") == 0.0


def test_python_checks():
    good = "def double(x):\n    return 2 * x\n"
    assert python_syntax(good, RECORD) == 1.0 and defines_function(good, RECORD) == 1.0
    assert python_syntax("def double(x):\n    return (", RECORD) == 0.0
    assert python_syntax("  \n", RECORD) == 0.0  # no statement: no answer
    assert defines_function("def triple(x):\n    return 3 * x\n", RECORD, field=None) == 1.0
    assert defines_function("def triple(x):\n    return 3 * x\n", RECORD) == 0.0
    assert function_header("def double(x):\n    return (", RECORD) == 1.0  # the line alone
    assert function_header("def double(x, :\n    pass", RECORD) == 0.0
    assert function_header("x = 1", RECORD) == 0.0
    body = "    return 2 * x\n"
    assert python_syntax(body, {"head": "def double(x):\n"}, prefix_field="head") == 1.0


def test_unit_tests_run_apart_and_time_out():
    good = "def double(x):\n    return 2 * x\n"
    assert unit_tests(good, RECORD) == 1.0
    assert unit_tests("def double(x):\n    return x + 2\n", RECORD) == 0.0  # fails a test
    assert unit_tests("def double(x) return", RECORD) == 0.0  # not Python
    # the process cannot touch the trainer's state: its own interpreter, its own folder
    escape = "import sys\nsys.modules.clear()\ndef double(x):\n    return 2 * x\n"
    assert unit_tests(escape, RECORD) == 1.0
    # leaving early with status 0 is not passing the tests
    assert unit_tests("import os\nos._exit(0)\n", RECORD) == 0.0
    assert unit_tests("raise SystemExit(0)\n", RECORD) == 0.0
    assert python_syntax("x = " + "-" * 5000 + "1", RECORD) == 0.0  # too deep to parse
    started = time.monotonic()
    assert unit_tests("while True:\n    pass\n", RECORD, timeout=1.0) == 0.0
    assert time.monotonic() - started < 10


def test_unit_tests_end_everything_their_process_started(tmp_path):
    marker = tmp_path / "escaped"
    late = f"import time; time.sleep(1.5); open({str(marker)!r}, 'w').write('x')"
    program = (
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {late!r}])\n"
        "time.sleep(5)\n"
    )
    assert unit_tests(program, RECORD, timeout=0.5) == 0.0
    time.sleep(2.0)
    assert not marker.exists()


def rewards(**nodes):
    return build_rewards(nodes)


def test_the_registry_weights_builtins_and_names_bad_ones():
    built = rewards(
        answer={"weight": 1.0, "fn": {"_target_": "recipes_lib.rewards.exact_match"}},
        shape={
            "weight": 0.5,
            "fn": {"_target_": "recipes_lib.rewards.format_match", "pattern": r"\d+"},
        },
    )
    total, each = score_completions(built, ["42", "x"], [RECORD, RECORD], ["a:1", "a:2"])
    assert torch.equal(total, torch.tensor([1.5, 0.0]))
    assert torch.equal(each["shape"], torch.tensor([1.0, 0.0]))
    with pytest.raises(ConfigError, match=r"grpo\.rewards\.answer\.fn\.colour: not an argument"):
        rewards(answer={"fn": {"_target_": "recipes_lib.rewards.exact_match", "colour": 1}})
    with pytest.raises(ConfigError, match=r"os\.system. is not a reward function"):
        rewards(answer={"fn": {"_target_": "os.system"}})
    helper = "recipes_lib.rewards.functions._kill_group"  # of the package, not a reward
    with pytest.raises(ConfigError, match=r"_kill_group. is not a reward function"):
        rewards(answer={"fn": {"_target_": helper}})
    with pytest.raises(ConfigError, match=r"grpo\.rewards\.answer\.weight='high'"):
        rewards(answer={"weight": "high", "fn": {"_target_": "recipes_lib.rewards.exact_match"}})
    with pytest.raises(ConfigError, match="unknown key 'wieght'"):
        rewards(answer={"wieght": 1, "fn": {"_target_": "recipes_lib.rewards.exact_match"}})
    with pytest.raises(ConfigError, match="empty"):
        rewards()


def test_a_reward_that_raises_or_returns_a_non_number_is_named_with_its_record():
    built = rewards(answer={"fn": {"_target_": "recipes_lib.rewards.exact_match", "field": "x"}})
    with pytest.raises(
        RewardError, match=r"grpo\.rewards\.answer raised KeyError: 'x' \(p\.jsonl:3\)"
    ):
        score_completions(built, ["42"], [RECORD], ["p.jsonl:3"])
    built = rewards(answer={"fn": {"_target_": "recipes_lib.rewards.format_match", "pattern": "("}})
    with pytest.raises(RewardError, match=r"grpo\.rewards\.answer raised error"):
        score_completions(built, ["42"], [RECORD], ["p.jsonl:1"])
    not_a_number = [Reward("odd", lambda c, r: "yes", 1.0)]
    with pytest.raises(
        RewardError, match=r"grpo\.rewards\.odd returned 'yes', not a finite number"
    ):
        score_completions(not_a_number, ["42"], [RECORD], ["p.jsonl:1"])
