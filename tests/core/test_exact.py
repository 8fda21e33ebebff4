"""The exact two-phase reference (MILP) against brute force, the heuristic and the bound."""
import itertools

import numpy as np
import pytest

pytest.importorskip("scipy.optimize")

from megatron_mm_balance.solver.exact import exact_two_phase_grouping  # noqa: E402
from megatron_mm_balance.solver.two_phase import (_grouping_objective, group_two_phase,  # noqa: E402
                                                  two_phase_lower_bound)


def brute_force(v, l, D, G):
    """Least objective over every grouping of the D*G packs into G groups of D."""
    best = None

    def rec(rest, acc):
        nonlocal best
        if not rest:
            best = acc if best is None else min(best, acc)
            return
        first, others = rest[0], rest[1:]
        for mates in itertools.combinations(others, D - 1):
            grp = (first, *mates)
            left = [p for p in others if p not in mates]
            rec(left, acc + max(v[list(grp)]) + max(l[list(grp)]))

    rec(list(range(D * G)), 0)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_exact_equals_brute_force_on_tiny_instances(seed):
    rng = np.random.default_rng(seed)
    D, G = [(2, 3), (3, 2), (2, 4), (3, 3)][seed]
    v = rng.integers(0, 50, size=D * G) * (rng.random(D * G) < 0.7)
    l = rng.integers(0, 50, size=D * G)
    res = exact_two_phase_grouping(v, l, D, G, time_limit=30)
    assert res.optimal
    assert res.objective == brute_force(v, l, D, G) == _grouping_objective(v, l, res.group, G)
    assert np.array_equal(np.bincount(res.group, minlength=G), np.full(G, D))


@pytest.mark.parametrize("seed", range(6))
def test_heuristic_never_beats_the_exact_optimum_nor_the_bound_exceeds_it(seed):
    rng = np.random.default_rng(100 + seed)
    D, G = int(rng.choice([2, 3, 4])), int(rng.choice([2, 3, 4]))
    # anti-correlated phases, as image-heavy and long-text packs
    v = rng.integers(0, 1000, size=D * G)
    l = np.maximum(1200 - v + rng.integers(-300, 300, size=D * G), 1)
    res = exact_two_phase_grouping(v, l, D, G, time_limit=30)
    assert res.optimal
    heur = _grouping_objective(v, l, group_two_phase(v, l, D, G), G)
    lb = two_phase_lower_bound(np.stack([v, l], axis=1).reshape(D, G, 2))
    assert lb <= res.objective <= heur


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="D \\* G"):
        exact_two_phase_grouping([1, 2, 3], [1, 2, 3], 2, 2)
    with pytest.raises(ValueError, match=">= 0"):
        exact_two_phase_grouping([1, -2, 3, 4], [1, 2, 3, 4], 2, 2)
