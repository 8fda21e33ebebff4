"""The language model's time at each micro-step of an iteration, per mode of a Bridge bench run.

    python benchmarks/lm_by_microstep.py OUT [--modes off,packs,images] [--warmup 2]

``OUT`` is a ``mm-balance bench-realpath --bridge --out OUT`` directory; every run of a mode
(``roundR-MODE/timing``) holds one record per rank and micro-step. Every pack costs the
language model the same (full 1,024-token sequences), and at each micro-step the rank that
reached the language model last waited least in its expert-parallel collectives, so the
smaller of the ranks' ``lm_forward_ms + lm_backward_ms`` is the language model's own time.
Prints its mean at each micro-step index (over the measured iterations of every round), and
the forward and backward parts: a mode whose language model runs slower at some micro-steps
than ``off`` at the same work shows where, in the iteration, something else took the cores.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def micro_steps(run: Path, warmup: int) -> dict:
    """``{(iteration, micro-batch): [records of each rank]}`` of one run's timing records."""
    out: dict = {}
    for path in sorted((run / "timing").glob("timing-rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["iteration"] > warmup:
                out.setdefault((rec["iteration"], rec["microbatch"]), []).append(rec)
    return out


def lm_by_index(runs, warmup: int) -> dict:
    """Mean over micro-steps at each index of the least rank's language-model time, and of its
    forward and backward (each the least over ranks)."""
    sums: dict = {}
    for run in runs:
        for (_it, mb), recs in micro_steps(Path(run), warmup).items():
            row = sums.setdefault(mb, [0.0, 0.0, 0.0, 0])
            row[0] += min(r["lm_forward_ms"] + r["lm_backward_ms"] for r in recs)
            row[1] += min(r["lm_forward_ms"] for r in recs)
            row[2] += min(r["lm_backward_ms"] for r in recs)
            row[3] += 1
    return {mb: dict(lm=t / n, forward=f / n, backward=b / n, n=n) for mb, (t, f, b, n) in sorted(sums.items())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--modes", default="off,packs,images")
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    out = Path(a.out)
    print(f"language model ms per micro-step (the least rank's forward + backward; iterations <= {a.warmup} "
          "dropped), by micro-step index; then the iteration's sum")
    for mode in a.modes.split(","):
        runs = sorted(p for p in out.glob(f"round*-{mode}") if (p / "timing").is_dir())
        if not runs:
            print(f"{mode:<11} no runs")
            continue
        rows = lm_by_index(runs, a.warmup)
        cells = " ".join(f"{r['lm']:6.1f}" for r in rows.values())
        print(f"{mode:<11} {cells} | {sum(r['lm'] for r in rows.values()):7.1f}  ({len(runs)} runs)")
        print(f"{'  forward':<11} " + " ".join(f"{r['forward']:6.1f}" for r in rows.values()))
        print(f"{'  backward':<11} " + " ".join(f"{r['backward']:6.1f}" for r in rows.values()))


if __name__ == "__main__":
    main()
