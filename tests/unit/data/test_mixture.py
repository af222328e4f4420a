from collections import Counter

import pytest

from recipes_lib.data.mixture import MixtureDataset, smooth_weighted_round_robin
from recipes_lib.errors import ConfigError


class Items:
    """A map-style dataset whose item i is (name, i)."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        assert 0 <= i < self.size
        return (self.name, i)


def test_proportions_follow_weights():
    mixture = MixtureDataset(
        {"web": Items("web", 5000), "code": Items("code", 300), "math": Items("math", 40)},
        {"web": 6.0, "code": 3.0, "math": 1.0},
        length=20_000,
    )
    window = 10_000
    counts = Counter(mixture[j][0] for j in range(window))
    for name, share in (("web", 0.6), ("code", 0.3), ("math", 0.1)):
        assert abs(counts[name] / window - share) < 0.01
    # any stretch of a few hundred items already holds the proportions
    local = Counter(mixture[j][0] for j in range(5000, 5200))
    assert abs(local["math"] - 20) <= 2


def test_default_length_covers_every_item_of_every_source():
    big, small = Items("big", 3000), Items("small", 50)
    mixture = MixtureDataset({"big": big, "small": small}, {"big": 1.0, "small": 1.0})
    seen = {(name, i) for name, i in (mixture[j] for j in range(len(mixture)))}
    assert {("big", i) for i in range(3000)} <= seen  # big is not truncated
    assert {("small", i) for i in range(50)} <= seen  # small is repeated to keep its weight
    assert len(mixture) < 3000 * 2 + 2 * 1024


def test_mapping_is_deterministic_and_explicit_length():
    make = lambda: MixtureDataset(  # noqa: E731
        {"a": Items("a", 7), "b": Items("b", 11)}, {"a": 0.3, "b": 0.7}, length=500
    )
    first, second = make(), make()
    assert len(first) == 500
    assert [first[j] for j in range(500)] == [second[j] for j in range(500)]
    with pytest.raises(IndexError):
        first[500]


def test_smooth_round_robin_spreads_sources():
    order = smooth_weighted_round_robin([5.0, 1.0, 1.0], 7).tolist()
    assert order == [0, 0, 1, 0, 2, 0, 0]


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_weight_names_its_key(weight):
    with pytest.raises(ConfigError, match=r"data\.sources\.code\.weight"):
        MixtureDataset({"web": Items("w", 3), "code": Items("c", 3)}, {"web": 1.0, "code": weight})


def test_vanishing_weight_is_rejected():
    with pytest.raises(ConfigError, match=r"data\.sources\.rare\.weight is too small"):
        MixtureDataset({"big": Items("b", 3), "rare": Items("r", 3)}, {"big": 1.0, "rare": 1e-9})
