"""Per-round and per-iteration gains of a ``mm-balance bench-realpath --json REPORT`` run.

The report's headline gain compares median iterations over all rounds. Every mode reads
the same global batches at the same iteration, so two steadier readings exist: the sum of
the measured iterations (the first ``--warmup`` dropped), per round and over all rounds,
and the median over iterations of each iteration's ``off / mode - 1``. Prints both, with the
predicted gains beside them:

    python benchmarks/bench_report_rounds.py /tmp/bench/report.json [--warmup 2]
"""
from __future__ import annotations

import argparse
import json
import statistics


def iteration_times(report: dict, mode: str, warmup: int) -> dict:
    """``{(round, iteration): ms}`` of a mode's measured iterations."""
    return {(run["round"], int(k)): v for run in report["modes"][mode]["runs"]
            for k, v in run["elapsed_ms"].items() if int(k) > warmup}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    report = json.load(open(a.report))
    off = iteration_times(report, "off", a.warmup)
    rounds = sorted({r for r, _ in off})
    print(f"{'mode':<8} {'sum s':>7} {'gain':>7}   per round (sum)          paired per iteration: median [IQR] (n)")
    for mode in report["modes"]:
        x = iteration_times(report, mode, a.warmup)
        keys = [k for k in off if k in x]
        total_off, total = sum(off[k] for k in keys), sum(x[k] for k in keys)
        per_round = " / ".join(
            f"{100 * (sum(off[k] for k in keys if k[0] == r) / sum(x[k] for k in keys if k[0] == r) - 1):+.1f}"
            for r in rounds)
        ratios = sorted(off[k] / x[k] - 1 for k in keys)
        q = len(ratios) // 4
        print(f"{mode:<8} {total / 1e3:7.1f} {100 * (total_off / total - 1):+6.1f}%   {per_round:<24} "
              f"{100 * statistics.median(ratios):+.1f}% [{100 * ratios[q]:+.1f}..{100 * ratios[-q - 1]:+.1f}] ({len(ratios)})")
    p = report.get("predicted") or {}
    if p:
        print(f"predicted from the off runs' per-pack timings: our placement {100 * p['placement_gain']:+.1f}%, "
              f"perfect balance {100 * p['perfect_gain']:+.1f}%")


if __name__ == "__main__":
    main()
