"""The demo's headline, real compute: balancing's gain on Megatron-LM's own ``elapsed time per
iteration``, every iteration timed balanced and as drawn inside the same two jobs.

The job is ``configs/megatron/vision_heavy_cpu.sh`` (DP=2 x EP=2 MoE, 16 micro-batches per
step, the vision encoder about two thirds of a micro-batch) run by the user's launcher
``scripts/pretrain_vlm_moe.sh`` on a patched Megatron-LM core_v0.16.1 tree and a fixed
``make-dataset --mix vision-heavy`` dataset (512 samples, seed 0), with the host side of a GPU
node (``bench-realpath --host gpu-node``). Two jobs read the same data:
``--mm-balance-mode crossover-even`` balances the even iterations and runs the odd ones as
drawn (gathered and solved, nothing moved), ``crossover-odd`` the other way round
(``mm-balance bench-realpath --modes crossover-even,crossover-odd``; the exchange inside
``next()``). Each pair of consecutive measured iterations then holds one iteration of each
parity, each timed balanced in one job and as drawn in the other: its gain is free of the
two jobs' speeds (:func:`~megatron_mm_balance.bench.crossover.paired_gains`), and the pairs
give a 95% interval. Beside it: the gain the runs' own per-pack timings of the iterations
as drawn predict for our placement and for perfect balance, and a timeline of the most
unbalanced iteration drawn as it ran in both jobs (``timeline.png``, ``mm-balance timeline``).

The tree is ``MEGATRON_LM_DIR`` when set, else the release archive beside the clone,
unpacked and patched once (:mod:`.megatron_tree`); without either the program stops at
once with one line saying what to provide.

Run: ``python -m megatron_mm_balance.testing.real_demo`` (``mm-balance demo`` runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from ..bench import crossover, realpath
from . import megatron_tree

MODES = ("crossover-even", "crossover-odd")
#: the ranks' host side: as on a GPU node (bench-realpath --host), so that an iteration run
#: as drawn in a crossover job runs as a job without balancing does
HOST = "gpu-node"
DEFAULTS = dict(iters=8, warmup=2, samples=512, seed=0, timeout=900.0)


class DemoError(RuntimeError):
    """The real-compute part cannot run: one line for the user."""


def find_tree(tag: str = megatron_tree.DEFAULT_TAG) -> Path:
    """The patched Megatron-LM tree the runs use; :class:`DemoError` names what is missing."""
    tree = megatron_tree.user_tree(tag)
    if tree is None:
        raise DemoError(f"no Megatron-LM tree for the real-compute part: set MEGATRON_LM_DIR to a "
                        f"Megatron-LM {tag} checkout patched with scripts/apply_patches.sh, or put "
                        f"{megatron_tree.archive(tag).name} in {megatron_tree.archives_dir()} "
                        f"(or run 'mm-balance demo --no-real')")
    if not (tree / "examples" / "multimodal" / "train.py").is_file():
        raise DemoError(f"MEGATRON_LM_DIR={tree} has no examples/multimodal/train.py "
                        f"(a Megatron-LM {tag} checkout is needed)")
    return tree


def run_crossover(tree: Path, out: Path, *, iters: int, warmup: int, samples: int, seed: int,
                  overrides: dict, timeout: float, python: str = sys.executable) -> dict:
    """The two crossover jobs on the same data; :func:`summarize` of them, and the timeline."""
    data = realpath.make_data(out / "data", samples, seed)
    framework = realpath.MegatronLMFramework(megatron_lm=str(tree), host=HOST)
    runs = []
    for mode in MODES:
        try:
            runs.append(realpath.run_launcher(mode, 1, data=data, out=out, train_iters=warmup + iters,
                                              env_overrides=overrides, timeout=timeout, python=python,
                                              framework=framework))
        except realpath.BenchError as exc:
            raise DemoError(str(exc)) from exc
    s = summarize(*runs, warmup=warmup)
    s["timeline"] = draw_timeline(*runs, warmup=warmup, stem=out / "timeline")
    return s


def _traces(even, odd, warmup: int) -> dict:
    from ..sim.run_trace import RunTraceError, load_run
    traces = {}
    for parity, run in zip(crossover.PARITIES, (even, odd)):
        try:
            traces[parity] = load_run(run.timing_dir, skip_iterations=warmup)
        except RunTraceError:
            pass
    return traces


def summarize(even, odd, *, warmup: int, loss_tolerance: float = realpath.DEFAULTS["loss_tolerance"]) -> dict:
    """The headline's figures from the two jobs' results (:class:`~..bench.realpath.RunResult`)."""
    pairs = crossover.paired_gains(even, odd, warmup)
    mean, low, high = crossover.paired_interval([g for _, _, g in pairs])
    common = sorted(set(even.losses) & set(odd.losses))
    diff = max((abs(even.losses[i] - odd.losses[i]) / max(abs(odd.losses[i]), 1e-12) for i in common),
               default=None)
    moved, waits = [], {"on": [], "off": []}
    for run in (even, odd):
        parity = run.mode.rsplit("-", 1)[1]
        for i in realpath.measured_window(run, warmup):
            t = run.telemetry.get(i) or {}
            on = crossover.balanced(parity, i)
            if on and t.get("packs_moved") is not None:
                moved.append(t["packs_moved"])
            if t.get("consumer_wait_ms") is not None:
                waits["on" if on else "off"].append(t["consumer_wait_ms"])
    iterations = {}
    for a, b, _ in pairs:
        for i in (a, b):
            on_run, off_run = (even, odd) if crossover.balanced("even", i) else (odd, even)
            iterations[i] = (on_run.elapsed_ms[i], off_run.elapsed_ms[i])
    return {"gain": mean, "low": low, "high": high, "pairs": [g for _, _, g in pairs],
            "iterations": iterations, "losses_equal": diff is not None and diff <= loss_tolerance,
            "max_loss_rel_diff": diff,
            "packs_moved_per_iteration": statistics.median(moved) if moved else None,
            "wait_balanced_ms": statistics.fmean(waits["on"]) if waits["on"] else None,
            "wait_unbalanced_ms": statistics.fmean(waits["off"]) if waits["off"] else None,
            **{f"predicted_{k}": v for k, v in crossover.predicted_gains(_traces(even, odd, warmup)).items()}}


def draw_timeline(even, odd, *, warmup: int, stem: Path) -> str | None:
    """``stem.png``/``.svg``: the odd iteration whose ranks waited most in the even job (which
    ran it as drawn), above the same iteration balanced in the odd job (``mm-balance
    timeline``); None without timings of both."""
    from ..sim.run_trace import RunTraceError
    from ..timeline.cli import panels_of
    from ..timeline.draw import draw
    from ..timeline.layout import waiting_shares
    from ..timeline.records import read_run
    try:
        drawn, placed = (read_run(r.timing_dir, skip_iterations=warmup) for r in (even, odd))
    except RunTraceError:
        return None
    shares = waiting_shares(drawn.phases)
    odd_its = [k for k, it in enumerate(drawn.iterations) if it % 2 and it in placed.iterations]
    if not odd_its:
        return None
    iteration = drawn.iterations[max(odd_its, key=lambda k: shares[k])]
    panels = panels_of([drawn, placed], ["as drawn", "--mm-balance"], iteration=iteration)
    draw(panels, str(stem), title="CPU: Megatron-LM vision-heavy DP=2 x EP=2 MoE, the same global batch "
                                  "in the two crossover jobs")
    return f"{stem}.png"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def headline(s: dict) -> str:
    """The real figure in one line, labelled, with its paired interval and the prediction."""
    n = len(s["pairs"])
    if s["low"] is None:
        spread = f"{n} pair of iterations: no interval"
    else:
        spread = f"paired 95% interval {_pct(s['low'])} to {_pct(s['high'])}, {n} pairs of iterations"
        if s["low"] <= 0:
            spread += "; it includes 0: within this machine's noise"
    pred = ""
    if s.get("predicted_placement_gain") is not None:
        pred = (f"; predicted from the runs' own per-pack timings: {_pct(s['predicted_placement_gain'])} by "
                f"our placement, {_pct(s['predicted_perfect_gain'])} at perfect balance")
    return (f"REAL (Megatron-LM's own 'elapsed time per iteration', each iteration timed balanced in one job "
            f"and as drawn in the other, same data; vision-heavy DP=2 x EP=2 MoE job on CPU): --mm-balance "
            f"{_pct(s['gain'])} ({spread}){pred}")


def details(s: dict) -> str:
    """What else the two jobs say: losses, packs moved, the exchange's wait, each pair."""
    diff = "-" if s["max_loss_rel_diff"] is None else f"{s['max_loss_rel_diff']:.1e}"
    moved = "-" if s["packs_moved_per_iteration"] is None else f"{s['packs_moved_per_iteration']:.0f}"
    wait = ("-" if s["wait_balanced_ms"] is None else
            f"{s['wait_balanced_ms']:.1f} ms balanced, {s['wait_unbalanced_ms'] or 0:.1f} ms as drawn")
    return (f"     lm loss of the two jobs equal within 1e-5: {'yes' if s['losses_equal'] else 'NO'} (max relative "
            f"difference {diff}); packs moved per balanced iteration {moved}; the consumer's wait per "
            f"iteration (gather, plan and exchange inside next()) {wait}")


def per_iteration(s: dict) -> str:
    cells = " ".join(f"{i}: {on:,.0f}/{off:,.0f}" for i, (on, off) in sorted(s["iterations"].items()))
    return (f"     per iteration, ms balanced/as drawn: {cells}; pair gains "
            f"{' '.join(_pct(g) for g in s['pairs'])}")


def _load() -> str:
    """The machine's load average (the runs share its cores with whatever else runs)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_mm_balance.testing.real_demo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo/real", help="runs and dataset (default %(default)s)")
    p.add_argument("--iters", type=int, default=DEFAULTS["iters"],
                   help="measured iterations per job, even (default %(default)s: 4 pairs)")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="iterations dropped (>= 2)")
    p.add_argument("--samples", type=int, default=DEFAULTS["samples"], help="dataset samples")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="dataset seed")
    p.add_argument("--set", action="append", metavar="VAR=VALUE",
                   help="launcher/config environment override, e.g. GBS=8 (repeatable)")
    p.add_argument("--timeout", type=float, default=DEFAULTS["timeout"], help="seconds per run")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary as JSON")
    p.add_argument("--check", action="store_true", help="only find (or prepare) the tree and print it")
    a = p.parse_args(argv)
    if a.iters < 2 or a.iters % 2 or a.warmup < 2:
        p.error("--iters must be even and >= 2 (pairs of iterations) and --warmup >= 2 (Megatron averages "
                "a job's first two iterations into its second log line)")
    overrides = {}
    for kv in a.set or []:
        if "=" not in kv:
            p.error(f"--set {kv!r}: expected VAR=VALUE")
        k, v = kv.split("=", 1)
        overrides[k] = v
    try:
        tree = find_tree()
        if a.check:
            print(tree)
            return 0
        print(f"== real: Megatron-LM {tree}, configs/megatron/vision_heavy_cpu.sh through "
              f"scripts/pretrain_vlm_moe.sh, --mm-balance-mode crossover-even then crossover-odd (each balances "
              f"the iterations of its parity, the others as drawn), {a.warmup} + {a.iters} iterations each "
              f"(the first {a.warmup} dropped); {_load()}", flush=True)
        t0 = time.monotonic()
        s = run_crossover(tree, Path(a.out).absolute(), iters=a.iters, warmup=a.warmup, samples=a.samples,
                          seed=a.seed, overrides=overrides, timeout=a.timeout)
    except (DemoError, crossover.CrossoverError) as exc:
        print(f"mm-balance demo: {str(exc).splitlines()[0]}", file=sys.stderr)
        if len(str(exc).splitlines()) > 1:
            print("\n".join(str(exc).splitlines()[1:]), file=sys.stderr)
        return 2
    s["wall_s"] = time.monotonic() - t0
    s["summary"] = headline(s)
    print("   " + headline(s))
    print(details(s))
    print(per_iteration(s))
    if s["timeline"]:
        print(f"     the most unbalanced iteration, as drawn and balanced: {s['timeline']} (and .svg)")
    print(f"     {s['wall_s']:.0f} s wall; {_load()}")
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1))
    return 0 if s["losses_equal"] else 3


if __name__ == "__main__":
    sys.exit(main())
