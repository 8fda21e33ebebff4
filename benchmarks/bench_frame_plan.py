"""The frame planner on native-resolution micro-steps: movement, balance and time.

    python benchmarks/bench_frame_plan.py [--dp 8,64,1024] [--steps 20] [--alpha 256,6608]
        [--transfer B] [--cap] [--exact] [--baseline FRAMES_PY]

Each micro-step: every rank fills one 8K sequence with consecutive native-resolution
samples (``data/native_res.py``'s ``SIM_MIX``: text, images of 64-8,192 patches,
multi-image documents, videos of 2-32 frames), and its frames cost ``p * (p + alpha)``
(``alpha`` 256: a small tower; 6,608: Qwen3-VL-30B's tower). ``--transfer B`` adds a
transfer time of ``B * p`` per moved frame; ``--cap`` passes the glue's patch cap (the
most patches any rank held). For :func:`plan_frames` per row (percentiles over the
micro-steps): moved cost over the excess above the target (``sum max(0, load - T)``)
and over the certified whole-unit minimum (``FramePlan.min_cover_cost``: per rank the
least covering subset sum of its movable units), the largest load after over the lower
bound ``max(ceil(total / D), max frame)``, the same for a from-scratch greedy
least-loaded assignment and its moved cost over the minimum, and the planner's CPU time
(thread time, so the figure holds on a shared machine; the greedy is not timed).
``--exact`` adds, for ``DP <= 16``, the moved cost over the exact least cost at the same
target (``solver/frames_exact.py``, MILP, scipy) and how many micro-steps the per-rank
minimum is below it. ``--baseline FRAMES_PY`` runs another version of
``solver/frames.py`` (a file, e.g. ``git show REV:megatron_mm_balance/solver/frames.py``)
on the same micro-steps: its moved cost over the certified minimum at its own target,
its largest load, how many micro-steps this version ends lower / the same / higher, and
its time.

    python benchmarks/bench_frame_plan.py --group 8 [--dp 64,256,1024] [--steps 4] [--alpha 6608]

The same micro-steps planned inside per-micro-step step groups (expert-parallel groups) of
``--group`` consecutive ranks, next to the plan over all of data parallelism: frames per
plan, the planner's CPU ms per plan (p50 / max; a rank plans only its own group's frames),
and the largest load over the lower bound (of the group's own frames, mean over groups).
The group plan's time is what ``mm-balance simulate --frame-plan-ms`` takes for that group
size.

    python benchmarks/bench_frame_plan.py --bridge-data [--samples 256] [--seed 0]
        [--transfer B] [--cap]

The Bridge benchmark's own data: the train samples of ``mm-balance make-dataset
--format bridge-qwen-vl --mix native-res --samples 256 --seed 0`` (``NativeResMix()``:
1,024-token samples, frames of 64-3,136 patches), one sample per rank per micro-step at
DP=2 (consecutive pairs in drawing order), frames costing ``p * (p + alpha)`` with the
CPU config's ``alpha`` of its tower as the Bridge glue computes it (``configs/bridge/
qwen3_vl_moe_native_res_cpu.py``; ``VisionTower.frame_alpha``: 1,440). Totals over the
micro-steps: moved patches and cost against the exact least at each micro-step's target
(MILP; patches: the least patches any placement at that target moves) and the certified
minimum, the greedy's, and the vision time (sum of the largest loads) before, after, for
the greedy and at the lower bound.

    python benchmarks/bench_frame_plan.py --swaps [--dp 8,64,1024] [--steps 10]

The same synthetic micro-steps under the default patch cap: ``plan_frames`` then the glue's
``lower_by_swaps`` (``solver/frame_swaps.py``): the largest load over the lower bound after
each, the patches each moves, and the thread time of each (p50 / max).

    python benchmarks/bench_frame_plan.py --timing RUN/timing [RUN/timing ...]

The micro-steps a Bridge run saw (its timing records, ``mm_balance.timing_dir``: each rank's
grids per micro-step, after pack placement; ``bench-realpath --bridge`` writes them in every
run's ``timing/``), frames costing ``p * (p + alpha)`` as above: the vision time (sum over the
micro-steps of the largest rank's cost) over the mean before balancing, after
:func:`plan_frames`, after the glue's call (``plan_frame_encoders``: the planner, then
``lower_by_swaps``) and at the exact lowest largest load (MILP, ``exact_min_level``), each
under the glue's default patch cap (the most any rank held) and without a cap, the lower
bound ``max(mean, costliest frame)``, the patches each way moves, and the least patches any
placement reaching the glue's level moves (MILP, ``exact_min_moved``). Says where the frames'
last gain goes: the planning (its level over the exact one), the cap (the exact level with it
over without it), or whole frames (the exact level without a cap over the bound).

    python benchmarks/bench_frame_plan.py --versus-images heldout-real,mixed,video-heavy

compares it with :func:`megatron_mm_balance.solver.images.balance_images` (the Megatron-LM
path's image planner) on the simulator's micro-steps of those mixtures (every image a
unit, costs the ``vlm_30b_moe`` vision forward in microseconds, 4 global batches x 4
micro-steps per row): largest load over the lower bound, moved cost of plan_frames over
balance_images', CPU ms of each.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mm_balance.data.native_res import micro_step_frames  # noqa: E402
from megatron_mm_balance.solver.frames import (cover_lower_bound, default_patch_cap,  # noqa: E402
                                               greedy_assignment, plan_frames)


def _pct(x, q):
    return float(np.percentile(np.asarray(x, dtype=np.float64), q))


def _trio(x):
    return f"{_pct(x, 50):6.3f} {_pct(x, 90):6.3f} {max(x):6.3f}"


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


def _load_baseline(path):
    spec = importlib.util.spec_from_file_location("frames_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                 # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.plan_frames


def _exact_ratio(pl, owner, cost, D, kw):
    from megatron_mm_balance.solver.frames_exact import exact_min_moved
    ex = exact_min_moved(owner, cost, D, pl.target, time_limit=60, **kw)
    return pl.moved_cost / ex.bound if ex.bound > 0 else 1.0, int(ex.bound > pl.min_cover_cost)


def native_rows(args):
    dps = [int(x) for x in args.dp.split(",")]
    print(f"{args.steps} micro-steps per row; cost p*(p+alpha); transfer {args.transfer} per patch; "
          f"patch cap {'the most any rank held' if args.cap else 'none'}; percentiles p50 / p90 / max; "
          f"CPU ms of plan_frames")
    exact = ""
    if args.exact:
        exact = f" {'moved/exact':>13} {'<':>3} |"
    head = (f"{'DP':>5} {'alpha':>5} {'frames':>6} | {'moved/excess':>20} | {'moved/min':>20} |{exact} "
            f"{'max/LB':>13} | {'greedy max/LB':>13} {'greedy mv/min':>13} | {'ms p50':>7} {'ms max':>7}")
    print(head)
    print("-" * len(head))
    base = _load_baseline(args.baseline) if args.baseline else None
    base_rows = []
    for D in dps:
        for alpha in [int(x) for x in args.alpha.split(",")]:
            rng = np.random.default_rng([args.seed, D])
            ex, mn, gap, ggap, gmv, ms, nf, xr, xlt = [], [], [], [], [], [], [], [], 0
            b_mn, b_gap, b_ms, b_ratio, same_level = [], [], [], [], 0
            for _ in range(args.steps):
                owner, p = micro_step_frames(rng, D)
                cost = p * (p + alpha)
                kw = dict(patches=p, transfer=p * args.transfer if args.transfer else None,
                          patch_cap=default_patch_cap(owner, p, D) if args.cap else None)
                t0 = time.thread_time()
                pl = plan_frames(owner, cost, D, **kw)
                ms.append((time.thread_time() - t0) * 1e3)
                nf.append(len(p))
                ex.append(pl.moved_over_min)
                mn.append(pl.moved_over_cover)
                gap.append(pl.max_after / pl.lower_bound)
                ggap.append(pl.greedy_max / pl.lower_bound)
                gmv.append(pl.greedy_moved_cost / max(1, pl.min_cover_cost))
                if args.exact and D <= 16:
                    r, below = _exact_ratio(pl, owner, cost, D, kw) if pl.moved_cost else (1.0, 0)
                    xr.append(r)
                    xlt += below
                if base is not None:
                    t0 = time.thread_time()
                    bp = base(owner, cost, D, **kw)
                    b_ms.append((time.thread_time() - t0) * 1e3)
                    floor = cover_lower_bound(owner, cost, D, bp.target, transfer=kw["transfer"],
                                              patches=p, patch_cap=kw["patch_cap"])
                    b_mn.append(bp.moved_cost / floor if floor else 1.0)
                    b_gap.append(bp.max_after / bp.lower_bound)
                    b_ratio.append(pl.max_after / bp.max_after)
                    same_level += int(pl.target == bp.target)
            xcol = ""
            if args.exact:
                xcol = (f" {_pct(xr, 50):6.3f} {max(xr):6.3f} {xlt:>3} |" if xr else f" {'-':>13} {'-':>3} |")
            print(f"{D:>5} {alpha:>5} {int(np.mean(nf)):>6} | {_trio(ex)} | {_trio(mn)} |{xcol} "
                  f"{_pct(gap, 50):6.4f} {max(gap):6.4f} | {_pct(ggap, 50):6.4f} {max(ggap):6.4f} "
                  f"{_pct(gmv, 50):13.1f} | {_pct(ms, 50):7.2f} {max(ms):7.2f}")
            if base is not None:
                base_rows.append((D, alpha, b_mn, b_gap, b_ms, b_ratio, same_level))
    if base_rows:
        print(f"\nbaseline {args.baseline} on the same micro-steps: its moved cost over the certified "
              f"minimum at its own target, its largest load over the lower bound, the micro-steps where "
              f"both reach the same level, this version's largest load over the baseline's (min / mean / "
              f"max) and the baseline's CPU ms")
        head = (f"{'DP':>5} {'alpha':>5} | {'base moved/min':>20} | {'base max/LB':>13} | {'same T':>6} | "
                f"{'max/base max':>20} | {'base ms p50':>11} {'max':>7}")
        print(head)
        print("-" * len(head))
        for D, alpha, b_mn, b_gap, b_ms, b_ratio, same_level in base_rows:
            print(f"{D:>5} {alpha:>5} | {_trio(b_mn)} | {_pct(b_gap, 50):6.4f} {max(b_gap):6.4f} | "
                  f"{same_level:>6} | {min(b_ratio):6.4f} {np.mean(b_ratio):6.4f} {max(b_ratio):6.4f} | "
                  f"{_pct(b_ms, 50):11.2f} {max(b_ms):7.2f}")


def _timed_plan(owner, patches, parts, alpha, capped):
    """One micro-step's frame plan over ``parts`` ranks at cost ``p * (p + alpha)``: its CPU
    time in ms and its largest load over the lower bound."""
    cap = default_patch_cap(owner, patches, parts) if capped else None
    t0 = time.thread_time()
    pl = plan_frames(owner, patches * (patches + alpha), parts, patches=patches, patch_cap=cap)
    return (time.thread_time() - t0) * 1e3, pl.max_after / pl.lower_bound


def group_rows(args):
    """``--group N`` (module docstring): each micro-step planned over all ranks and inside
    every group of ``N`` consecutive ranks."""
    N = args.group
    print(f"{args.steps} micro-steps per row; cost p*(p+alpha); patch cap "
          f"{'the most any rank held' if args.cap else 'none'}; CPU ms of plan_frames per plan, "
          f"p50 / max; groups of {N} consecutive ranks")
    head = (f"{'DP':>5} {'alpha':>5} | {'frames':>6} {'ms p50':>8} {'ms max':>8} {'max/LB':>7} | "
            f"{'group':>5} {'frames':>6} {'ms p50':>8} {'ms max':>8} {'max/LB':>7}")
    print(head)
    print("-" * len(head))
    for D in [int(x) for x in args.dp.split(",")]:
        if D % N:
            raise SystemExit(f"--group {N} does not divide DP {D}")
        for alpha in [int(x) for x in args.alpha.split(",")]:
            rng = np.random.default_rng([args.seed, D])
            wide_ms, wide_gap, nf, g_ms, g_gap, g_nf = [], [], [], [], [], []
            for _ in range(args.steps):
                owner, p = micro_step_frames(rng, D)
                ms, gap = _timed_plan(owner, p, D, alpha, args.cap)
                wide_ms.append(ms)
                wide_gap.append(gap)
                nf.append(len(p))
                for lo in range(0, D, N):
                    mine = (owner >= lo) & (owner < lo + N)
                    if not mine.any():
                        continue
                    ms, gap = _timed_plan(owner[mine] - lo, p[mine], N, alpha, args.cap)
                    g_ms.append(ms)
                    g_gap.append(gap)
                    g_nf.append(int(mine.sum()))
            print(f"{D:>5} {alpha:>5} | {int(np.mean(nf)):>6} {_pct(wide_ms, 50):8.2f} {max(wide_ms):8.2f} "
                  f"{np.mean(wide_gap):7.4f} | {N:>5} {int(np.mean(g_nf)):>6} {_pct(g_ms, 50):8.2f} "
                  f"{max(g_ms):8.2f} {np.mean(g_gap):7.4f}", flush=True)


def _cpu_config_alpha() -> int:
    """``alpha`` of the Bridge CPU config's tower as the glue computes it (the whole tower's
    per-patch work over its per-squared-patch attention, ``VisionTower.frame_alpha``): a
    frame of ``p`` patches costs ``p * (p + alpha)``."""
    from megatron_mm_balance.bench.native_share import cpu_shapes
    from megatron_mm_balance.cost.flops import VisionTower
    return VisionTower.from_config(cpu_shapes().vision, where="the CPU config's tower").frame_alpha()


def bridge_data(args):
    """The Bridge benchmark's micro-steps (module docstring)."""
    from megatron_mm_balance.data.native_res import NativeResMix, draw
    from megatron_mm_balance.solver.frames_exact import exact_min_moved

    alpha = _cpu_config_alpha()
    samples = draw(np.random.default_rng(args.seed), args.samples, NativeResMix())
    D = 2
    tot = dict(steps=0, moving=0, moved_p=0, moved_c=0, exact_p=0, exact_c=0, min_c=0, excess=0,
               greedy_p=0, greedy_c=0, before=0, after=0, greedy_max=0, lb=0, worst_c=1.0, worst_p=1.0)
    ms = []
    for k in range(0, len(samples) - 1, 2):
        pair = samples[k:k + 2]
        owner = np.array([r for r, s in enumerate(pair) for _ in s.frames], dtype=np.int64)
        p = np.array([f for s in pair for f in s.frames], dtype=np.int64)
        tot["steps"] += 1
        if not len(p):
            continue
        cost = p * (p + alpha)
        kw = dict(patches=p, transfer=p * args.transfer if args.transfer else None,
                  patch_cap=default_patch_cap(owner, p, D) if args.cap else None)
        t0 = time.thread_time()
        pl = plan_frames(owner, cost, D, **kw)
        ms.append((time.thread_time() - t0) * 1e3)
        greedy = int(p[greedy_assignment(cost, D) != owner].sum())
        tot["before"] += pl.max_before
        tot["after"] += pl.max_after
        tot["greedy_max"] += pl.greedy_max
        tot["lb"] += pl.lower_bound
        tot["greedy_c"] += pl.greedy_moved_cost
        tot["greedy_p"] += greedy
        if not pl.min_moved_cost:
            continue
        best_c = exact_min_moved(owner, cost, D, pl.target, **kw)
        best_p = exact_min_moved(owner, cost, D, pl.target, moved=p, **kw)
        tot["moving"] += 1
        tot["moved_p"] += pl.moved_patches
        tot["moved_c"] += pl.moved_cost
        tot["exact_c"] += best_c.value
        tot["exact_p"] += best_p.value
        tot["min_c"] += pl.min_cover_cost
        tot["excess"] += pl.min_moved_cost
        tot["worst_c"] = max(tot["worst_c"], pl.moved_cost / best_c.value)
        tot["worst_p"] = max(tot["worst_p"], pl.moved_patches / best_p.value if best_p.value else 1.0)
    t = tot
    print(f"Bridge benchmark data: make-dataset --format bridge-qwen-vl --mix native-res --samples "
          f"{args.samples} --seed {args.seed}; DP=2, one sample per rank per micro-step; cost p*(p+{alpha}) "
          f"(the CPU config's tower alpha); transfer {args.transfer} per patch; patch cap "
          f"{'the most any rank held' if args.cap else 'none'}")
    print(f"micro-steps {t['steps']}, with frames to move {t['moving']}; plan_frames CPU ms p50 "
          f"{_pct(ms, 50):.2f} max {max(ms):.2f}")
    rows = [("moved patches", t["moved_p"], t["exact_p"], t["greedy_p"]),
            ("moved cost", t["moved_c"], t["exact_c"], t["greedy_c"])]
    head = f"{'':>14} | {'plan_frames':>12} {'exact least':>12} {'ratio':>6} {'worst step':>10} | {'greedy':>12} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for (name, got, best, greedy), worst in zip(rows, (t["worst_p"], t["worst_c"])):
        print(f"{name:>14} | {got:>12,} {best:>12,} {got / max(1, best):6.3f} {worst:10.3f} | "
              f"{greedy:>12,} {greedy / max(1, best):6.1f}")
    print(f"moved cost over the certified minimum {t['moved_c'] / max(1, t['min_c']):.3f}, over the excess "
          f"{t['moved_c'] / max(1, t['excess']):.3f}")
    print(f"vision time (sum of the largest loads) over the lower bound: before {t['before'] / t['lb']:.4f}, "
          f"plan_frames {t['after'] / t['lb']:.4f}, greedy {t['greedy_max'] / t['lb']:.4f}")


def swap_rows(args):
    """``--swaps`` (module docstring)."""
    from megatron_mm_balance.solver.frame_swaps import lower_by_swaps
    print(f"{args.steps} micro-steps per row; cost p*(p+alpha); the default patch cap; thread time")
    head = (f"{'DP':>5} {'alpha':>5} | {'max/LB plan':>11} {'+swaps':>7} | {'moved patches plan':>18} "
            f"{'+swaps':>12} | {'ms plan p50/max':>15} | {'ms swaps p50/max':>16}")
    print(head)
    print("-" * len(head))
    for D in [int(x) for x in args.dp.split(",")]:
        for alpha in [int(x) for x in args.alpha.split(",")]:
            rng = np.random.default_rng([args.seed, D])
            gap, gap2, t1, t2, m1, m2 = [], [], [], [], 0, 0
            for _ in range(args.steps):
                owner, p = micro_step_frames(rng, D)
                cost = p * (p + alpha)
                cap = default_patch_cap(owner, p, D)
                t0 = time.thread_time()
                pl = plan_frames(owner, cost, D, patches=p, patch_cap=cap)
                t1.append((time.thread_time() - t0) * 1e3)
                t0 = time.thread_time()
                enc = lower_by_swaps(owner, pl.encoder, cost, D, patches=p, patch_cap=cap)
                t2.append((time.thread_time() - t0) * 1e3)
                gap.append(pl.max_after / pl.lower_bound)
                gap2.append(np.bincount(enc, weights=cost, minlength=D).max() / pl.lower_bound)
                m1 += pl.moved_patches
                m2 += int(p[enc != owner].sum())
            print(f"{D:>5} {alpha:>5} | {np.mean(gap):11.4f} {np.mean(gap2):7.4f} | {m1:>18,} {m2:>12,} | "
                  f"{_pct(t1, 50):7.1f}/{max(t1):7.1f} | {_pct(t2, 50):8.1f}/{max(t2):7.1f}")


def _timing_steps(directory):
    """``(owner, patches)`` of every frame of each micro-step of a run's timing records (the
    ranks' grids at the same iteration and micro-batch), in rank order."""
    import json
    from pathlib import Path
    steps = {}
    for path in sorted(Path(directory).glob("timing-rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            steps.setdefault((rec["iteration"], rec["microbatch"]), {})[rec["rank"]] = rec.get("grids") or []
    for key in sorted(steps):
        by_rank = steps[key]
        owner = [r for r in sorted(by_rank) for t, h, w in by_rank[r] for _ in range(t)]
        patches = [h * w for r in sorted(by_rank) for t, h, w in by_rank[r] for _ in range(t)]
        yield np.array(owner, dtype=np.int64), np.array(patches, dtype=np.int64), max(by_rank) + 1


def timing_runs(args):
    """The micro-steps of runs' timing records (module docstring)."""
    from megatron_mm_balance.runtime.frames import plan_frame_encoders
    from megatron_mm_balance.solver.frames_exact import exact_min_level, exact_min_moved

    alpha = _cpu_config_alpha()
    print(f"frames cost p*(p+{alpha}) (the CPU config's tower alpha); vision time = sum over micro-steps of "
          f"the largest rank's cost, over the mean")
    head = (f"{'run':<40} {'steps':>5} | {'before':>7} | {'plan, cap':>9} {'+swaps':>7} {'exact, cap':>10} | "
            f"{'plan':>7} {'+swaps':>7} {'exact':>7} | {'bound':>7} | "
            f"{'moved patches, cap: plan / +swaps / exact least at its level':>60}")
    print(head)
    print("-" * len(head))
    for directory in args.timing:
        t = dict(steps=0, mean=0, before=0, plan_cap=0, swaps_cap=0, exact_cap=0, plan=0, swaps=0, exact=0,
                 bound=0, moved_plan=0, moved_swaps=0, moved_least=0)
        for owner, p, D in _timing_steps(directory):
            if not p.size:
                continue
            cost = p * (p + alpha)
            cap = default_patch_cap(owner, p, D)
            t["steps"] += 1
            t["mean"] += cost.sum() / D
            t["bound"] += max(cost.sum() / D, cost.max())
            for name, kw in (("_cap", dict(patch_cap=cap)), ("", dict(patch_cap=int(p.sum())))):
                pl = plan_frames(owner, cost, D, patches=p, **kw)
                enc = plan_frame_encoders(owner, cost, D, patches=p, **kw)
                best = exact_min_level(owner, cost, D, patches=p, **kw)
                if not best.optimal:
                    raise SystemExit(f"{directory}: the exact level was not proven in time")
                t["before"] += pl.max_before if name else 0
                t["plan" + name] += pl.max_after
                t["swaps" + name] += int(np.bincount(enc, weights=cost, minlength=D).max())
                t["exact" + name] += best.value
                if name:
                    t["moved_plan"] += pl.moved_patches
                    t["moved_swaps"] += int(p[enc != owner].sum())
                    level = int(np.bincount(enc, weights=cost, minlength=D).max())
                    least = exact_min_moved(owner, cost, D, level, patches=p, moved=p, **kw)
                    t["moved_least"] += int(least.value)
        m = t["mean"]
        print(f"{str(directory)[-40:]:<40} {t['steps']:>5} | {t['before'] / m:7.4f} | {t['plan_cap'] / m:9.4f} "
              f"{t['swaps_cap'] / m:7.4f} {t['exact_cap'] / m:10.4f} | {t['plan'] / m:7.4f} {t['swaps'] / m:7.4f} "
              f"{t['exact'] / m:7.4f} | {t['bound'] / m:7.4f} | {t['moved_plan']:>15,} / {t['moved_swaps']:>15,} / "
              f"{t['moved_least']:>15,} ({t['moved_swaps'] / max(1, t['moved_least']):.3f}x)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", default="8,64,1024")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--alpha", default="256,6608")
    ap.add_argument("--transfer", type=int, default=0, help="transfer time per moved patch")
    ap.add_argument("--cap", action="store_true", help="the glue's patch cap (the most any rank held)")
    ap.add_argument("--exact", action="store_true", help="moved cost over the exact least (DP <= 16, scipy)")
    ap.add_argument("--baseline", default=None, metavar="FRAMES_PY",
                    help="another version of solver/frames.py to compare on the same micro-steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--versus-images", default=None, metavar="TRACES",
                    help="compare with balance_images on these mixtures instead")
    ap.add_argument("--bridge-data", action="store_true",
                    help="the Bridge native-resolution benchmark's data at DP=2 instead")
    ap.add_argument("--samples", type=int, default=256, help="--bridge-data: samples drawn")
    ap.add_argument("--swaps", action="store_true",
                    help="plan_frames then lower_by_swaps on the synthetic micro-steps instead")
    ap.add_argument("--timing", nargs="+", default=None, metavar="DIR",
                    help="the micro-steps of Bridge runs' timing records instead")
    ap.add_argument("--group", type=int, default=None, metavar="N",
                    help="also plan inside step groups of N consecutive ranks (the group plan's time)")
    args = ap.parse_args(argv)
    if args.group:
        return group_rows(args)
    if args.timing:
        return timing_runs(args)
    if args.swaps:
        return swap_rows(args)
    if args.versus_images:
        return versus_images(args.versus_images.split(","), [int(x) for x in args.dp.split(",")],
                             args.seed + 1)
    if args.bridge_data:
        return bridge_data(args)
    return native_rows(args)


if __name__ == "__main__":
    main()
