"""Node-aware against flat placement, batch by batch: packs crossing nodes and balance.

For each node layout, sync mode and cost kind, draws ``--batches`` global batches in turn
from ``numpy.random.default_rng(--seed)`` (``integers(0, 8, size=shape) * 256``:
tile-quantised image tokens, many ties), plans each with and without the nodes
(``plan_placement``) and counts, against the flat plan of the same batch, the batches
where the node-aware plan crosses fewer, as many and more packs between nodes
(``topology.traffic``), and those with a better and a worse balance (micro-step
objective, then the heaviest rank's excess over the limit). The node-aware plan never
has a worse balance, and at an equal balance never more packs across
(solver/node_choice.py): "more, no better" (more packs across at a balance no better
than flat's) is 0.

    python benchmarks/bench_node_crossings.py            # the table of docs/notes/2026-12-02-several-nodes-megatron.md
"""
from __future__ import annotations

import argparse

import numpy as np

from megatron_mm_balance.bench.pools import print_head
from megatron_mm_balance.solver.placement import plan_placement
from megatron_mm_balance.solver.rank_balance import cost_grain, rank_limit
from megatron_mm_balance.solver.topology import traffic

#: (layout name, node of each rank, micro-steps)
LAYOUTS = [("4x2 [0,0,1,1]", (0, 0, 1, 1), 2), ("4x2 cyclic [0,1,0,1]", (0, 1, 0, 1), 2),
           ("5x3 uneven [0,0,0,1,1]", (0, 0, 0, 1, 1), 3), ("6x4 [0,1,1,2,2,2]", (0, 1, 1, 2, 2, 2), 4)]


def balance(c: np.ndarray, pl, sync: str, tolerance: float) -> tuple[int, int]:
    """(objective, excess of the heaviest rank over the limit); objective 0 in step mode."""
    w = c.sum(axis=2) if c.ndim == 3 else c
    objective = 0 if sync == "step" else int(c[pl.src_rank, pl.src_index].max(axis=0).sum())
    limit = rank_limit(int(w.sum()), w.shape[0], tolerance, cost_grain(w))
    return objective, max(int(w[pl.src_rank, pl.src_index].sum(axis=1).max()) - limit, 0)


def compare(ids, G: int, sync: str, two_phase: bool, batches: int, seed: int, tolerance: float) -> dict:
    rng = np.random.default_rng(seed)
    D = len(ids)
    out = dict(fewer=0, same=0, more=0, better=0, worse=0, more_no_better=0, flat=0, aware=0)
    for _ in range(batches):
        c = rng.integers(0, 8, size=(D, G, 2) if two_phase else (D, G)) * 256
        flat = plan_placement(c, sync=sync, balance_tolerance=tolerance)
        aware = plan_placement(c, sync=sync, balance_tolerance=tolerance, ranks_per_node=list(ids))
        xf = traffic(flat.src_rank, list(ids))["inter_node_packs"]
        xa = traffic(aware.src_rank, list(ids))["inter_node_packs"]
        bf, ba = balance(c, flat, sync, tolerance), balance(c, aware, sync, tolerance)
        out["fewer" if xa < xf else "same" if xa == xf else "more"] += 1
        out["better"] += ba < bf
        out["worse"] += ba > bf
        out["more_no_better"] += xa > xf and not ba < bf
        out["flat"] += xf
        out["aware"] += xa
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.001)
    args = ap.parse_args(argv)
    print(f"{args.batches} batches per row, rng seed {args.seed}, costs integers(0, 8) * 256, "
          f"tolerance {args.tolerance}")
    head = (f"{'layout':>24} {'sync':>9} {'costs':>9} | {'fewer':>6} {'same':>6} {'more':>5} | "
            f"{'balance better':>14} {'worse':>5} | {'more, no better':>15} | {'inter-node packs flat':>21} "
            f"{'aware':>6}")
    print_head(head)
    for name, ids, G in LAYOUTS:
        for sync in ("microstep", "step"):
            for two in (False, True):
                r = compare(ids, G, sync, two, args.batches, args.seed, args.tolerance)
                print(f"{name:>24} {sync:>9} {'two-phase' if two else 'scalar':>9} | {r['fewer']:>6} "
                      f"{r['same']:>6} {r['more']:>5} | {r['better']:>14} {r['worse']:>5} | "
                      f"{r['more_no_better']:>15} | {r['flat']:>21} {r['aware']:>6}", flush=True)


if __name__ == "__main__":
    main()
