from itertools import islice

import pytest

from recipes_lib.data.sampler import ResumableSampler


def take(sampler, n):
    return list(islice(iter(sampler), n))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    stream = take(ResumableSampler(50, seed=3), 150)
    epochs = [stream[i : i + 50] for i in range(0, 150, 50)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))
    assert epochs[0] != epochs[1] != epochs[2]
    assert take(ResumableSampler(50, seed=3), 150) == stream
    assert take(ResumableSampler(50, seed=4), 150) != stream


@pytest.mark.parametrize("start", [1, 37, 50, 121])
def test_resume_equals_the_uninterrupted_tail(start):
    full = take(ResumableSampler(50, seed=0), 300)
    resumed = take(ResumableSampler(50, seed=0, start=start), 300 - start)
    assert resumed == full[start:]


def test_ranks_are_disjoint_and_interleave_to_the_single_rank_stream():
    world = 3
    single = take(ResumableSampler(60, seed=1), 120)
    per_rank = [take(ResumableSampler(60, seed=1, rank=r, world_size=world), 40) for r in range(3)]
    for r in range(world):
        assert per_rank[r] == single[r::world]
    first_epoch = [set(stream[:20]) for stream in per_rank]
    assert set.union(*first_epoch) == set(range(60))
    assert sum(len(s) for s in first_epoch) == 60  # disjoint


def test_rank_resume_equals_rank_tail():
    full = take(ResumableSampler(40, seed=2, rank=1, world_size=4), 60)
    resumed = take(ResumableSampler(40, seed=2, start=25, rank=1, world_size=4), 35)
    assert resumed == full[25:]


def test_length_and_reiteration_continue_the_stream():
    sampler = ResumableSampler(10, seed=0, length=7)
    assert len(sampler) == 7
    assert len(ResumableSampler(10, seed=0, rank=1, world_size=3)) == 3
    full = take(ResumableSampler(10, seed=0), 14)
    assert take(sampler, 7) + take(sampler, 7) == full  # a second epoch does not replay
    assert sampler.state_dict()["position"] == 14
    other = ResumableSampler(10, seed=0)
    other.load_state_dict(sampler.state_dict())
    assert take(other, 5) == take(ResumableSampler(10, seed=0, start=14), 5)


def test_bad_arguments():
    with pytest.raises(ValueError):
        ResumableSampler(0, seed=0)
    with pytest.raises(ValueError):
        ResumableSampler(5, seed=0, rank=2, world_size=2)
