"""The contiguous cost split of frames across context-parallel ranks (solver/cp_split.py)."""
import itertools
import random

import pytest

from megatron_mm_balance.solver.cp_split import (cost_split, default_frame_cost, equal_count_split,
                                                 frame_costs, frame_patches, imbalance, range_costs,
                                                 tower_alpha)


def _bounds(counts):
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _brute_force(costs, parts):
    """(max range cost, displacement from the equal-count bounds, bounds) of the best split."""
    n, target = len(costs), _bounds(equal_count_split(len(costs), parts))
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        b = [0, *cuts, n]
        counts = [b[k + 1] - b[k] for k in range(parts)]
        key = (max(range_costs(costs, counts)), sum(abs(x - y) for x, y in zip(b, target)), b)
        best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("kind", ["int", "float"])
def test_optimal_and_closest_to_equal_count_against_brute_force(kind):
    rng = random.Random(0 if kind == "int" else 1)
    for _ in range(600):
        n, parts = rng.randint(0, 9), rng.randint(1, 4)
        costs = ([rng.choice([0, 1, 2, 3, 5, 8, 100]) for _ in range(n)] if kind == "int"
                 else [rng.random() * 10 for _ in range(n)])
        got = cost_split(costs, parts)
        want_max, want_dev, want_bounds = _brute_force(costs, parts)
        assert sum(got) == n and len(got) == parts and min(got) >= 0
        assert max(range_costs(costs, got)) == want_max, (costs, parts, got)
        assert _bounds(got) == want_bounds, (costs, parts, got)      # ties: nearest Bridge's split


def test_equal_count_kept_when_optimal_and_bridge_rule():
    assert equal_count_split(7, 3) == [3, 2, 2]                # Bridge: the first ranks get one more
    assert equal_count_split(1, 2) == [1, 0]
    assert cost_split([5, 5, 5, 5], 2) == [2, 2]
    assert cost_split([4, 4, 4], 2) == [2, 1]                  # as Bridge, not [1, 2]
    assert cost_split([0, 0, 0], 2) == [2, 1]
    assert cost_split([], 3) == [0, 0, 0]
    assert cost_split([9], 2) == [1, 0]


def test_cost_split_moves_the_large_frames_apart():
    big, small = default_frame_cost(256)(1024), default_frame_cost(256)(16)
    costs = [big, big, small, small, small, small]
    count = equal_count_split(6, 2)
    got = cost_split(costs, 2)
    assert count == [3, 3] and got == [1, 5]
    assert imbalance(range_costs(costs, got)) < imbalance(range_costs(costs, count))


def test_frames_and_default_cost():
    assert frame_patches([(1, 4, 6), (3, 2, 2)]) == [24, 4, 4, 4]     # a video: one frame per t
    assert tower_alpha(64, 128) == 256 and tower_alpha(1152, 4304) == 6608
    cost = default_frame_cost(tower_alpha(64, 128))
    assert cost(16) == 16 * (16 + 256) and isinstance(cost(16), int)
    assert frame_costs([(2, 2, 2)], cost) == [cost(4), cost(4)]


def test_deterministic_and_fast_enough_for_long_videos():
    rng = random.Random(3)
    costs = [rng.randint(1, 10 ** 6) for _ in range(3000)]
    a, b = cost_split(costs, 8), cost_split(list(costs), 8)
    assert a == b and sum(a) == 3000


@pytest.mark.parametrize("call,match", [
    (lambda: cost_split([1, -1], 2), "non-negative.*frame 1"),
    (lambda: cost_split([1, float("nan")], 2), "finite"),
    (lambda: cost_split(["3"], 2), "numbers"),
    (lambda: cost_split([1], 0), "positive integer"),
    (lambda: cost_split([1], 2.0), "positive integer"),
    (lambda: frame_patches([(1, 2)]), "triples"),
    (lambda: frame_patches([(0, 2, 2)]), "positive"),
    (lambda: tower_alpha(0, 4), "positive"),
    (lambda: range_costs([1, 2], [1]), "do not cover"),
])
def test_bad_input_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
