"""The training thread's own frame-exchange work in images mode, from a Bridge run's timing records.

    python benchmarks/images_exchange_work.py RUN/timing [RUN/timing ...] [--warmup 2]

Each ``images`` run of ``mm-balance bench-realpath --bridge`` (or any run with
``mm_balance.timing_dir``) writes one record per rank and micro-step whose ``details`` split
images mode's exchange where the micro-step's frames crossed the rank
(``runtime/image_exchange.py::FrameSteps``): in forward ``vision_exchange_ms`` (the tower's
balanced call, whole), of which ``vision_tower_ms`` (the tower's own calls) and
``vision_wait_ms`` (waiting for the outputs of the rank's moved frames); in backward
``vision_grad_exchange_ms`` (the gradients' transfers), of which ``vision_grad_wait_ms``
(waiting for them). The rest is the exchange's own work on the training thread: posting the
transfers, index copies, putting rows back in order. Prints, per run, per iteration and rank
(the iterations where frames crossed some rank, or with ``--all-iterations`` every one; the first
``--warmup`` dropped; mean over the ranks, and the largest rank): that own work, the waiting, the
tower's time inside the exchange, and the micro-steps whose frames crossed the rank.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from megatron_mm_balance.sim.run_trace import read_records


def exchange_work(timing_dir, warmup: int = 2, balanced_only: bool = True) -> dict:
    """Per iteration and rank, summed over its micro-steps (ms): ``own`` (the exchange's work
    outside the tower and the waits, forward and backward), ``wait`` (forward and backward),
    ``tower`` (the tower inside the balanced call), ``crossed`` (micro-steps whose frames crossed
    the rank); each as ``{"mean": over ranks and iterations, "max": the largest rank's mean}``.
    ``balanced_only``: over the iterations where frames crossed some rank (a crossover job
    balances every other iteration; an iteration where nothing crosses costs nothing)."""
    recs = read_records(str(timing_dir))
    if not recs:
        raise SystemExit(f"{timing_dir}: no timing records")
    first = min(r["iteration"] for r in recs) + warmup
    cells: dict = {}
    for r in recs:
        if r["iteration"] < first:
            continue
        d = r.get("details", {})
        cell = cells.setdefault((r["iteration"], r["rank"]), dict(own=0.0, wait=0.0, tower=0.0, crossed=0))
        if "vision_exchange_ms" in d:
            cell["crossed"] += 1
        wait = d.get("vision_wait_ms", 0.0) + d.get("vision_grad_wait_ms", 0.0)
        tower = d.get("vision_tower_ms", 0.0) if "vision_exchange_ms" in d else 0.0
        cell["own"] += d.get("vision_exchange_ms", 0.0) - tower - d.get("vision_wait_ms", 0.0) + \
            d.get("vision_grad_exchange_ms", 0.0) - d.get("vision_grad_wait_ms", 0.0)
        cell["wait"] += wait
        cell["tower"] += tower
    if not cells:
        raise SystemExit(f"{timing_dir}: no iteration after the first {warmup}")
    crossing = {it for (it, _), c in cells.items() if c["crossed"]}     # frames crossed some rank
    if balanced_only:
        cells = {key: c for key, c in cells.items() if key[0] in crossing}
    if not cells:
        raise SystemExit(f"{timing_dir}: no iteration after the first {warmup} where frames crossed a rank")
    ranks = sorted({rank for _, rank in cells})
    out = {"iterations": len({it for it, _ in cells}), "ranks": len(ranks)}
    for key in ("own", "wait", "tower", "crossed"):
        by_rank = [np.mean([c[key] for (_, rank), c in cells.items() if rank == r]) for r in ranks]
        out[key] = {"mean": float(np.mean(by_rank)), "max": float(np.max(by_rank))}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timing", nargs="+", help="timing directories of images runs")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--all-iterations", action="store_true",
                    help="average over every iteration, not only those where frames crossed some rank")
    a = ap.parse_args(argv)
    which = "every iteration" if a.all_iterations else "iterations where frames crossed some rank"
    print(f"per iteration and rank (ms; mean over ranks / largest rank); {which}; the first {a.warmup} dropped")
    print(f"{'run':<44} {'iters':>5} | {'own work':>13} | {'waiting':>13} | {'tower inside':>13} | "
          f"{'micro-steps crossed':>19}")
    for d in a.timing:
        s = exchange_work(Path(d), a.warmup, balanced_only=not a.all_iterations)
        name = str(Path(d).parent)[-44:]
        cell = lambda k: f"{s[k]['mean']:6.1f} / {s[k]['max']:4.1f}"  # noqa: E731
        print(f"{name:<44} {s['iterations']:>5} | {cell('own'):>13} | {cell('wait'):>13} | {cell('tower'):>13} | "
              f"{s['crossed']['mean']:10.1f} / {s['crossed']['max']:4.1f}")


if __name__ == "__main__":
    main()
