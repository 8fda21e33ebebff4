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
from pathlib import Path

import numpy as np

from megatron_mm_balance.sim.run_trace import load_run


def _least(traces, phase) -> np.ndarray:
    """``[iterations, G]``: at each micro-step, the least over ranks of ``phase(trace)``
    (an ``[I, D, G]`` array), the runs' iterations one after another."""
    return np.concatenate([phase(t).min(axis=1) for t in traces])


def lm_by_index(runs, warmup: int) -> dict:
    """Mean over the runs' measured iterations (``load_run``: the first ``warmup`` dropped), at
    each micro-step index, of the least rank's language-model time, and of its forward and
    backward (each the least over ranks)."""
    traces = [load_run(str(Path(run) / "timing"), skip_iterations=warmup) for run in runs]
    lm = _least(traces, lambda t: t.lf + t.lb)
    forward, backward = _least(traces, lambda t: t.lf), _least(traces, lambda t: t.lb)
    return {g: dict(lm=float(lm[:, g].mean()), forward=float(forward[:, g].mean()),
                    backward=float(backward[:, g].mean()), n=len(lm)) for g in range(lm.shape[1])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--modes", default="off,packs,images")
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    out = Path(a.out)
    print(f"language model ms per micro-step (the least rank's forward + backward; the first {a.warmup} "
          "iterations dropped), by micro-step index; then the iteration's sum")
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
