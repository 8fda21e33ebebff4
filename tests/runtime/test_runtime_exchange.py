"""Exactly-once, bit-identical delivery in the solver's order, across real gloo
process groups (world 2, 4, 8 x num_microbatches 1, 2, 7 x overlap on/off).

Each rank records every pack it pulls (id, cost, checksum) and every pack it
delivers (global batch, micro-step, id, checksum of what arrived). The test
rebuilds each global batch's cost matrix, recomputes the placement and checks
that slot (rank, step) delivered exactly the pack the placement names, with the
checksum it had at its source.
"""
import importlib.util
import os
from collections import Counter

import numpy as np
import pytest

from megatron_mm_balance.runtime import plan_placement

_spec = importlib.util.spec_from_file_location(
    "rt_harness", os.path.join(os.path.dirname(__file__), "rt_harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

# [num_microbatches, overlap, pass num_microbatches as a callable]
CONFIGS = [[G, ov, G == 7] for G in (1, 2, 7) for ov in (True, False)]
BATCHES = 4


def _check_config(results, ci, world, batches=BATCHES, ranks_per_node=None):
    cfgs = [r["configs"][ci] for r in results]
    G = cfgs[0]["G"]
    pulled = [c["pulled"] for c in cfgs]
    delivered = [c["delivered"] for c in cfgs]
    by_id = {pid: (cost, ck) for p in pulled for pid, cost, ck in p}

    # Exactly once, bit-identical, over the full global batches.
    expected = Counter(pid for p in pulled for pid, _, _ in p[: batches * G])
    got = Counter(row[2] for d in delivered for row in d)
    assert got == expected, f"G={G}: lost {expected - got}, duplicated {got - expected}"
    for d in delivered:
        for gb, k, pid, ck in d:
            assert ck == by_id[pid][1], f"pack {pid} corrupted in transit"

    # Delivered in the placement's micro-step order.
    moved = 0
    for gb in range(batches):
        costs = np.array([[p[gb * G + i][1] for i in range(G)] for p in pulled], dtype=np.int64)
        plc = plan_placement(costs, ranks_per_node=ranks_per_node)
        moved += int(plc.moved().sum())
        for r in range(world):
            rows = [row for row in delivered[r] if row[0] == gb]
            assert [row[1] for row in rows] == list(range(G))
            for k, row in enumerate(rows):
                want = pulled[plc.src_rank[r, k]][gb * G + plc.src_index[r, k]][0]
                assert row[2] == want, f"rank {r} gb {gb} step {k}: got {row[2]}, placement says {want}"

    # Everyone stopped at the same boundary; rank 0's extra pack is reported, not lost silently.
    for c in cfgs:
        assert c["again"] == "StopIteration"
        last = c["stats"][-1]
        assert last["exhausted"] and last["global_batch"] == batches and last["not_delivered"] == 1
        assert [s["packs_moved"] for s in c["stats"][:-1]] == [s["packs_moved"] for s in cfgs[0]["stats"][:-1]]
    if G > 1:
        assert moved > 0, "test data never moved a pack: the exchange went untested"
        assert sum(s["bytes_received"] for c in cfgs for s in c["stats"][:-1]) > 0
    return moved


@pytest.mark.parametrize("world", [2, 4, 8])
def test_exactly_once_in_placement_order(world):
    results = harness.launch(world, "exactly_once", hard_timeout=150, configs=CONFIGS, batches=BATCHES)
    for r, res in enumerate(results):
        assert "configs" in res, f"rank {r}: {res.get('error') or res}\n{res.get('log', '')}"
    for ci in range(len(CONFIGS)):
        _check_config(results, ci, world)


def test_more_microbatches_than_the_record_carries():
    """G > 64: costs no longer fit in the fixed record and take a second all-gather."""
    results = harness.launch(2, "exactly_once", hard_timeout=120, configs=[[70, True, False]], batches=2)
    for r, res in enumerate(results):
        assert "configs" in res, f"rank {r}: {res.get('error') or res}\n{res.get('log', '')}"
    _check_config(results, 0, 2, batches=2)


def test_node_aware_exchange_delivers_the_node_aware_placement():
    """Ranks per node on the runtime: the placement every rank solves prefers node-mates
    (4 ranks, 2 per node), delivery follows it exactly, and the statistics count the
    packs and bytes that cross nodes (each rank's torchrun GROUP_RANK names its node, which
    the iterator finds when it creates its exchange group)."""
    from megatron_mm_balance.solver.topology import traffic
    results = harness.launch(4, "exactly_once", hard_timeout=150, configs=[[7, True, False]],
                             batches=3, ranks_per_node=2, node_of_rank=[0, 0, 1, 1])
    for r, res in enumerate(results):
        assert "configs" in res, f"rank {r}: {res.get('error') or res}\n{res.get('log', '')}"
    _check_config(results, 0, 4, batches=3, ranks_per_node=2)
    pulled = [res["configs"][0]["pulled"] for res in results]
    for gb in range(3):
        costs = np.array([[p[gb * 7 + i][1] for i in range(7)] for p in pulled], dtype=np.int64)
        want = traffic(plan_placement(costs, ranks_per_node=2).src_rank, 2)["inter_node_packs"]
        assert all(res["configs"][0]["stats"][gb]["inter_node_packs"] == want for res in results)
    sent_across = sum(s["inter_node_bytes_sent"] for res in results
                      for s in res["configs"][0]["stats"][:-1])
    sent = sum(s["bytes_sent"] for res in results for s in res["configs"][0]["stats"][:-1])
    assert 0 < sent_across <= sent


@pytest.mark.parametrize("overlap", [True, False])
def test_two_phase_costs_ride_the_all_gather_and_place_identically(overlap):
    """A cost_fn with ``components = 2`` (vision, language): every rank all-gathers both
    numbers, solves the two-phase placement and delivers exactly what it names."""
    from megatron_mm_balance.solver.two_phase import two_phase_lower_bound, two_phase_objective
    G, B = 5, 3
    results = harness.launch(4, "two_phase", hard_timeout=150, G=G, batches=B, overlap=overlap)
    for r, res in enumerate(results):
        assert "pulled" in res, f"rank {r}: {res.get('error') or res}\n{res.get('log', '')}"
    pulled = [res["pulled"] for res in results]
    by_id = {pid: ck for p in pulled for pid, _, _, ck in p}
    moved = 0
    for gb in range(B):
        c = np.array([[[p[gb * G + i][1], p[gb * G + i][2]] for i in range(G)] for p in pulled],
                     dtype=np.int64)
        plc = plan_placement(c)
        moved += int(plc.moved().sum())
        assert two_phase_objective(c[plc.src_rank, plc.src_index]) >= two_phase_lower_bound(c)
        for r, res in enumerate(results):
            rows = [row for row in res["delivered"] if row[0] == gb]
            assert [row[1] for row in rows] == list(range(G))
            for k, row in enumerate(rows):
                want = pulled[plc.src_rank[r, k]][gb * G + plc.src_index[r, k]][0]
                assert row[2] == want and row[3] == by_id[want]
    assert moved > 0


def test_without_the_thread_a_whole_batch_is_exchanged_at_its_first_micro_step():
    """``overlap=False``: the first ``next()`` of a global batch runs its whole exchange, so a
    peer that stops after its first micro-step (here, in a barrier) no longer holds up the
    packs this rank receives at later micro-steps; what arrives is still exactly the
    placement, each pack once."""
    G, batches, world = 4, 3, 2
    res = harness.launch(world, "whole_batch", hard_timeout=90, G=G, batches=batches)
    for r, x in enumerate(res):
        assert "delivered" in x, f"rank {r}: {x.get('error') or x}\n{x.get('log', '')}"
    later = 0
    for gb in range(batches):
        sl = slice(gb * G, (gb + 1) * G)
        solved = plan_placement(np.array([x["costs"][sl] for x in res]))
        for r, x in enumerate(res):
            assert x["delivered"][sl] == [res[s]["pulled"][sl][i]
                                          for s, i in zip(solved.src_rank[r], solved.src_index[r])]
            assert x["stats"][gb]["packs_moved"] == solved.moved().sum()
        later += int((solved.src_rank[0, 1:] != 0).sum())
    assert later > 0, "rank 0 received no pack after micro-step 0: the test would not see a meeting"
    pulled = sorted(c for x in res for c in x["checksums"])
    assert sorted(c for x in res for c in x["delivered_checksums"]) == pulled
