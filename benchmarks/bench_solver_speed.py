"""Solver time of the delivered plan, per cost kind and node awareness (performance v2).

For DP x GA in ``--shapes``, draws global batches from the packed ``heldout``
mixture (one set of batches per shape, shared by every column) and times
``placement.plan_placement`` with scalar costs (image tokens) and two-phase costs
(``vlm_30b_moe`` vision and language microseconds), flat and with 8 ranks per
node. Prints p50 and max CPU time per cell (CPU time: other jobs on a shared
machine do not count; on an idle core it equals wall time). ``--ep 8,32,0`` adds a row per
expert-parallel size (per-micro-step step groups of that many consecutive ranks,
``step_groups=``; 0: all ranks meet every micro-step, today's plan). Run on one core:

    nice -n 10 taskset -c 0 python benchmarks/bench_solver_speed.py
    nice -n 10 taskset -c 0 python benchmarks/bench_solver_speed.py --shapes 1024x32:5 --ep 0,8,32,1024
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from megatron_mm_balance.bench.pools import image_token_costs, mixture_pool, print_head, two_phase_costs
from megatron_mm_balance.solver.placement import plan_placement


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1024x16:7,4096x32:5", help="DPxGA:batches, comma separated")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--ep", default=None,
                    help="expert-parallel sizes, comma separated (0: no step groups): a row each")
    args = ap.parse_args(argv)
    eps = [None] if args.ep is None else [int(x) for x in args.ep.split(",")]
    pool = mixture_pool("heldout", 40_000)
    scalar, pairs = image_token_costs(pool), two_phase_costs(pool)
    rpn = args.ranks_per_node
    cols = [("scalar", None), ("scalar", rpn), ("two-phase", None), ("two-phase", rpn)]
    print(f"cpu affinity {sorted(os.sched_getaffinity(0))}; {len(pool)} packs of 'heldout'; "
          f"CPU ms of plan_placement, p50 / max")
    head = f"{'DP x GA':>10} | " + ("" if args.ep is None else f"{'EP':>5} | ") + " | ".join(f"{k + (', flat' if n is None else f', {n}/node'):>22}"
                                             for k, n in cols)
    print_head(head)
    for spec in args.shapes.split(","):
        shape, batches = spec.split(":")
        D, G = (int(x) for x in shape.split("x"))
        rng = np.random.default_rng([D, G])
        picks = [rng.integers(0, len(pool), size=(D, G)) for _ in range(int(batches))]
        for ep in eps:
            groups = None if not ep else [r // ep for r in range(D)]
            cells = []
            for kind, n in cols:
                ts = []
                for idx in picks:
                    c = scalar[idx] if kind == "scalar" else pairs[idx]
                    t0 = time.process_time()
                    plan_placement(c, ranks_per_node=n, step_groups=groups)
                    ts.append((time.process_time() - t0) * 1e3)
                cells.append(f"{np.median(ts):>9.1f} / {np.max(ts):>9.1f}")
            row = f"{shape:>10} | " + ("" if ep is None else f"{ep or D:>5} | ")
            print(row + " | ".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
