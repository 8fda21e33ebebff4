"""Fingerprints of the delivered plan over many shapes and cost kinds (refactor check).

A refactor of the solver that claims "same placements" is checked by running this
script before and after it and comparing the output line by line: one SHA-256 of
``plan_placement``'s ``(src_rank, src_index)`` per case, and one over all cases.

Cases: shapes from 2 x 2 to 1024 x 16; costs of four kinds (image tokens of the
packed ``heldout`` mixture, tile-quantised image tokens of ``mixed`` (multiples of
256), two-phase ``vlm_30b_moe`` (vision, language) microseconds of ``heldout``, and
tiny random integers 0-3, where almost every pack ties); both sync modes; flat, 4
and 8 ranks per node. The tolerance is passed explicitly (``--tolerance``), so a
change of the default does not show up as a change of placement.

    python benchmarks/placement_digests.py > before.txt   # ... change the solver ...
    python benchmarks/placement_digests.py > after.txt && diff before.txt after.txt
"""
from __future__ import annotations

import argparse
import hashlib

import numpy as np

from megatron_mm_balance.bench.pools import image_token_costs, mixture_pool, two_phase_costs
from megatron_mm_balance.solver.placement import plan_placement

SHAPES = [(2, 2), (3, 5), (8, 4), (16, 8), (64, 16), (1024, 16)]
SYNCS = ("microstep", "step")
NODES = (None, 4, 8)


def cost_pools(samples: int) -> dict:
    heldout = mixture_pool("heldout", samples)
    return {"scalar": image_token_costs(heldout),
            "tiles": image_token_costs(mixture_pool("mixed", first=samples)),
            "two-phase": two_phase_costs(heldout),
            "tiny": None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tolerance", type=float, default=0.002)
    ap.add_argument("--samples", type=int, default=20_000)
    args = ap.parse_args(argv)
    pools = cost_pools(args.samples)
    overall = hashlib.sha256()
    n = 0
    for kind, pool in pools.items():
        for D, G in SHAPES:
            rng = np.random.default_rng([D, G, len(kind)])
            if pool is None:
                c = rng.integers(0, 4, size=(D, G))
            else:
                c = pool[rng.integers(0, len(pool), size=(D, G))]
            for sync in SYNCS:
                for rpn in NODES:
                    pl = plan_placement(c, sync=sync, balance_tolerance=args.tolerance,
                                        ranks_per_node=rpn)
                    h = hashlib.sha256(pl.src_rank.tobytes() + pl.src_index.tobytes()).hexdigest()
                    overall.update(h.encode())
                    n += 1
                    print(f"{kind:>9} {D:>5}x{G:<3} {sync:>9} rpn={rpn or 'flat':<4} {h[:16]}",
                          flush=True)
    print(f"{n} placements, overall {overall.hexdigest()}")


if __name__ == "__main__":
    main()
