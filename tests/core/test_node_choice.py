"""Node-aware placement is never worse than the flat placement of the same batch.

The guarantee (solver/node_choice.py): compared lexicographically on (balance objective,
heaviest rank's excess over the limit, packs crossing nodes), the node-aware plan is no
worse than the flat one: never a worse balance, and at an equal balance never more packs
across nodes. The quality is computed here independently of the solver's own
``PlanQuality``, from the definitions (``rank_limit``, ``traffic``)."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from determinism import placement_digests
from megatron_mm_balance.solver.node_choice import PlanQuality, inter_node_packs, no_worse_than_flat
from megatron_mm_balance.solver.placement import (check_placement, microstep_objective, plan_placement,
                                                  sorted_grouping_optimum)
from megatron_mm_balance.solver.rank_balance import SwapRules, cost_grain, rank_limit
from megatron_mm_balance.solver.topology import dense_node_ids, traffic

TOL = 0.001

#: node layouts of the property test: 2 nodes of 2 (contiguous and cyclic), 2 nodes of
#: 2 ranks with 3 micro-steps and more, uneven nodes, three nodes interleaved
LAYOUTS = [(0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 0, 1, 1), (0, 1, 1), (0, 1, 1, 2, 2, 2),
           (2, 0, 1, 0, 2, 1), (0, 0, 1, 1, 1, 1, 2, 2)]


def quality(c, pl, ids, sync):
    """(objective, excess over the limit, inter-node packs): the order of the guarantee."""
    w = c.sum(axis=2) if c.ndim == 3 else c
    placed = c[pl.src_rank, pl.src_index]
    objective = 0 if sync == "step" else int(placed.max(axis=0).sum())
    limit = rank_limit(int(w.sum()), w.shape[0], TOL, cost_grain(w))
    excess = max(int(w[pl.src_rank, pl.src_index].sum(axis=1).max()) - limit, 0)
    return objective, excess, traffic(pl.src_rank, list(ids))["inter_node_packs"]


@st.composite
def batches(draw):
    """A layout (one of LAYOUTS or random labels), a cost matrix for it (tile-quantised
    with many ties, or spread; scalar or two-phase) and a sync mode."""
    if draw(st.booleans()):
        ids = draw(st.sampled_from(LAYOUTS))
    else:
        ids = tuple(draw(st.lists(st.integers(0, 2), min_size=2, max_size=8)))
    D, G = len(ids), draw(st.integers(1, 5))
    shape = (D, G, 2) if draw(st.booleans()) else (D, G)
    if draw(st.booleans()):
        c = np.array(draw(st.lists(st.integers(0, 7), min_size=int(np.prod(shape)),
                                   max_size=int(np.prod(shape))))).reshape(shape) * 256
    else:
        c = np.array(draw(st.lists(st.integers(0, 10_000), min_size=int(np.prod(shape)),
                                   max_size=int(np.prod(shape))))).reshape(shape)
    return ids, c.astype(np.int64), draw(st.sampled_from(["microstep", "step"]))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_node_aware_is_never_worse_than_flat(batch):
    ids, c, sync = batch
    flat = plan_placement(c, sync=sync)
    aware = plan_placement(c, sync=sync, ranks_per_node=list(ids))
    check_placement(aware, *c.shape[:2])
    assert quality(c, aware, ids, sync) <= quality(c, flat, ids, sync)
    if sync == "microstep" and c.ndim == 2:
        assert microstep_objective(aware.apply(c)) == sorted_grouping_optimum(c)
    again = plan_placement(c.copy(), sync=sync, ranks_per_node=list(ids))
    assert np.array_equal(aware.src_rank, again.src_rank)
    assert np.array_equal(aware.src_index, again.src_index)


#: The 17 of 3,000 batches (numpy.random.default_rng(0).integers(0, 8, size=(4, 2)) * 256 in
#: turn, nodes [0, 0, 1, 1], microstep) where the node-aware plan used to cross 4 packs and
#: the flat plan 2: stage 2 kept every mover on its node, stage 3 then relieved the heavier
#: node's two heavy ranks with one swap across the network each.
SEVENTEEN = [
    [[1536, 768], [512, 1792], [512, 256], [1280, 1024]],
    [[1280, 1536], [0, 512], [1792, 512], [1024, 1536]],
    [[0, 768], [768, 1792], [1024, 256], [1024, 1280]],
    [[1024, 1792], [1792, 256], [1024, 1280], [0, 0]],
    [[1024, 512], [1792, 1024], [512, 1280], [1536, 1280]],
    [[0, 1536], [1280, 1536], [0, 1024], [1792, 768]],
    [[0, 0], [1024, 1024], [768, 1536], [1792, 256]],
    [[0, 1280], [512, 1024], [256, 768], [1280, 1792]],
    [[512, 768], [1792, 1280], [1024, 1024], [256, 0]],
    [[512, 0], [1792, 768], [0, 1536], [1536, 1536]],
    [[0, 1024], [512, 1024], [256, 768], [1792, 1280]],
    [[1024, 1024], [0, 256], [1024, 1280], [1024, 1536]],
    [[768, 256], [1024, 1280], [1792, 1024], [1536, 1024]],
    [[1280, 1280], [0, 256], [1792, 768], [1792, 1280]],
    [[1536, 1280], [1792, 0], [1024, 1024], [1792, 256]],
    [[0, 768], [512, 256], [1024, 768], [1280, 1792]],
    [[768, 1280], [512, 1536], [256, 256], [1024, 1280]],
]
NODES = [0, 0, 1, 1]


def fewest_crossings(c, ids, limit, perms):
    """Exhaustive search over all placements (``perms``: every permutation of the D * G packs,
    slot s computing pack ``perms[:, s]``): the fewest packs crossing nodes of any placement
    at the optimum micro-step objective and with every rank within ``limit``."""
    D, G = c.shape
    placed = c.ravel()[perms].reshape(-1, D, G)
    ok = placed.max(axis=1).sum(axis=1) == sorted_grouping_optimum(c)
    ok &= placed.sum(axis=2).max(axis=1) <= limit
    node = np.asarray(ids)
    cross = (node[perms // G] != node[np.arange(D * G) // G][None, :]).sum(axis=1)
    return int(cross[ok].min())


def test_the_seventeen_batches_cross_no_more_than_flat_and_as_few_as_any_placement():
    assert len(SEVENTEEN) == 17
    perms = np.array(list(itertools.permutations(range(8))))
    rng = np.random.default_rng(0)
    drawn = [rng.integers(0, 8, size=(4, 2)) * 256 for _ in range(3000)]
    for case in SEVENTEEN:   # they are the batches the comparison in docs/notes/2026-12-02-several-nodes-megatron.md draws
        assert any(np.array_equal(np.array(case), d) for d in drawn)
    for case in SEVENTEEN:
        c = np.array(case, dtype=np.int64)
        flat = plan_placement(c)
        aware = plan_placement(c, ranks_per_node=NODES)
        q_flat, q_aware = quality(c, flat, NODES, "microstep"), quality(c, aware, NODES, "microstep")
        assert q_aware <= q_flat, case
        assert q_aware[2] == q_flat[2] == 2, case
        limit = max(rank_limit(int(c.sum()), 4, TOL, cost_grain(c)), int(flat.apply(c).sum(axis=1).max()))
        assert q_aware[2] == fewest_crossings(c, NODES, limit, perms), case


def _node_rules(c, ids):
    node = dense_node_ids(ids)
    levels = np.sort(c.ravel())[::-1][::c.shape[0]]
    rules = SwapRules(c, levels=levels, node=node)
    return rules, rules.limit(TOL)


def test_no_worse_than_flat_keeps_the_better_candidate():
    c = np.array(SEVENTEEN[0], dtype=np.int64)
    rules, limit = _node_rules(c, NODES)
    # the node-aware candidate as stage 3 left it (4 across) and the flat plan (2 across)
    aware = (np.array([[3, 1], [0, 2], [1, 2], [3, 0]]), np.array([[0, 0], [0, 0], [1, 1], [1, 1]]))
    flat = (np.array([[2, 1], [1, 0], [2, 3], [0, 3]]), np.array([[1, 1], [0, 0], [0, 0], [1, 1]]))
    qa, qf = (PlanQuality.of(rules, *p, limit=limit) for p in (aware, flat))
    assert (qa.objective, qa.excess, qa.inter_node) == (2560, 0, 4)
    assert (qf.objective, qf.excess, qf.inter_node) == (2560, 0, 2) and qf < qa
    kept = no_worse_than_flat(rules, tuple(a.copy() for a in aware), tuple(f.copy() for f in flat), limit=limit)
    assert PlanQuality.of(rules, *kept, limit=limit) <= qf
    # the other way round, the node-aware candidate is kept as it is
    kept = no_worse_than_flat(rules, flat, aware, limit=limit)
    assert kept is flat
    with pytest.raises(ValueError, match="nodes"):
        no_worse_than_flat(SwapRules(c), flat, aware, limit=limit)


def test_balance_comes_before_crossings():
    # a better balance wins even with more packs across nodes; at equal balance, fewer crossings
    assert PlanQuality(100, 0, 9) < PlanQuality(100, 256, 0)
    assert PlanQuality(100, 0, 1) < PlanQuality(100, 0, 2)
    assert PlanQuality(99, 512, 9) < PlanQuality(100, 0, 0)
    assert inter_node_packs(np.array([[0, 1], [2, 3], [0, 2], [3, 3]]), np.array([0, 0, 1, 1])) == 3


CASES = """
import numpy as np
from test_node_choice import SEVENTEEN, LAYOUTS
from megatron_mm_balance.solver.placement import plan_placement
rng = np.random.default_rng(3)
placements = [plan_placement(np.array(c), ranks_per_node=[0, 0, 1, 1]) for c in SEVENTEEN]
for ids in LAYOUTS:
    for sync in ("microstep", "step"):
        for shape in ((len(ids), 4), (len(ids), 4, 2)):
            placements.append(plan_placement(rng.integers(0, 8, size=shape) * 256, sync=sync,
                                             ranks_per_node=list(ids)))
"""


def test_identical_across_processes():
    assert len(placement_digests(CASES, ("0", "777"))) == 1
