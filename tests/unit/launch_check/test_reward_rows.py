"""A reward model's batch is preference pairs, two sequences each (chosen and rejected,
scored in one pass): the launch check counts its rows, tokens and activations as those
of DPO without a reference."""

from __future__ import annotations

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.launch_check.budget import token_budget
from recipes_lib.launch_check.memory import estimate_memory, rows_per_micro_batch

PAIRS = ("model=tiny", "trainer.accelerator=cpu", "data=stdlib_dpo", "data.batch_size=4")


def test_a_reward_batch_counts_its_rows_as_dpo_without_a_reference():
    reward = to_run_config(compose_config([*PAIRS, "stage=reward", "model.head=score"]))
    dpo = to_run_config(
        compose_config([*PAIRS, "stage=dpo", "stage.dpo.precompute_reference=true"])
    )
    assert rows_per_micro_batch(reward) == rows_per_micro_batch(dpo) == 8  # 4 pairs
    assert token_budget(reward).tokens_per_step == token_budget(dpo).tokens_per_step
    assert estimate_memory(reward, 1).activations == estimate_memory(dpo, 1).activations
