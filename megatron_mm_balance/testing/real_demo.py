"""The demo's headline, real compute: Megatron-LM's own ``elapsed time per iteration`` with
``--mm-balance`` off and on.

The job is ``configs/megatron/vision_heavy_cpu.sh`` (DP=2 x EP=2 MoE, 16 micro-batches per
step, the vision encoder about two thirds of a micro-batch) run by the user's launcher
``scripts/pretrain_vlm_moe.sh`` on a patched Megatron-LM core_v0.16.1 tree and a
``make-dataset --mix vision-heavy`` dataset: the runs of ``mm-balance bench-realpath
--rounds 1 --modes off,overlap`` (docs/real_speed.md), shortened to ``--iters`` measured
iterations after ``--warmup``. The spread is the min-max over the measured iterations.

The tree is ``MEGATRON_LM_DIR`` when set, else the release archive beside the clone,
unpacked and patched once (:mod:`.megatron_tree`); without either the program stops at
once with one line saying what to provide.

Run: ``python -m megatron_mm_balance.testing.real_demo`` (``mm-balance demo`` runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..bench import realpath
from . import megatron_tree

#: The balanced mode the headline measures: ``--mm-balance`` as a user turns it on
#: (the exchange on its background thread).
ON_MODE = "overlap"
DEFAULTS = dict(iters=4, warmup=2, samples=512, seed=0, timeout=900.0)


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


def run_off_on(tree: Path, out: Path, *, iters: int, warmup: int, samples: int, seed: int,
               overrides: dict, timeout: float, python: str = sys.executable) -> dict:
    """One ``off`` and one ``overlap`` launcher run; :func:`summarize` of their report."""
    data = realpath.make_data(out / "data", samples, seed)
    results = []
    for mode in ("off", ON_MODE):
        try:
            results.append(realpath.run_launcher(
                mode, 1, megatron_lm=str(tree), data=data, out=out, train_iters=warmup + iters,
                calibration_iters=realpath.DEFAULTS["calibration_iters"], env_overrides=overrides,
                timeout=timeout, python=python))
        except realpath.BenchError as exc:
            raise DemoError(str(exc)) from exc
    return summarize(realpath.analyze(results, warmup=warmup,
                                      loss_tolerance=realpath.DEFAULTS["loss_tolerance"]))


def summarize(report: dict) -> dict:
    """The headline's figures from :func:`megatron_mm_balance.bench.realpath.analyze`'s report."""
    off, on = report["modes"]["off"], report["modes"][ON_MODE]
    losses = [x for x in report["losses"] if x["mode"] == ON_MODE]
    return {"off_ms": off["iteration_ms"], "on_ms": on["iteration_ms"], "gain": on["gain_vs_off"],
            "off_iterations": off["iterations"], "on_iterations": on["iterations"],
            "losses_equal": bool(losses) and all(x["equal"] for x in losses),
            "max_loss_rel_diff": max((x["max_rel_diff"] for x in losses), default=None),
            "packs_moved_per_iteration": on["packs_moved_per_iteration"]["median"],
            "consumer_wait_ms": on["consumer_wait_ms_per_iteration"]["median"],
            "predicted_perfect_gain": (report.get("predicted") or {}).get("perfect_gain")}


def _span(s: dict) -> str:
    return f"{s['median']:,.0f} ms [{s['min']:,.0f}-{s['max']:,.0f}] ({s['n']} iterations)"


def headline(s: dict) -> str:
    """The real figure in one line, labelled."""
    gain = "-" if s["gain"] is None else f"{100 * s['gain']:+.1f}%"
    off, on = s["off_ms"], s["on_ms"]
    overlap = on["min"] <= off["max"] and off["min"] <= on["max"]
    return (f"REAL (Megatron-LM's own 'elapsed time per iteration', median [min-max], vision-heavy "
            f"DP=2 x EP=2 MoE job on CPU): off {_span(off)}, --mm-balance {_span(on)}: {gain}"
            + (" (the spreads overlap: the difference is within this machine's noise)" if overlap else ""))


def details(s: dict) -> str:
    """What else the two runs say: losses, packs moved, exposed exchange, the prediction."""
    diff = "-" if s["max_loss_rel_diff"] is None else f"{s['max_loss_rel_diff']:.1e}"
    moved = "-" if s["packs_moved_per_iteration"] is None else f"{s['packs_moved_per_iteration']:.0f}"
    wait = "-" if s["consumer_wait_ms"] is None else f"{s['consumer_wait_ms']:.1f} ms"
    pred = ("" if s["predicted_perfect_gain"] is None else
            f"; perfect balance would give {100 * s['predicted_perfect_gain']:+.1f}% (predicted from the "
            f"off run's per-pack timings)")
    return (f"     lm loss off vs on equal within 1e-5: {'yes' if s['losses_equal'] else 'NO'} (max relative "
            f"difference {diff}); packs moved per iteration {moved}; exposed exchange {wait} per "
            f"iteration{pred}")


def _load() -> str:
    """The machine's load average (the runs share its cores with whatever else runs)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_mm_balance.testing.real_demo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo/real", help="runs and dataset (default %(default)s)")
    p.add_argument("--iters", type=int, default=DEFAULTS["iters"], help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="iterations dropped (>= 2)")
    p.add_argument("--samples", type=int, default=DEFAULTS["samples"], help="dataset samples")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="dataset seed")
    p.add_argument("--set", action="append", metavar="VAR=VALUE",
                   help="launcher/config environment override, e.g. GBS=8 (repeatable)")
    p.add_argument("--timeout", type=float, default=DEFAULTS["timeout"], help="seconds per run")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary as JSON")
    p.add_argument("--check", action="store_true", help="only find (or prepare) the tree and print it")
    a = p.parse_args(argv)
    if a.iters < 1 or a.warmup < 2:
        p.error("--iters must be >= 1 and --warmup >= 2 (Megatron averages a job's first two "
                "iterations into its second log line)")
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
              f"scripts/pretrain_vlm_moe.sh, off then --mm-balance, {a.warmup} + {a.iters} iterations each "
              f"(the first {a.warmup} dropped); {_load()}", flush=True)
        t0 = time.monotonic()
        s = run_off_on(tree, Path(a.out).absolute(), iters=a.iters, warmup=a.warmup, samples=a.samples,
                       seed=a.seed, overrides=overrides, timeout=a.timeout)
    except DemoError as exc:
        print(f"mm-balance demo: {str(exc).splitlines()[0]}", file=sys.stderr)
        if len(str(exc).splitlines()) > 1:
            print("\n".join(str(exc).splitlines()[1:]), file=sys.stderr)
        return 2
    s["wall_s"] = time.monotonic() - t0
    s["summary"] = headline(s)
    print("   " + headline(s))
    print(details(s))
    print(f"     per iteration off: {' '.join(f'{x:,.0f}' for x in s['off_iterations'])} ms; on: "
          f"{' '.join(f'{x:,.0f}' for x in s['on_iterations'])} ms; {s['wall_s']:.0f} s wall; "
          f"{_load()}")
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1))
    return 0 if s["losses_equal"] else 3


if __name__ == "__main__":
    sys.exit(main())
