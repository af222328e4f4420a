"""An objective declared from outside the library keeps its name: the built-in objectives
are imported on first use, and one of the same name never replaces it afterwards (in a
fresh interpreter, where the built-ins are not yet imported)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    from recipes_lib.objectives.registry import ObjectiveSpec, get_objective, register_objective

    mine = ObjectiveSpec(name="sft", module=dict, data=dict, batch="mine", loss="mine")
    register_objective(mine)
    assert get_objective("sft").loss == "mine", get_objective("sft").loss
    assert get_objective("dpo").name == "dpo"  # the other built-ins are there
    print("kept")
    """
)


def test_a_users_objective_is_not_replaced_by_a_built_in_of_its_name():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "kept" in proc.stdout, proc.stderr[-2000:]
