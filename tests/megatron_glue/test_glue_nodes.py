"""Node ids found, not assumed: 4 real gloo processes name their node (torchrun's
``GROUP_RANK``, else ``SLURM_NODEID``, else the host name), the names are all-gathered once
when the exchange groups are created, and every rank ends with the same node ids and the
same plan; moves then prefer node-mates and the statistics count what crossed.

One launch runs every assignment in turn (process start-up dominates: about 30 s on 2
shared cores).
"""
import os

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 not installed")

from megatron_mm_balance.runtime.groups import node_identity, node_ids_from_identities  # noqa: E402
from megatron_mm_balance.solver.placement import plan_placement  # noqa: E402
from megatron_mm_balance.solver.topology import traffic  # noqa: E402
from megatron_mm_balance.testing.cpu_megatron import launch  # noqa: E402

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

WORLD, G = 4, 2
#: rank r draws packs of these image tokens: equal node totals for the cyclic assignment,
#: so node-aware placement can even the ranks without a pack crossing (tests/core/test_topology.py)
COSTS = [[10, 10], [5, 5], [5, 5], [10, 10]]
#: name -> (environment of rank r, the node ids every rank must find)
ASSIGNMENTS = {
    "torchrun blocks": (lambda r: {"GROUP_RANK": str(r // 2)}, (0, 0, 1, 1)),
    "torchrun cyclic": (lambda r: {"GROUP_RANK": str(r % 2)}, (0, 1, 0, 1)),
    # srun without torchrun: Slurm's node ids, numbered here by first appearance
    "slurm, non-contiguous": (lambda r: {"SLURM_NODEID": str(7 if r in (0, 3) else 3)}, (0, 1, 1, 0)),
    "host name only": (lambda r: {}, (0, 0, 0, 0)),
}
NODE_VARS = ("GROUP_RANK", "SLURM_NODEID")


class Loader:
    """Rank r's packs, endlessly: COSTS[r] image tokens, ids telling where they came from."""

    def __init__(self, rank):
        self.rank, self.n = rank, 0

    def __next__(self):
        import torch
        k, self.n = self.n, self.n + 1
        return {"image_tokens": torch.tensor([COSTS[self.rank][k % G]]),
                "id": torch.tensor([self.rank * 1000 + k])}


def _balance(rank, node_ids, **kw):
    """One global batch through a BalancedDataIterator; its first stats entry and plan."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    it = BalancedDataIterator(Loader(rank), num_microbatches=G, sync="step", balance_tolerance=0.0,
                              overlap=False, timeout=60, node_ids=node_ids, **kw)
    try:
        got = [int(next(it)["id"]) for _ in range(G)]
        s = it.stats[0]
        return {"got": got, "nodes": s.nodes, "inter_node_packs": s.inter_node_packs,
                "packs_moved": s.packs_moved, "inter_node_bytes_sent": s.inter_node_bytes_sent,
                "bytes_sent": s.bytes_sent}
    finally:
        it.close()


def nodes_worker(rank, world):
    from megatron_mm_balance.megatron.groups import init_exchange_groups

    out = {}
    for name, (env_of, _) in ASSIGNMENTS.items():
        for var in NODE_VARS:
            os.environ.pop(var, None)
        os.environ.update(env_of(rank))
        groups = init_exchange_groups({"holds_data": True, "dp_ranks": list(range(world))}, timeout=60)
        out[name] = {"node_ids": list(groups.node_ids),
                     "aware": _balance(rank, groups.node_ids, group=None,
                                       exchange_group=groups.chunk(0)),
                     # the override: one node per rank, i.e. a flat plan; traffic still
                     # counted against the nodes found
                     "flat": _balance(rank, groups.node_ids, exchange_group=groups.chunk(0),
                                      ranks_per_node=1)}
    # The runtime alone (no framework): the iterator creates its exchange group and finds
    # the nodes itself, at that moment; the last assignment's variables are still set.
    os.environ.update(GROUP_RANK=str(rank % 2))
    out["runtime"] = _balance(rank, None)
    # Nodes unknown (an exchange group given, no node ids): no node figure at all.
    from megatron_mm_balance.runtime.groups import new_exchange_groups
    out["unknown"] = _balance(rank, None, exchange_group=new_exchange_groups([list(range(world))], 60))
    return out


@pytest.fixture(scope="module")
def results():
    return launch(nodes_worker, WORLD, timeout=240)


@pytest.mark.parametrize("name", list(ASSIGNMENTS))
def test_every_rank_finds_the_same_node_ids_and_plan(results, name):
    want = ASSIGNMENTS[name][1]
    assert [r[name]["node_ids"] for r in results] == [list(want)] * WORLD
    plan = plan_placement(np.array(COSTS), sync="step", balance_tolerance=0.0, ranks_per_node=list(want))
    expect = traffic(plan.src_rank, list(want))
    for rank, r in enumerate(results):
        aware = r[name]["aware"]
        # each rank computes the test process's plan for the found ids: it receives those packs
        assert aware["got"] == [int(plan.src_rank[rank, k]) * 1000 + int(plan.src_index[rank, k])
                                for k in range(G)]
        assert aware["nodes"] == len(set(want))
        assert aware["inter_node_packs"] == expect["inter_node_packs"]
        assert aware["packs_moved"] == expect["moved_packs"] > 0
        assert (aware["inter_node_bytes_sent"] > 0) == any(
            want[d] != want[rank] and plan.src_rank[d, k] == rank for d in range(WORLD) for k in range(G))


def test_node_aware_keeps_packs_on_their_node_where_flat_does_not(results):
    """The cyclic assignment: a flat plan (--mm-balance-ranks-per-node 1) evens the ranks with
    4 packs crossing the nodes found; the node-aware plan evens them as well with none."""
    r = results[0]["torchrun cyclic"]
    assert r["flat"]["nodes"] == 2 and r["flat"]["inter_node_packs"] == 4
    assert r["aware"]["inter_node_packs"] == 0 and r["aware"]["packs_moved"] == 4
    blocks = results[0]["torchrun blocks"]
    assert blocks["aware"]["inter_node_packs"] <= blocks["flat"]["inter_node_packs"]


def test_one_node_reports_nothing_crossing(results):
    """All ranks on one host: one node, moved packs, none counted as crossing."""
    r = results[0]["host name only"]["aware"]
    assert r["nodes"] == 1 and r["packs_moved"] > 0
    assert r["inter_node_packs"] == 0 and r["inter_node_bytes_sent"] == 0


def test_the_runtime_finds_nodes_when_it_creates_its_group(results):
    assert all(r["runtime"]["nodes"] == 2 and r["runtime"]["inter_node_packs"] == 0 for r in results)


def test_unknown_nodes_report_no_node_figure(results):
    for r in results:
        u = r["unknown"]
        assert u["packs_moved"] > 0
        assert u["nodes"] is None and u["inter_node_packs"] is None and u["inter_node_bytes_sent"] is None


def test_node_identity_prefers_torchrun_then_slurm_then_the_host():
    import socket
    assert node_identity({"GROUP_RANK": "3", "SLURM_NODEID": "1"}) == "torchrun agent 3"
    assert node_identity({"GROUP_RANK": " ", "SLURM_NODEID": "1"}) == "slurm node 1"
    assert node_identity({}) == f"host {socket.gethostname()}"
    assert node_ids_from_identities(["host b", "host a", "host b", "host c"]) == (0, 1, 0, 2)
    assert node_ids_from_identities([]) == ()
