from collections import Counter

import numpy as np
import pytest
from hypothesis import given, strategies as st

from megatron_mm_balance.data import mixtures
from megatron_mm_balance.data.packing import OverlongSampleError, pack_budget, pack_greedy
from megatron_mm_balance.data.traces import Sample

samples_st = st.lists(
    st.builds(lambda t, imgs: Sample(t + sum(imgs), tuple(imgs)),
              st.integers(0, 600), st.lists(st.integers(0, 300), max_size=4)),
    min_size=0, max_size=120)


@given(samples_st, st.integers(64, 1500), st.integers(1, 40))
def test_every_sample_exactly_once_whole_and_within_length(samples, seq_len, buf):
    res = pack_greedy(samples, seq_len, buffer_size=buf)
    placed = Counter(i for p in res.packs for i in p.samples)
    expected = {i for i, s in enumerate(samples) if s.tokens <= seq_len}
    assert set(placed) == expected and all(v == 1 for v in placed.values())
    assert sorted(res.dropped) == sorted(set(range(len(samples))) - expected)
    for p in res.packs:
        assert p.tokens <= seq_len
        assert p.tokens == sum(samples[i].tokens for i in p.samples)
        assert list(p.images) == [n for i in p.samples for n in samples[i].images]


@given(samples_st, st.integers(200, 1500), st.integers(0, 700))
def test_budget_packer_respects_budget_except_a_lone_first_sample(samples, seq_len, budget):
    res = pack_budget(samples, seq_len, budget, buffer_size=16)
    for p in res.packs:
        first = samples[p.samples[0]].image_tokens
        assert p.image_tokens <= max(budget, first)
        if first > budget:   # an over-budget sample rides alone with image-free company
            assert p.image_tokens == first
    assert sum(len(p.samples) for p in res.packs) == len(samples) - len(res.dropped)


def budget_reference(samples, seq_len, budget, buffer_size):
    """The budget packer as first written: each pick scans the sorted buffer down from the
    longest sample that fits the tokens to the first that also fits the image budget.
    (samples, tokens) of each pack, and the dropped indices."""
    keys, packs, dropped = [], [], []

    def emit():
        first = keys.pop()
        chosen, room = [-first[1]], seq_len - first[0]
        img_room = budget - samples[-first[1]].image_tokens
        while room > 0 and keys:
            pos = max((i for i, k in enumerate(keys) if k[0] <= room
                       and samples[-k[1]].image_tokens <= img_room), default=-1)
            if pos < 0:
                break
            k = keys.pop(pos)
            chosen.append(-k[1])
            room -= k[0]
            img_room -= samples[-k[1]].image_tokens
        packs.append((tuple(chosen), seq_len - room))

    for idx, s in enumerate(samples):
        if s.tokens > seq_len:
            dropped.append(idx)
            continue
        keys.append((s.tokens, -idx))
        keys.sort()
        if len(keys) >= buffer_size:
            emit()
    while keys:
        emit()
    return packs, dropped


@given(samples_st, st.integers(200, 1500), st.integers(0, 700), st.integers(1, 40))
def test_budget_packer_picks_what_a_scan_of_the_buffer_picks(samples, seq_len, budget, buf):
    res = pack_budget(samples, seq_len, budget, buffer_size=buf)
    assert ([(p.samples, p.tokens) for p in res.packs], res.dropped) == \
        budget_reference(samples, seq_len, budget, buf)


def test_overlong_drop_is_counted_and_error_names_the_index():
    samples = [Sample(10), Sample(9000, (100,)), Sample(20)]
    res = pack_greedy(samples, 8192)
    assert res.dropped == [1] and res.report()["dropped"] == 1
    with pytest.raises(OverlongSampleError, match="sample 1 has 9000 tokens"):
        pack_greedy(samples, 8192, on_overlong="error")


def test_deterministic_tie_breaks():
    samples = [Sample(100)] * 50
    a = pack_greedy(samples, 250, buffer_size=7)
    b = pack_greedy(list(samples), 250, buffer_size=7)
    assert [p.samples for p in a.packs] == [p.samples for p in b.packs]


def test_mixed_trace_reaches_the_seed_efficiency_and_budget_collapses_it():
    samples = mixtures.mixed(seed=0)
    greedy = pack_greedy(samples, 8192)
    assert greedy.efficiency >= 0.994
    img = np.array([p.image_tokens for p in greedy.packs])
    budget = pack_budget(samples, 8192, int(img.mean() * 0.7))
    assert budget.efficiency < 0.8       # the seed: 99% -> 66% at budgets that balance
    assert np.std([p.image_tokens for p in budget.packs]) < img.std()


def test_invalid_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        pack_greedy([], 0)
    with pytest.raises(ValueError, match="buffer"):
        pack_greedy([], 10, buffer_size=0)
    with pytest.raises(ValueError, match="on_overlong"):
        pack_greedy([], 10, on_overlong="truncate")
