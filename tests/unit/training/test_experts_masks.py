"""Which tokens of a batch a mixture of experts' balance loss and load count: every
objective's batches mark their padding, and it is left out."""

from __future__ import annotations

import torch
from tiny import tiny_model_config

from recipes_lib.data.chat.packing import pad_collate
from recipes_lib.data.preference.collate import collate_pairs
from recipes_lib.training.experts import ExpertLoad, up_to_last_label

MOE = dict(family="qwen3_moe", qk_norm="head", moe_experts=4, moe_top_k=2, moe_ffn_dim=16)


def _load(**model) -> ExpertLoad:
    return ExpertLoad(tiny_model_config(**model))


def test_chat_rows_count_their_examples_and_not_their_padding():
    batch = pad_collate(0)(
        [
            {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
            {"input_ids": torch.tensor([5]), "labels": torch.tensor([5])},
        ]
    )
    mask = _load(**MOE).token_mask(batch)
    assert mask.tolist() == [[True, True, True], [True, False, False]]
    assert _load().token_mask(batch) is None  # a dense model has nothing to count


def test_pair_rows_count_both_sequences_and_not_their_padding():
    def pair(chosen: list[int], rejected: list[int], index: int) -> dict:
        return {
            "chosen_ids": torch.tensor(chosen),
            "chosen_mask": torch.tensor([False] + [True] * (len(chosen) - 1)),
            "rejected_ids": torch.tensor(rejected),
            "rejected_mask": torch.tensor([False] + [True] * (len(rejected) - 1)),
            "index": index,
        }

    batch = collate_pairs([pair([1, 2, 3, 4], [1, 5], 0)], pad_id=0)
    assert _load(**MOE).token_mask(batch).tolist() == [[True] * 3, [True, False, False]]


def test_grpo_rows_end_at_their_last_label():
    labels = torch.tensor([[-100, 4, 5, -100, -100], [-100, -100, 7, -100, -100]])
    assert up_to_last_label(labels).tolist() == [
        [True, True, True, False, False],
        [True, True, True, False, False],
    ]


def test_a_training_step_counts_the_real_tokens_of_a_padded_batch():
    from recipes_lib.config.schema import KernelsConfig, OptimConfig, SchedulerConfig
    from recipes_lib.training import CausalLMModule

    module = CausalLMModule(
        tiny_model_config(**MOE),
        KernelsConfig(),
        OptimConfig(lr=1e-3),
        SchedulerConfig(name="constant", warmup=0),
        total_steps=1,
        tokens_per_step=8,
    )
    module.configure_model()
    batch = pad_collate(0)(
        [
            {"input_ids": torch.arange(1, 8), "labels": torch.arange(2, 9)},
            {"input_ids": torch.tensor([3, 4]), "labels": torch.tensor([4, 5])},
        ]
    )
    module.compute_loss(batch)
    module.expert_load.after_forward(module.model)
    per_layer = module.expert_load.counts.sum(-1)
    assert per_layer.tolist() == [9 * 2] * len(per_layer)  # 9 real tokens, 2 experts each
