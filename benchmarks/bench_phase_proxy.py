"""The performance-v2 issue's quick two-phase proxy, on a named mixture or trace.

Per global batch of ``D x G`` packs drawn from the simulator's packed pool, each
pack costs (vision fwd + bwd, language phase) under a timing model. A grouping of
the packs into G micro-steps of D costs ``sum_m (max V + max L)``; the table gives
it over the perfectly balanced work ``(sum V + sum L) / D`` for: no balancing (the
draw order), sorted grouping by vision + language (the scalar time cost), by
vision alone, the best weighted 1-D sort ``V + w L`` (w on a grid), the solver's
two-phase grouping (:func:`megatron_mm_balance.solver.two_phase.group_two_phase`), and
the lower bound (each phase at its own sorted-grouping optimum); plus the
correlation of the packs' vision and language costs. The issue quotes, on its own
held-out trace at DP=1024, GA=32: 1.656 / 1.129 / 1.086 / 1.086 / - / 1.020,
correlation -0.31. Use it to compare a mixture's imbalance with that trace's:

    python benchmarks/bench_phase_proxy.py heldout-real --dp 1024 --ga 32 --batches 4
"""
from __future__ import annotations

import argparse

import numpy as np

from megatron_mm_balance.bench.pools import two_phase_costs
from megatron_mm_balance.sim.cli import load_samples
from megatron_mm_balance.sim.pool import build_pool, draw_indices
from megatron_mm_balance.solver.two_phase import group_two_phase

WEIGHTS = np.round(np.arange(0.0, 2.01, 0.1), 2)


def grouping_cost(v, l, group, G):
    vm, lm = np.zeros(G), np.zeros(G)
    np.maximum.at(vm, group, v)
    np.maximum.at(lm, group, l)
    return float(vm.sum() + lm.sum())


def sorted_groups(key, D):
    group = np.empty(len(key), dtype=np.int64)
    group[np.argsort(-key, kind="stable")] = np.arange(len(key)) // D
    return group


def proxy(v, l, D, G):
    """Ratios to the balanced work for one batch (``v``, ``l`` flat, rank-major)."""
    ideal = (v.sum() + l.sum()) / D
    draw = np.tile(np.arange(G), D)                   # rank-major: micro-step = index % G
    weighted = min(grouping_cost(v, l, sorted_groups(v + w * l, D), G) for w in WEIGHTS)
    lb = np.sort(v)[::-1][::D].sum() + np.sort(l)[::-1][::D].sum()
    return {
        "none": grouping_cost(v, l, draw, G) / ideal,
        "sum": grouping_cost(v, l, sorted_groups(v + l, D), G) / ideal,
        "vision": grouping_cost(v, l, sorted_groups(v, D), G) / ideal,
        "weighted": weighted / ideal,
        "two-phase": grouping_cost(v, l, group_two_phase(v, l, D, G), G) / ideal,
        "lower bound": lb / ideal,
        "corr": float(np.corrcoef(v, l)[0, 1]),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="trace file or built-in mixture name")
    ap.add_argument("--dp", type=int, default=1024)
    ap.add_argument("--ga", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--timing", default="vlm_30b_moe")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--pool-samples", type=int, default=30_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    samples, key, desc = load_samples(a.trace, seed=a.seed)
    samples = samples[: a.pool_samples] if a.pool_samples else samples
    pool = build_pool(samples, a.seq_len, cache_key=(*key, a.pool_samples))
    pairs = two_phase_costs(pool, a.timing)
    idx = draw_indices(len(pool), a.batches, a.dp, a.ga, seed=a.seed, mode="iid")
    costs = [pairs[i].astype(float) for i in idx.reshape(a.batches, -1)]   # [D*G, 2]
    rows = [proxy(c[:, 0], c[:, 1], a.dp, a.ga) for c in costs]
    print(f"{desc}, {a.timing}, DP={a.dp}, GA={a.ga}, {a.batches} batches (mean)")
    for k in rows[0]:
        print(f"  {k:12s} {np.mean([r[k] for r in rows]):.3f}")


if __name__ == "__main__":
    main()
