"""The frame planner on native-resolution micro-steps: movement, balance and time.

    python benchmarks/bench_frame_plan.py [--dp 8,64,1024] [--steps 20] [--alpha 256,6608]

Each micro-step: every rank fills one 8K sequence with consecutive native-resolution
samples (``data/native_res.py``: text, images of 64-8,192 patches, multi-image
documents, videos of 2-32 frames), and its frames cost ``p * (p + alpha)``
(``alpha`` 256: the CPU toy tower; 6,608: Qwen3-VL-30B's tower). ``--transfer B``
adds a transfer time of ``B * p`` per moved frame. For :func:`plan_frames` per row
(percentiles over the micro-steps): moved cost over the excess above the target
(``sum max(0, load - T)``) and over the certified whole-unit minimum
(``FramePlan.min_cover_cost``), the largest load after over the lower bound
``max(ceil(total / D), max frame)``, the same for a from-scratch greedy least-loaded
assignment and its moved cost over the excess, and the planner's CPU time (thread
time, so the figure holds on a shared machine; the greedy is not timed).

    python benchmarks/bench_frame_plan.py --versus-images heldout-real,mixed,video-heavy

compares it with :func:`megatron_mm_balance.solver.images.balance_images` (the Megatron-LM
path's image planner) on the simulator's micro-steps of those mixtures (every image a
unit, costs the ``vlm_30b_moe`` vision forward in microseconds, 4 global batches x 4
micro-steps per row): largest load over the lower bound, moved cost of plan_frames over
balance_images', CPU ms of each.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mm_balance.data.native_res import micro_step_frames  # noqa: E402
from megatron_mm_balance.solver.frames import plan_frames  # noqa: E402


def _pct(x, q):
    return float(np.percentile(np.asarray(x, dtype=np.float64), q))


def versus_images(traces, dps, seed):
    from megatron_mm_balance.data.mixtures import make_mixture
    from megatron_mm_balance.sim.pool import build_pool, draw_indices
    from megatron_mm_balance.sim.timing import load_timing
    from megatron_mm_balance.sim.vision_balance import image_costs, micro_step_images
    from megatron_mm_balance.solver.images import balance_images

    t = load_timing("vlm_30b_moe")
    print("4 global batches x 4 micro-steps per row; vlm_30b_moe vision forward us per image; "
          "p50 (max) over the micro-steps; CPU ms")
    head = (f"{'trace':>13} {'DP':>5} | {'images max/LB':>15} {'frames max/LB':>15} | "
            f"{'frames/images moved':>20} | {'ms images':>9} {'ms frames':>9}")
    print(head)
    print("-" * len(head))
    for trace in traces:
        samples = make_mixture(trace, n=20000) if trace != "mixed" else make_mixture("mixed")[:20000]
        pool = build_pool(samples, 8192)
        icost = np.rint(image_costs(pool, t) * 1000).astype(np.int64)
        for D in dps:
            idx = draw_indices(len(pool), 4, D, 4, seed=seed)
            rows = []
            for b in range(4):
                for m in range(4):
                    owner, img = micro_step_images(pool, idx[b, :, m])
                    c = icost[img]
                    t0 = time.thread_time()
                    enc = balance_images(owner, c, D)
                    t1 = time.thread_time()
                    pl = plan_frames(owner, c, D)
                    t2 = time.thread_time()
                    load = np.bincount(enc, weights=c, minlength=D)
                    moved_images = c[enc != owner].sum()
                    rows.append((load.max() / pl.lower_bound, pl.max_after / pl.lower_bound,
                                 pl.moved_cost / max(1, moved_images), (t1 - t0) * 1e3, (t2 - t1) * 1e3))
            r = np.array(rows)
            pm = lambda k: f"{np.median(r[:, k]):.4f} ({r[:, k].max():.4f})"
            print(f"{trace:>13} {D:>5} | {pm(0):>15} {pm(1):>15} | {pm(2):>20} | "
                  f"{np.median(r[:, 3]):9.2f} {np.median(r[:, 4]):9.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", default="8,64,1024")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--alpha", default="256,6608")
    ap.add_argument("--transfer", type=int, default=0, help="transfer time per moved patch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--versus-images", default=None, metavar="TRACES",
                    help="compare with balance_images on these mixtures instead")
    args = ap.parse_args(argv)
    if args.versus_images:
        return versus_images(args.versus_images.split(","), [int(x) for x in args.dp.split(",")],
                             args.seed + 1)
    print(f"{args.steps} micro-steps per row; cost p*(p+alpha); transfer {args.transfer} per patch; "
          f"percentiles p50 / p90 / max; CPU ms of plan_frames")
    head = (f"{'DP':>5} {'alpha':>5} {'frames':>6} | {'moved/excess':>20} | {'moved/cover':>20} | "
            f"{'max/LB':>13} | {'greedy max/LB':>13} {'greedy mv/ex':>12} | {'ms p50':>7} {'ms max':>7}")
    print(head)
    print("-" * len(head))
    for D in [int(x) for x in args.dp.split(",")]:
        for alpha in [int(x) for x in args.alpha.split(",")]:
            rng = np.random.default_rng([args.seed, D])
            ex, cov, gap, ggap, gmv, ms, nf = [], [], [], [], [], [], []
            for _ in range(args.steps):
                owner, p = micro_step_frames(rng, D)
                cost = p * (p + alpha)
                tr = p * args.transfer if args.transfer else None
                t0 = time.thread_time()
                pl = plan_frames(owner, cost, D, patches=p, transfer=tr)
                ms.append((time.thread_time() - t0) * 1e3)
                nf.append(len(p))
                ex.append(pl.moved_over_min)
                cov.append(pl.moved_over_cover)
                gap.append(pl.max_after / pl.lower_bound)
                ggap.append(pl.greedy_max / pl.lower_bound)
                gmv.append(pl.greedy_moved_cost / max(1, pl.min_moved_cost))
            trio = lambda x: f"{_pct(x, 50):6.3f} {_pct(x, 90):6.3f} {max(x):6.3f}"
            print(f"{D:>5} {alpha:>5} {int(np.mean(nf)):>6} | {trio(ex)} | {trio(cov)} | "
                  f"{_pct(gap, 50):6.4f} {max(gap):6.4f} | {_pct(ggap, 50):6.4f} {max(ggap):6.4f} "
                  f"{_pct(gmv, 50):12.1f} | {_pct(ms, 50):7.2f} {max(ms):7.2f}")


if __name__ == "__main__":
    main()
