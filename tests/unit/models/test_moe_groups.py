"""The sigmoid router's group limit and routed scale (DeepSeek-V3's), as documented: a
token's experts come from its best groups (each scored by its two best biased scores),
the bias only chooses, and the chosen weights are renormalised then scaled."""

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.errors import ConfigError
from recipes_lib.models.blocks import FeedForward
from recipes_lib.models.moe import MoEFeedForward, check_moe


def _router(**changes):
    config = tiny_model_config(
        family="qwen3_moe",
        qk_norm="head",
        moe_experts=8,
        moe_top_k=2,
        moe_router="sigmoid",
        moe_groups=4,
        moe_top_groups=2,
        moe_routed_scale=2.5,
        **changes,
    )
    return MoEFeedForward(config, FeedForward)


def test_the_experts_come_from_the_best_groups_and_the_weights_are_scaled():
    layer = _router()
    # scores (before the sigmoid) of one token: groups {0,1} {2,3} {4,5} {6,7}
    logits = torch.tensor([[3.0, -9.0, 1.0, 1.0, 2.5, -9.0, 0.0, 0.0]])
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    layer._logits = lambda x: logits  # type: ignore[method-assign]
    _, chosen, weights, _ = layer.route(torch.zeros(1, 32))
    scores = torch.sigmoid(logits)
    # group scores: 0: s(3)+s(-9), 1: 2 s(1), 2: s(2.5)+s(-9), 3: 2 s(0): groups 1 and 3
    # beat the groups holding the two best experts, 0 and 4
    assert sorted(chosen[0].tolist()) == [2, 3]
    want = scores[0, [2, 3]] / scores[0, [2, 3]].sum() * 2.5
    torch.testing.assert_close(weights[0].sort().values, want.sort().values)
    # the bias moves the choice, not the weights: group 0 now wins with expert 0
    with torch.no_grad():
        layer.expert_bias[1] = 2.0
    _, chosen, weights, _ = layer.route(torch.zeros(1, 32))
    assert 0 in chosen[0].tolist() and 1 in chosen[0].tolist()
    picked = scores[0, chosen[0]]
    torch.testing.assert_close(weights[0], picked / picked.sum() * 2.5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"moe_groups": 3}, "must split model.moe_experts=8 into equal groups"),
        ({"moe_groups": 8}, "groups of at least two"),
        ({"moe_top_groups": 5}, "model.moe_top_groups=5 must be at most"),
        ({"moe_top_groups": 1, "moe_top_k": 3}, "hold model.moe_top_k=3 experts"),
        ({"moe_router": "softmax"}, "model.moe_router=softmax has no group limit"),
        ({"moe_routed_scale": 0.0}, "model.moe_routed_scale=0.0 must be positive"),
    ],
)
def test_a_group_limit_that_cannot_apply_is_refused_in_one_line(changes, message):
    options = dict(moe_experts=8, moe_top_k=2, moe_router="sigmoid", moe_groups=4, moe_top_groups=2)
    config = tiny_model_config(**{**options, **changes})
    with pytest.raises(ConfigError, match=message) as err:
        check_moe(config)
    assert "\n" not in str(err.value)
