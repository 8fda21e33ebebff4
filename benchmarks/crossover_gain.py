"""Balancing's gain measured inside the same jobs: the crossover runs of a real-path bench.

    python benchmarks/crossover_gain.py OUT [--warmup 2] [--pair crossover|images-crossover|groups-crossover]

``OUT`` is a ``mm-balance bench-realpath [--bridge] --modes crossover-even,crossover-odd --out OUT``
directory. What it reads and computes: :mod:`megatron_mm_balance.bench.crossover`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from megatron_mm_balance.bench.crossover import PAIRS, PARITIES, CrossoverError, report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pair", choices=PAIRS, default=PAIRS[0],
                    help="which crossover runs: pack placement (crossover-*), packs and frames "
                         "(images-crossover-*), or the meeting groups' placement against today's "
                         "(groups-crossover-*)")
    a = ap.parse_args(argv)
    try:
        rep = report(Path(a.out), a.warmup, a.pair)
    except CrossoverError as exc:
        sys.exit(f"crossover_gain.py: {exc}")
    print(f"{a.pair}: balancing's gain inside the same jobs (the first {a.warmup} iterations dropped)")
    print("round   gain   even-iteration ratio  odd-iteration ratio  paired mean  iterations")
    for r in rep["rounds"]:
        print(f"{r['round']:>5} {r['gain']:+6.1%}   {r['ratios']['even']:19.3f}  {r['ratios']['odd']:19.3f}"
              f"  {r['paired_mean']:+10.1%}  {r['iterations']:>10}")
    gains = [r["gain"] for r in rep["rounds"]]
    spread = f" (rounds {min(gains):+.1%} to {max(gains):+.1%})" if len(gains) > 1 else ""
    print(f"all {len(gains)} rounds: {rep['gain']:+.1%}{spread}")
    if rep["wait_on_ms"] is not None:
        print(f"consumer wait per iteration: balanced {rep['wait_on_ms']:.1f} ms, "
              f"unbalanced (gather and plan only) {rep['wait_off_ms']:.1f} ms")
    if rep["against_off"]:
        cells = ", ".join(f"{k} {mean:.3f} ({n})" for k, (mean, n) in rep["against_off"].items())
        print(f"crossover iterations over the off runs' same iterations (mean ratio, iterations): {cells}")
    if rep["speeds"]:
        by_parity = {p: [v for (_, q), v in rep["speeds"].items() if q == p] for p in PARITIES}
        cells = ", ".join(f"{a.pair}-{p} {statistics.fmean(v):.3f}" for p, v in by_parity.items() if v)
        print(f"each job's language-model compute over the off job's, same iterations (its speed): {cells}")
    if rep["against_off_at_speed"]:
        cells = ", ".join(f"{k} {mean:.3f} ({n})" for k, (mean, n) in rep["against_off_at_speed"].items())
        print(f"  the same ratios with each job's speed divided out: {cells}")
    if rep["phases"]:
        print("where the time goes (ms per iteration and rank): iterations  vision  LM compute  waiting")
        for key, cell in rep["phases"].items():
            print(f"  {key:>10}  {cell['vision']:7.0f}  {cell['lm_compute']:10.0f}  {cell['waiting']:7.0f}")


if __name__ == "__main__":
    main()
