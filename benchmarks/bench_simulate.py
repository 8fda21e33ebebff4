"""Speed of ``mm-balance simulate`` at production scale, on one CPU core.

Target (issue 4): DP=4096, GA=32, 50 global batches (6.5 M pack slots per
strategy) in under 60 s on one core, all strategies (4 budgets included).

    python3 benchmarks/bench_simulate.py [--timing vlm_30b_moe] [--batches 50]

Pins itself to one core and single-threaded numpy before importing it, runs the
CLI in-process and prints a table of where the time went.
"""
import os
import sys

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_mm_balance.sim.cli import main  # noqa: E402


def bench() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timing", default="vlm_30b_moe")
    ap.add_argument("--batches", default="50")
    ap.add_argument("--trace", default="mixed")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        rc = main(["simulate", a.trace, "--dp", "4096", "--ga", "32", "--seq-len", "8192",
                   "--sync", "microstep", "--timing", a.timing, "--batches", a.batches,
                   "--out", out, "--no-progress"])
        wall = time.perf_counter() - t0
        if rc:
            return rc
        meta = json.load(open(os.path.join(out, "report.json")))["meta"]
        runs = json.load(open(os.path.join(out, "report.json")))["runs"]
    el = meta["elapsed_s"]
    solver = [r["solver_ms_p50"] for r in runs if "solver_ms_p50" in r]
    print("\n| phase | seconds |\n|---|---|")
    print(f"| packing (1D + {len(meta['config']['budgets'])} budgets, "
          f"{meta['pools']['greedy']['samples']} samples) | {el['packing']:.1f} |")
    print(f"| simulation ({len(runs)} runs x 4096 x 32 x {a.batches}) | {el['simulation']:.1f} |")
    print(f"| total incl. trace, plots, report | {wall:.1f} |")
    print(f"\nsolver p50 {solver[0]:.0f} ms per global batch; target: total < 60 s on one core: "
          f"{'met' if wall < 60 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(bench())
