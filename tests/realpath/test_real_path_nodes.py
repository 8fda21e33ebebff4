"""Two nodes on one machine, through the user's launcher: ``scripts/pretrain_vlm_moe.sh
--config configs/megatron/tiny_cpu.sh`` started twice, ``NNODES=2``, ``NODE_RANK=0`` and ``1``,
``MASTER_ADDR=127.0.0.1``, 2 ranks per "node" (world 4: DP=4 x EP=2), as a user starts a
job on two nodes. Each launcher's torchrun agent gives its ranks ``GROUP_RANK`` 0 or 1, which
is how the ranks find their node: nothing is set by hand.

Three jobs on the session's patched tree and dataset: off, on (node-aware: the nodes found),
on flat (``--mm-balance-ranks-per-node 1``: placement as if every rank were its own node,
traffic still counted against the nodes found). Losses equal off vs on, the telemetry shows
2 nodes, and node-aware placement sends fewer packs across the nodes than flat on the same
data, and in no global batch more at a balance no better. Slow:
``python -m pytest tests/realpath/test_real_path_nodes.py -m realpath``.
"""
from __future__ import annotations

import pytest

import realpath_util as rp

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(1800)]

REL_TOL = 1e-5            # as tests/realpath/test_real_path.py
ITERS = 4
NNODES, NPROC_PER_NODE = 2, 2
RUN_TIMEOUT_S = 600
#: on and flat place as if all four ranks met every micro-step (``--mm-balance-sync microstep``):
#: here the two expert-parallel groups are the two nodes, so the placement by the job's meeting
#: groups (``auto``) keeps packs inside them whether it knows the nodes or not
#: (tests/megatron_glue/test_glue_meeting.py); node-aware placement is what this job compares
TODAY = ["--mm-balance-sync", "microstep"]
JOBS = {"off": (False, []), "on": (True, TODAY), "flat": (True, TODAY + ["--mm-balance-ranks-per-node", "1"])}


@pytest.fixture(scope="module")
def jobs(megatron_lm, dataset, runs_dir):
    out = {}
    for name, (on, extra) in JOBS.items():
        env = rp.launcher_env(megatron_lm, dataset, mm_balance=on, output_dir=runs_dir / f"nodes-{name}",
                              train_iters=ITERS)
        out[name] = rp.run_nodes(env, NNODES, NPROC_PER_NODE, extra, log_dir=runs_dir,
                                 name=f"nodes-{name}", timeout=RUN_TIMEOUT_S)
    return out


def test_two_nodes_off_on_equal_node_aware_crosses_less_than_flat(jobs):
    off, on, flat = jobs["off"], jobs["on"], jobs["flat"]
    table = rp.loss_table(jobs)
    for name, run in jobs.items():
        assert run.rc == 0, f"{name}: exit {run.rc}\n{run.tail(80)}"
    want = list(range(1, ITERS + 1))
    assert all(sorted(run.losses) == want for run in jobs.values()), table
    diff = max(rp.max_rel_diff(on.losses, off.losses, want), rp.max_rel_diff(flat.losses, off.losses, want))
    assert diff <= REL_TOL, f"lm loss off vs on differs by {diff:.2e} > {REL_TOL}\n{table}"
    assert not off.moved, "MM_BALANCE=0 printed balancer telemetry"
    nodes = {name: rp.telemetry_field(jobs[name].log, "nodes") for name in ("on", "flat")}
    inter = {name: rp.telemetry_field(jobs[name].log, "inter_node_packs") for name in ("on", "flat")}
    print(f"\ntwo nodes x 2 ranks: max relative lm-loss difference {diff:.2e}\n{table}")
    balance = {name: (rp.telemetry_field(jobs[name].log, "imbalance_after"),
                      rp.telemetry_field(jobs[name].log, "rank_imbalance_after")) for name in ("on", "flat")}
    for name in ("on", "flat"):
        print(f"{name}: packs moved {jobs[name].moved}, inter-node packs {inter[name]}, "
              f"nodes {nodes[name]}, imbalance after {balance[name][0]}, rank imbalance after "
              f"{balance[name][1]}, wall {jobs[name].wall_s:.0f} s")
    print(f"off: wall {off.wall_s:.0f} s")
    for name in ("on", "flat"):
        assert nodes[name] and set(nodes[name].values()) == {2.0}, f"{name}: nodes not found: {nodes[name]}"
        assert sorted(inter[name]) == sorted(jobs[name].moved), f"{name}: a line without inter_node_packs"
    assert sum(flat.moved.values()) > 0 and sum(on.moved.values()) > 0
    assert sum(inter["on"].values()) < sum(inter["flat"].values()), (
        f"node-aware sent {inter['on']} packs across nodes, flat {inter['flat']}")
    # global batch by global batch: never more packs across than flat unless the balance is
    # better (solver/node_choice.py)
    for it in inter["on"]:
        better = [balance["on"][k][it] < balance["flat"][k][it] for k in (0, 1)]
        assert inter["on"][it] <= inter["flat"][it] or any(better), (
            f"iteration {it}: node-aware sent {inter['on'][it]:g} packs across nodes, flat "
            f"{inter['flat'][it]:g}, at no better balance ({balance})")
