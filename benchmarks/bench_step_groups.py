"""The group placement against today's on the same global batches (per-micro-step step
groups: expert parallelism inside data parallelism).

For each layout DP x GA with expert-parallel size EP (step groups of EP consecutive
data-parallel ranks; 8 ranks per node unless ``--ranks-per-node``), draws global batches
from a packed mixture and places each twice with ``plan_placement``: without step groups
(today's placement: every rank meets every micro-step) and with ``step_groups=``. Both are
measured on the same figures:

* ``objective``: the group objective (the slowest group's sum over micro-steps of its
  slowest rank; two-phase costs: vision and language maxima) over perfect balance (the
  mean rank total), mean over batches;
* ``moved``: the share of packs computed on another rank; ``inter-group``, ``inter-node``:
  the share computed in another step group, on another node;
* ``kept``: global batches whose delivered plan is the group plan (the rest: today's,
  which the group plan may not lose to on any figure).

Prints a table; nothing is asserted. Pure numpy: runs anywhere, e.g.

    nice -n 10 python benchmarks/bench_step_groups.py
    nice -n 10 python benchmarks/bench_step_groups.py --layouts 1024x32x8,1024x32x32 --batches 3
"""
from __future__ import annotations

import argparse

import numpy as np

from megatron_mm_balance.bench.pools import mixture_pool, print_head, two_phase_costs
from megatron_mm_balance.solver.placement import PlanStats, plan_placement
from megatron_mm_balance.solver.step_groups import group_objective, inter_group_packs
from megatron_mm_balance.solver.topology import node_of_each_rank

DEFAULT_LAYOUTS = "4x8x2,16x16x4,64x32x8,256x32x8,1024x32x8,1024x32x32"


def figures(c, placement, groups, node) -> dict:
    """The table's figures of one placement of costs ``c`` (``[D, G]`` or ``[D, G, 2]``)."""
    D, G = c.shape[:2]
    scalar = c.sum(axis=2) if c.ndim == 3 else c
    mean = scalar.sum() / D
    return {"objective": group_objective(placement.apply(c), groups) / mean,
            "moved": placement.moved().mean(),
            "inter-group": inter_group_packs(placement.src_rank, groups) / (D * G),
            "inter-node": inter_group_packs(placement.src_rank, node) / (D * G)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="DPxGAxEP, comma separated")
    ap.add_argument("--mixtures", default="heldout,native-res")
    ap.add_argument("--costs", default="two-phase,time",
                    help="two-phase ((vision, language) microseconds of vlm_30b_moe) and/or time "
                         "(their sum)")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    args = ap.parse_args(argv)
    cols = ("objective", "moved", "inter-group", "inter-node")
    head = (f"{'mixture':>10} {'cost':>9} {'DP x GA x EP':>14} | "
            + " | ".join(f"{k:>19}" for k in cols) + f" | {'kept':>5}")
    print("each cell: today's placement -> the group placement (mean over batches); "
          f"{args.ranks_per_node} ranks per node")
    print_head(head)
    for mix in args.mixtures.split(","):
        pool = mixture_pool(mix, 40_000)
        pairs = two_phase_costs(pool)
        for spec in args.layouts.split(","):
            D, G, ep = (int(x) for x in spec.split("x"))
            rpn = min(args.ranks_per_node, D)
            labels = [r // ep for r in range(D)]
            groups = np.array(labels)
            node = node_of_each_rank(D, rpn)
            rng = np.random.default_rng([D, G, ep])
            picks = [rng.integers(0, len(pool), size=(D, G)) for _ in range(args.batches)]
            for kind in args.costs.split(","):
                sums = {"today": {k: 0.0 for k in cols}, "group": {k: 0.0 for k in cols}}
                kept = 0
                for idx in picks:
                    c = pairs[idx] if kind == "two-phase" else pairs[idx].sum(axis=2)
                    today = plan_placement(c, ranks_per_node=rpn)
                    group = plan_placement(c, ranks_per_node=rpn, step_groups=labels)
                    for name, pl in (("today", today), ("group", group)):
                        for k, v in figures(c, pl, groups, node).items():
                            sums[name][k] += v / len(picks)
                    kept += not (np.array_equal(group.src_rank, today.src_rank)
                                 and np.array_equal(group.src_index, today.src_index))
                cells = [f"{sums['today'][k]:>8.4f} -> {sums['group'][k]:<7.4f}" if k == "objective"
                         else f"{sums['today'][k]:>7.1%} -> {sums['group'][k]:<7.1%}" for k in cols]
                print(f"{mix:>10} {kind:>9} {f'{D}x{G}x{ep}':>14} | " + " | ".join(cells)
                      + f" | {kept:>2}/{len(picks)}", flush=True)


if __name__ == "__main__":
    main()
