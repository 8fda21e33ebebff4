"""Node-aware moves: same objective and band, far fewer packs crossing nodes."""
import numpy as np
import pytest

from megatron_mm_balance import mixtures
from megatron_mm_balance.packing import pack_greedy
from megatron_mm_balance.placement import (Placement, check_placement, evaluate, microstep_objective,
                                           solve_placement, sorted_grouping_optimum)
from megatron_mm_balance.rank_balance import cost_grain, rank_limit
from megatron_mm_balance.topology import (node_ids, pair_within_nodes, ranks_per_node_from_env,
                                          traffic)


def test_node_ids_and_flat_cases():
    assert node_ids(16, 8).tolist() == [0] * 8 + [1] * 8
    assert node_ids(10, 4).tolist() == [0] * 4 + [1] * 4 + [2] * 2
    assert node_ids(8, 8) is None and node_ids(8, None) is None and node_ids(8, 1) is None


def test_pair_within_nodes_prefers_the_movers_node():
    node = np.array([0, 0, 1, 1])
    # movers from ranks 0, 2, 3 (priority order); free ranks 2, 1, 3 (preference order)
    dest = pair_within_nodes(np.array([0, 2, 3]), np.array([2, 1, 3]), node)
    assert dest.tolist() == [1, 2, 3]
    assert pair_within_nodes(np.array([0, 2, 3]), np.array([2, 1, 3]), None).tolist() == [2, 1, 3]
    # more movers than free ranks on node 0: the extra one crosses
    dest = pair_within_nodes(np.array([0, 1]), np.array([2, 1]), node)
    assert dest.tolist() == [1, 2]


def test_traffic_counts_inter_node_packs_and_bytes():
    pl = Placement(np.array([[0, 1], [0, 2], [3, 2], [3, 1]]), np.array([[0, 0], [1, 0], [0, 1], [1, 1]]))
    check_placement(pl, 4, 2)
    nbytes = np.full((4, 2), 10.0)
    t = traffic(pl.src_rank, 2, nbytes)
    # moved: (0,1) from 1 [same node], (1,0) from 0 [same], (1,1) from 2 [cross],
    # (2,0) from 3 [same], (3,1) from 1 [cross]
    assert t == {"moved_packs": 5, "inter_node_packs": 2, "moved_bytes": 50.0,
                 "inter_node_bytes": 20.0}
    assert traffic(pl.src_rank, None)["inter_node_packs"] == 5


def test_ranks_per_node_from_env(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_node_from_env() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node_from_env() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        ranks_per_node_from_env()


def test_invalid_ranks_per_node():
    with pytest.raises(ValueError, match="ranks_per_node"):
        solve_placement(np.ones((4, 2), dtype=np.int64), ranks_per_node=0)


@pytest.fixture(scope="module")
def packs():
    samples = mixtures.make_mixture("heldout", n=30_000, seed=1)
    return np.array([p.image_tokens for p in pack_greedy(samples, 8192).packs], dtype=np.int64)


# microstep (the target): at least half the inter-node traffic gone;
# step mode (swaps within two micro-steps, for speed): about a third.
@pytest.mark.parametrize("sync,cut", [("microstep", 0.5), ("step", 0.75)])
def test_node_aware_cuts_inter_node_traffic_at_the_same_objective_and_band(packs, sync, cut):
    rng = np.random.default_rng(11)
    D, G = 256, 16
    for _ in range(2):
        c = rng.choice(packs, size=D * G).reshape(D, G)
        flat = solve_placement(c, sync=sync)
        aware = solve_placement(c, sync=sync, ranks_per_node=8)
        check_placement(aware, D, G)
        nbytes = c[aware.src_rank, aware.src_index]
        t_flat = traffic(flat.src_rank, 8, c[flat.src_rank, flat.src_index])
        t_aware = traffic(aware.src_rank, 8, nbytes)
        assert t_aware["inter_node_packs"] <= cut * t_flat["inter_node_packs"]
        assert t_aware["inter_node_bytes"] <= cut * t_flat["inter_node_bytes"]
        limit = rank_limit(int(c.sum()), D, 0.002, cost_grain(c))
        assert aware.apply(c).sum(axis=1).max() <= limit
        if sync == "microstep":
            assert microstep_objective(aware.apply(c)) == sorted_grouping_optimum(c)
            m_flat, m_aware = evaluate(c, flat), evaluate(c, aware)
            assert m_aware["moved_fraction"] <= m_flat["moved_fraction"] + 0.02


def test_node_aware_is_deterministic(packs):
    c = np.random.default_rng(2).choice(packs, size=64 * 8).reshape(64, 8)
    p = solve_placement(c, ranks_per_node=8)
    q = solve_placement(c.copy(), ranks_per_node=8)
    assert np.array_equal(p.src_rank, q.src_rank) and np.array_equal(p.src_index, q.src_index)


def test_node_ids_as_a_sequence():
    # data-parallel ranks of a TP=2 job on 8-GPU nodes: global ranks 0,2,..,14 -> nodes 0,0,0,0,1,1,1,1
    ids = [r // 8 for r in range(0, 16, 2)]
    c = np.random.default_rng(4).integers(0, 20, size=(8, 4)) * 256
    by_ids = solve_placement(c, ranks_per_node=ids)
    by_int = solve_placement(c, ranks_per_node=4)
    assert np.array_equal(by_ids.src_rank, by_int.src_rank)
    assert traffic(by_ids.src_rank, ids) == traffic(by_int.src_rank, 4)
    with pytest.raises(ValueError, match="node ids"):
        solve_placement(c, ranks_per_node=[0, 1])
