"""The two-phase grouping against the exact optimum and the lower bound (small instances).

For each mixture and shape ``D x G`` in ``--shapes``, draws ``--instances`` global
batches of packs from the simulator's packed pool (costs: ``vlm_30b_moe`` vision
and language microseconds, as the simulator's two-phase balance cost), and
compares on each:

* the solver's grouping (:func:`megatron_mm_balance.solver.two_phase.group_two_phase`);
* the exact optimum of the same objective (:mod:`megatron_mm_balance.solver.exact`,
  a MILP solved by HiGHS within ``--time-limit`` seconds; instances it does not
  prove optimal are counted and left out of the gap columns);
* the lower bound (each phase at its own sorted-grouping optimum).

Columns: "opt" instances proven optimal / drawn; "heur/exact" mean and max of the
grouping's objective over the optimum; ">1%" instances whose gap exceeds 1%;
"exact/LB" mean of the optimum over the lower bound; "heur/bound" mean and max of the
grouping over the MILP's proven lower bound on every instance, proven or not (at sizes the
MILP cannot close within the limit, an upper bound on the grouping's gap to the optimum);
MILP seconds p50 / max. Needs scipy.

    python benchmarks/bench_exact_two_phase.py --instances 10
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_mm_balance.bench.pools import mixture_pool, parse_shapes, print_head, two_phase_costs
from megatron_mm_balance.solver.exact import exact_two_phase_grouping
from megatron_mm_balance.solver.two_phase import (_grouping_objective, group_two_phase,
                                                  two_phase_lower_bound)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="heldout-real,mixed,video-heavy")
    ap.add_argument("--shapes", default="4x4,8x4,4x8,16x2")
    ap.add_argument("--instances", type=int, default=10)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--timing", default="vlm_30b_moe")
    ap.add_argument("--samples", type=int, default=20_000)
    a = ap.parse_args(argv)
    print(f"{a.instances} instances per row; costs: {a.timing} (vision, language) us; "
          f"MILP time limit {a.time_limit:g} s")
    hdr = (f"{'trace':>12} {'D x G':>6} | {'opt':>6} | {'heur/exact mean':>15} {'max':>7} {'>1%':>4} | "
           f"{'exact/LB':>8} {'heur/LB':>8} | {'heur/bound':>10} {'max':>7} | {'MILP s p50':>10} {'max':>6}")
    print_head(hdr)
    for trace in a.traces.split(","):
        pairs = two_phase_costs(mixture_pool(trace, first=a.samples), a.timing)
        for D, G in parse_shapes(a.shapes):
            shape = f"{D}x{G}"
            rng = np.random.default_rng([D, G, 7])
            gaps, lbs, hlbs, hbounds, secs, proven = [], [], [], [], [], 0
            for _ in range(a.instances):
                c = pairs[rng.integers(0, len(pairs), size=D * G)]
                v, l = c[:, 0], c[:, 1]
                heur = _grouping_objective(v, l, group_two_phase(v, l, D, G), G)
                lb = two_phase_lower_bound(c.reshape(D, G, 2))
                t0 = time.process_time()
                ex = exact_two_phase_grouping(v, l, D, G, time_limit=a.time_limit)
                secs.append(time.process_time() - t0)
                hlbs.append(heur / lb)
                hbounds.append(heur / max(ex.bound, lb))
                if ex.optimal:
                    proven += 1
                    gaps.append(heur / ex.objective)
                    lbs.append(ex.objective / lb)
            g = np.array(gaps) if gaps else np.array([np.nan])
            print(f"{trace:>12} {shape:>6} | {proven:>2} / {a.instances:<2} | {g.mean():>15.4f} "
                  f"{g.max():>7.4f} {int((g > 1.01).sum()):>4} | "
                  f"{np.mean(lbs) if lbs else np.nan:>8.4f} {np.mean(hlbs):>8.4f} | "
                  f"{np.mean(hbounds):>10.4f} {np.max(hbounds):>7.4f} | "
                  f"{np.median(secs):>10.1f} {np.max(secs):>6.1f}", flush=True)


if __name__ == "__main__":
    main()
