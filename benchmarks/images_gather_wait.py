"""Where images mode's unit-table all-gather spends its time, from a Bridge run's timing records.

    python benchmarks/images_gather_wait.py RUN/timing [RUN/timing ...] [--warmup 2]

Each ``images`` run of ``mm-balance bench-realpath --bridge`` writes one record per rank and
micro-step (``timing/timing-rank*.jsonl``) whose ``details`` hold ``vision_gather_ms``: the
rank's time in the unit table's all-gather, from its call to the table on its host. At each
micro-step the last rank to arrive waits for nobody, so the smallest of the ranks' figures is
the collective itself (its latency and the copy of the table), and each rank's figure above it
is waiting for a later rank. Prints, per run and per iteration (the first ``--warmup``
iterations dropped), summed over the ranks: the gather, the collective's part and the waiting,
for micro-steps with frames on some rank and for those with none anywhere, and the collective's
median per micro-step.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from megatron_mm_balance.sim.run_trace import load_run


def _per_step(run, value) -> np.ndarray:
    """``[I, G, D]``: ``value(record)`` at every iteration, micro-step and rank."""
    return np.array([[[value(r) for r in per_rank] for per_rank in iteration]
                     for iteration in run.records], dtype=np.float64).transpose(0, 2, 1)


def split_gather(timing_dir, warmup: int) -> dict:
    """Per-iteration sums over ranks of the gather, its collective part and the waiting, for
    micro-steps with and without frames (the run's complete iterations after the first
    ``warmup``, ``load_run``), and the collective's per-micro-step median."""
    run = load_run(str(timing_dir), skip_iterations=warmup)
    gather = _per_step(run, lambda r: r.get("details", {}).get("vision_gather_ms", np.nan))
    frames = _per_step(run, lambda r: bool(r.get("grids"))).any(axis=2)
    timed = ~np.isnan(gather).any(axis=2)                        # every rank timed its gather
    steps, with_frames = gather[timed], frames[timed]            # [S, D], [S]
    low = steps.min(axis=1, keepdims=True)                       # the last to arrive: the collective
    iterations = max(int(timed.any(axis=1).sum()), 1)
    sums = {}
    for kind, chosen in (("frames", with_frames), ("none", ~with_frames)):
        g, c = steps[chosen], low[chosen]
        sums[kind] = {"gather": float(g.sum()) / iterations, "collective": float(c.sum()) * g.shape[1] / iterations,
                      "waiting": float((g - c).sum()) / iterations, "steps": int(chosen.sum()) / iterations}
    return dict(iterations=int(timed.any(axis=1).sum()), per_iteration=sums,
                collective_p50=float(np.median(low)) if low.size else float("nan"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timing", nargs="+", help="timing directories of images runs")
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    print(f"per iteration, summed over ranks (ms); the first {a.warmup} iterations dropped")
    print(f"{'run':<40} {'iters':>5} | {'frames: gather':>14} {'collective':>10} {'waiting':>8} | "
          f"{'none: gather':>12} {'collective':>10} {'waiting':>8} {'steps':>5} | {'coll. p50':>9}")
    for d in a.timing:
        s = split_gather(Path(d), a.warmup)
        f, z = s["per_iteration"]["frames"], s["per_iteration"]["none"]
        name = str(Path(d).parent)[-40:]
        print(f"{name:<40} {s['iterations']:>5} | {f['gather']:14.1f} {f['collective']:10.1f} {f['waiting']:8.1f} | "
              f"{z['gather']:12.1f} {z['collective']:10.1f} {z['waiting']:8.1f} {z['steps']:5.1f} | "
              f"{s['collective_p50']:9.2f}")


if __name__ == "__main__":
    main()
