"""How much lower can a grouping of whole packs go than the solver's? A box descent.

    python benchmarks/bench_grouping_descent.py [--trace heldout-real] [--dp 64] [--ga 32] [--batches 2]

A grouping of a global batch's packs into micro-steps costs ``sum_m (max V + max L)``;
what matters of micro-step ``m`` is its *box* ``(max V, max L)``. Given boxes, whether the
packs can be dealt ``D`` per box, each inside its box, is a bipartite b-matching: a max
flow (scipy). Starting from the solver's grouping (``plan_placement``, two-phase
``vlm_30b_moe`` costs), every box in turn is lowered, one coordinate at a time, to the
lowest pack value at which the packs still fit (bisection on the flow), until no box
moves. Printed per batch, over perfect balance: the certified floor of whole packs
(``solver/floors.py``), the solver's objective and the descent's. A descent that finds
little says the solver's grouping has no slack that lowering one micro-step's maximum
can take; it proves nothing about groupings far from it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mm_balance.bench.pools import mixture_pool, two_phase_costs  # noqa: E402
from megatron_mm_balance.sim.pool import draw_indices  # noqa: E402
from megatron_mm_balance.solver.floors import batch_floors  # noqa: E402
from megatron_mm_balance.solver.placement import plan_placement  # noqa: E402


def fits(v, l, D, V, L) -> bool:
    """Can the packs be dealt ``D`` per box ``(V[m], L[m])``, each inside its box?"""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow
    N, G = len(v), len(V)
    ok = (v[:, None] <= V[None, :]) & (l[:, None] <= L[None, :])
    if not ok.any(axis=1).all():
        return False
    p, g = np.nonzero(ok)
    sink = N + G + 1
    rows = np.concatenate([np.zeros(N, int), 1 + p, N + 1 + np.arange(G)])
    cols = np.concatenate([1 + np.arange(N), N + 1 + g, np.full(G, sink)])
    caps = np.concatenate([np.ones(N + len(p), np.int32), np.full(G, D, np.int32)])
    graph = csr_matrix((caps, (rows, cols)), shape=(sink + 1, sink + 1))
    return maximum_flow(graph, 0, sink).flow_value == N


def descend(v, l, D, V, L):
    """Lower every box coordinate to the least pack value that keeps the packs fitting."""
    V, L = V.copy(), L.copy()
    values = (np.unique(v), np.unique(l))
    moved = True
    while moved:
        moved = False
        for m in np.argsort(-(V + L), kind="stable"):
            for arr, vals in ((V, values[0]), (L, values[1])):
                lo, hi, was = 0, int(np.searchsorted(vals, arr[m])), arr[m]
                while lo < hi:
                    mid = (lo + hi) // 2
                    arr[m] = vals[mid]
                    if fits(v, l, D, V, L):
                        hi = mid
                    else:
                        lo = mid + 1
                arr[m] = vals[hi]
                moved |= bool(arr[m] < was)
    return V, L


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="heldout-real")
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--ga", type=int, default=32)
    ap.add_argument("--batches", type=int, default=2)
    args = ap.parse_args(argv)
    D, G = args.dp, args.ga
    pool = mixture_pool(args.trace, 30_000)
    costs = two_phase_costs(pool)
    idx = draw_indices(len(pool), args.batches, D, G, seed=0)
    print(f"{args.trace}, DP={D} x GA={G}, vlm_30b_moe two-phase costs; over perfect balance")
    for b in range(args.batches):
        c = costs[idx[b]]
        v, l = c[..., 0].ravel().astype(np.int64), c[..., 1].ravel().astype(np.int64)
        fl = batch_floors(v, l, np.zeros_like(v), D)
        pl = plan_placement(c, sync="microstep")
        placed = c.reshape(-1, 2)[(pl.src_rank * G + pl.src_index).ravel()].reshape(D, G, 2)
        V0, L0 = placed[..., 0].max(axis=0), placed[..., 1].max(axis=0)
        t0 = time.perf_counter()
        V, L = descend(v, l, D, V0, L0)
        print(f"batch {b}: floor of whole packs {fl.packs / fl.perfect:.4f}, solver "
              f"{(V0.sum() + L0.sum()) / fl.perfect:.4f}, box descent {(V.sum() + L.sum()) / fl.perfect:.4f} "
              f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
