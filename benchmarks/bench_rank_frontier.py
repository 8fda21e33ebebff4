"""Rank-balance frontier: worst rank ratio against packs moved, over tolerances.

For each trace, shape and ``balance_tolerance`` in ``--tolerances``, places
``--batches`` global batches of image-token costs (``microstep`` mode, the
delivered plan, ``--ranks-per-node``, default 8) drawn from the packed trace, and
prints the worst rank ratio (heaviest rank total over the mean) next to the worst
batch's integer floor (the mean rounded up to a multiple of the costs' greatest
common divisor: no placement does better), the batches above
``max(1 + tolerance, floor)``, the moved fraction (worst batch and mean) and the
solver's CPU time; "inter": the mean fraction of packs that change node at 8 ranks
per node (with ``--ranks-per-node 1``, the flat placement's). Every row of a (trace, shape) sees the same batches. The
micro-step objective is checked to stay at its exact optimum in every batch.

``mixed`` is tile-quantised (every cost a multiple of 256); ``heldout-real`` and
``heldout`` are the held-out mixtures (captions of 576 and frames of 64 tokens).

    taskset -c 0 python benchmarks/bench_rank_frontier.py
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from megatron_mm_balance.bench.pools import image_token_costs, mixture_pool, parse_shapes, print_head
from megatron_mm_balance.solver import placement
from megatron_mm_balance.solver.placement import DEFAULT_BALANCE_TOLERANCE, PlanStats, plan_placement
from megatron_mm_balance.solver.rank_balance import cost_grain, rank_limit
from megatron_mm_balance.solver.topology import traffic


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="heldout-real,heldout,mixed")
    ap.add_argument("--shapes", default="64x16,512x16,1024x16,4096x32")
    ap.add_argument("--tolerances", default="0.0003,0.0005,0.001,0.002,0.005")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--ranks-per-node", type=int, default=8, help="1 = flat")
    ap.add_argument("--samples", type=int, default=40_000)
    ap.add_argument("--stage2-min-band", type=float, default=None,
                    help="override placement.STAGE2_MIN_BAND (0: the solver before the floor)")
    a = ap.parse_args(argv)
    if a.stage2_min_band is not None:
        placement.STAGE2_MIN_BAND = a.stage2_min_band
    rpn = a.ranks_per_node if a.ranks_per_node > 1 else None
    tols = [float(t) for t in a.tolerances.split(",")]
    print(f"{a.batches} global batches per row; image-token costs; microstep; ranks per node "
          f"{rpn or 'flat'}; default tolerance {DEFAULT_BALANCE_TOLERANCE}; stage-2 min band "
          f"{placement.STAGE2_MIN_BAND}; "
          f"cpu affinity {sorted(os.sched_getaffinity(0))}")
    hdr = (f"{'trace':>12} {'DP x GA':>8} {'tol':>7} | {'rank max':>8} {'floor':>7} {'>band':>5} | "
           f"{'moved max':>9} {'mean':>6} {'inter':>6} | {'p50 ms':>7}")
    print_head(hdr)
    for trace in a.traces.split(","):
        pool = image_token_costs(mixture_pool(trace, a.samples))
        for D, G in parse_shapes(a.shapes):
            shape = f"{D}x{G}"
            rng = np.random.default_rng([D, G])
            batches = [pool[rng.integers(0, len(pool), size=(D, G))] for _ in range(a.batches)]
            for tol in tols:
                ratio, floor, over, moved, inter, ms = [], [], 0, [], [], []
                for c in batches:
                    t0 = time.process_time()
                    pl = plan_placement(c, balance_tolerance=tol, ranks_per_node=rpn)
                    ms.append((time.process_time() - t0) * 1e3)
                    st = PlanStats.of(c, pl)
                    if st.microstep_cost_after != st.microstep_optimum:
                        raise AssertionError(f"{trace} {shape} tol {tol}: objective above the optimum")
                    total = int(c.sum())
                    floor.append(rank_limit(total, D, 0.0, cost_grain(c)) / (total / D))
                    over += st.rank_total_max_after > rank_limit(total, D, tol, cost_grain(c))
                    ratio.append(st.rank_ratio)
                    moved.append(st.moved_fraction)
                    inter.append(traffic(pl.src_rank, 8)["inter_node_packs"] / c.size)
                print(f"{trace:>12} {shape:>8} {tol:>7g} | {max(ratio):>8.5f} {max(floor):>7.5f} "
                      f"{over:>5} | {max(moved):>9.3f} {np.mean(moved):>6.3f} {np.mean(inter):>6.3f} | "
                      f"{np.median(ms):>7.1f}", flush=True)


if __name__ == "__main__":
    main()
