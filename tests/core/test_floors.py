"""Floors (solver/floors.py): lower bounds of any placement of whole packs or frames, exact
by brute force where claimed, never above what a placement achieves."""
import itertools

import numpy as np
import pytest

from megatron_mm_balance.solver.floors import batch_floors, rank_total_floor, sorted_grouping
from megatron_mm_balance.solver.frames import plan_frames
from megatron_mm_balance.solver.placement import plan_placement


def groupings(n, D):
    """Every partition of range(n) into groups of D (as lists of tuples)."""
    if n == 0:
        yield []
        return
    items = list(range(n))

    def rec(rest):
        if not rest:
            yield []
            return
        first, others = rest[0], rest[1:]
        for mates in itertools.combinations(others, D - 1):
            left = [x for x in others if x not in mates]
            for tail in rec(left):
                yield [(first, *mates)] + tail
    yield from rec(items)


def best_frame_max(frames, D):
    """The least largest rank load of frames (P||Cmax) by brute force."""
    best = None
    for enc in itertools.product(range(D), repeat=len(frames)):
        load = np.zeros(D)
        np.add.at(load, list(enc), frames)
        best = load.max() if best is None else min(best, load.max())
    return 0 if best is None else best


def random_batch(rng, N):
    frames = [rng.integers(0, 30, size=int(rng.integers(0, 4))) for _ in range(N)]
    v = np.array([f.sum() for f in frames])
    f = np.array([f.max() if len(f) else 0 for f in frames])
    l = rng.integers(0, 40, size=N)
    return frames, v, l, f


@pytest.mark.parametrize("seed", range(12))
def test_microstep_floors_never_exceed_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    D, G = int(rng.integers(2, 4)), 2
    frames, v, l, f = random_batch(rng, D * G)
    fl = batch_floors(v, l, f, D)
    best_packs = best_frames = None
    for groups in groupings(D * G, D):
        packs = sum(max(v[list(g)]) + max(l[list(g)]) for g in groups)
        fr = sum(best_frame_max(np.concatenate([frames[p] for p in g] + [np.zeros(0)]), D)
                 + max(l[list(g)]) for g in groups)
        best_packs = packs if best_packs is None else min(best_packs, packs)
        best_frames = fr if best_frames is None else min(best_frames, fr)
    assert fl.perfect <= fl.frames <= best_frames + 1e-9
    assert fl.frames <= fl.packs <= best_packs
    assert best_frames <= best_packs


@pytest.mark.parametrize("seed", range(10))
def test_the_pack_floor_is_exact_for_one_phase(seed):
    rng = np.random.default_rng(100 + seed)
    D, G = int(rng.integers(2, 4)), int(rng.integers(2, 4))
    x = rng.integers(0, 50, size=D * G)
    best = min(sum(max(x[list(g)]) for g in gr) for gr in groupings(D * G, D))
    for v, l in ((x, np.zeros_like(x)), (np.zeros_like(x), x)):
        fl = batch_floors(v, l, np.minimum(v, 1), D)
        assert fl.packs_exact and fl.packs == best == sorted_grouping(x, D)


@pytest.mark.parametrize("seed", range(8))
def test_step_floors_never_exceed_the_brute_force_optimum(seed):
    rng = np.random.default_rng(200 + seed)
    D, G = 2, int(rng.integers(2, 4))
    frames, v, l, f = random_batch(rng, D * G)
    t = v + l
    best = min(max(t[list(g)].sum() for g in gr)
               for gr in (list(zip(*[iter(p)] * G)) for p in itertools.permutations(range(D * G))))
    fl = batch_floors(v, l, f, D, sync="step")
    assert fl.frames <= fl.packs <= best
    assert rank_total_floor(t, D, G) <= best


def test_the_pigeonhole_bound_binds():
    # three heavy packs on 2 ranks of 4 packs each: one rank holds two, 20 above the mean 15
    t = np.array([10, 10, 10, 0, 0, 0, 0, 0])
    assert rank_total_floor(t, 2, 4) == 20


@pytest.mark.parametrize("seed", range(6))
def test_no_placement_goes_below_the_floors(seed):
    rng = np.random.default_rng(300 + seed)
    D, G = int(rng.choice([4, 8, 16])), int(rng.choice([2, 4, 8]))
    frames, v, l, f = random_batch(rng, D * G)
    v, l = v * 1000 + rng.integers(0, 999, size=D * G) * (v > 0), l * 1000
    frames = [fr * 1000 for fr in frames]
    f = np.array([fr.max() if len(fr) else 0 for fr in frames])
    v = np.maximum(v, np.array([fr.sum() for fr in frames]))
    fl = batch_floors(v, l, f, D)
    costs = np.stack([v, l], axis=-1).reshape(D, G, 2)
    for placement in (plan_placement(costs, sync="microstep"),):
        pl = costs.reshape(-1, 2)[(placement.src_rank * G + placement.src_index).ravel()].reshape(D, G, 2)
        assert fl.packs <= pl[:, :, 0].max(axis=0).sum() + pl[:, :, 1].max(axis=0).sum()
    as_drawn = costs[:, :, 0].max(axis=0).sum() + costs[:, :, 1].max(axis=0).sum()
    assert fl.packs <= as_drawn
    # frames: the packs as drawn, each micro-step's frames spread by plan_frames
    lang = l.reshape(D, G)
    total = 0
    for m in range(G):
        owner = np.concatenate([np.full(len(frames[r * G + m]), r) for r in range(D)]).astype(np.int64)
        cost = np.concatenate([frames[r * G + m] for r in range(D)]).astype(np.int64)
        vis = plan_frames(owner, cost, D).max_after if len(cost) else 0
        total += vis + lang[:, m].max()
    assert fl.frames <= total
    step = batch_floors(v, l, f, D, sync="step")
    assert step.packs <= (v + l).reshape(D, G).sum(axis=1).max()


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="D \\* G packs"):
        batch_floors([1, 2, 3], [1, 2, 3], [1, 2, 3], 2)
    with pytest.raises(ValueError, match="heaviest frame"):
        batch_floors([1, 2], [1, 2], [3, 0], 2)
    with pytest.raises(ValueError, match="sync"):
        batch_floors([1, 2], [1, 2], [1, 2], 2, sync="never")
