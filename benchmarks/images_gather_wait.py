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
import json
import statistics
from pathlib import Path


def records(timing_dir: Path) -> dict:
    """``{(iteration, micro-batch): [record of each rank]}`` of one run."""
    out: dict = {}
    for path in sorted(Path(timing_dir).glob("timing-rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out.setdefault((rec["iteration"], rec["microbatch"]), []).append(rec)
    return out


def split_gather(micro_steps: dict, warmup: int) -> dict:
    """Per-iteration sums over ranks of the gather, its collective part and the waiting, for
    micro-steps with and without frames, and the collective's per-micro-step figures."""
    sums = {kind: {"gather": 0.0, "collective": 0.0, "waiting": 0.0, "steps": 0} for kind in ("frames", "none")}
    collective = []
    iterations = set()
    for (it, _mb), recs in micro_steps.items():
        if it <= warmup:
            continue
        gathers = [r.get("details", {}).get("vision_gather_ms") for r in recs]
        if any(g is None for g in gathers):
            continue
        iterations.add(it)
        kind = "frames" if any(r.get("grids") for r in recs) else "none"
        low = min(gathers)
        sums[kind]["gather"] += sum(gathers)
        sums[kind]["collective"] += low * len(gathers)
        sums[kind]["waiting"] += sum(g - low for g in gathers)
        sums[kind]["steps"] += 1
        collective.append(low)
    n = max(len(iterations), 1)
    for kind in sums:
        for key in ("gather", "collective", "waiting", "steps"):
            sums[kind][key] /= n
    return dict(iterations=len(iterations), per_iteration=sums,
                collective_p50=statistics.median(collective) if collective else float("nan"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timing", nargs="+", help="timing directories of images runs")
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    print(f"per iteration, summed over ranks (ms); iterations <= {a.warmup} dropped")
    print(f"{'run':<40} {'iters':>5} | {'frames: gather':>14} {'collective':>10} {'waiting':>8} | "
          f"{'none: gather':>12} {'collective':>10} {'waiting':>8} {'steps':>5} | {'coll. p50':>9}")
    for d in a.timing:
        s = split_gather(records(Path(d)), a.warmup)
        f, z = s["per_iteration"]["frames"], s["per_iteration"]["none"]
        name = str(Path(d).parent)[-40:]
        print(f"{name:<40} {s['iterations']:>5} | {f['gather']:14.1f} {f['collective']:10.1f} {f['waiting']:8.1f} | "
              f"{z['gather']:12.1f} {z['collective']:10.1f} {z['waiting']:8.1f} {z['steps']:5.1f} | "
              f"{s['collective_p50']:9.2f}")


if __name__ == "__main__":
    main()
