"""Soak: Megatron-LM's own training loop with --mm-balance for thousands of iterations.

Runs the user's launcher (``scripts/pretrain_vlm_moe.sh``, ``configs/megatron/tiny_cpu.sh``)
with balancing on and the smallest batch that still moves packs (two micro-batches per
data-parallel rank: with one, swapping packs cannot lower a micro-step's maximum), with
``MM_BALANCE_PROBE`` set: every 50 iterations each rank records its resident memory,
threads, open file descriptors, the exchange's queue depths and the pinned pool
(:mod:`megatron_mm_balance.runtime.probe`). Then, per rank, each figure's least-squares
slope over the iterations after warm-up, per 1,000 iterations, and the iteration time's
(from the probe's clock: 50 iterations between samples). Threads and descriptors (sockets,
pipes, files; the loader's shared-memory batches come and go with those in flight and are
reported) must be constant after warm-up and the queue depths within their bounds
(PASS/FAIL); memory and time are reported.

A benchmark, not CI (the suite's short version: ``tests/runtime/test_runtime_soak.py``
asserts the counts over 300 global batches). On a shared machine run it under
``nice -n 10``: the iteration time's slope is then indicative only; the counts are not
affected. Without CUDA the launcher runs the ranks through its CPU harness.

    nice -n 10 python benchmarks/soak_megatron.py --megatron-lm DIR --data DATA_PATH \\
        --tokenizer TOKENIZER_MODEL --iters 3000 --out /tmp/soak
    python benchmarks/soak_megatron.py --report /tmp/soak          # the table again
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: what must not change after warm-up (threads; descriptors other than the loader's
#: shared-memory batches, which come and go with the batches it has in flight); what must stay
#: within its bound (the exchange's queues: one micro-batch ready, one request pending); what
#: is only reported (all descriptors, memory)
COUNTS = ("threads", "os_threads", "fd_socket", "fd_pipe", "fd_file", "fd_other", "pool_buffers")
BOUNDED = {"ready": 1, "requests": 1}
REPORTED = ("fds", "fd_shm", "stats", "pool_lent", "rss_kib", "pool_bytes")


def run(args) -> int:
    probe_dir = os.path.join(args.out, "probe")
    os.makedirs(probe_dir, exist_ok=True)
    env = dict(os.environ, MEGATRON_LM_DIR=args.megatron_lm, DATA_PATH=args.data, MM_BALANCE="1",
               NPROC_PER_NODE=str(args.nproc), EP="1", NUM_EXPERTS="0", GBS=str(args.gbs),
               TRAIN_ITERS=str(args.iters), LOG_INTERVAL=str(args.every), EVAL_ITERS="0",
               OUTPUT_DIR=os.path.join(args.out, "run"), MM_BALANCE_PROBE=f"{probe_dir}:{args.every}",
               PYTHONPATH=os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if args.tokenizer:
        env["TOKENIZER_MODEL"] = args.tokenizer
    log = os.path.join(args.out, "launcher.log")
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(["bash", os.path.join(REPO, "scripts", "pretrain_vlm_moe.sh"), "--config",
                             os.path.join(REPO, "configs", "megatron", "tiny_cpu.sh"), "--save-interval",
                             str(10 * args.iters)], env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    print(f"launcher exit {rc} after {time.time() - t0:.0f} s ({log})")
    return report(args.out, warmup=args.warmup) or rc


def slope(xs, ys) -> float:
    """Least-squares slope of ys on xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def report(out: str, warmup: int = 500) -> int:
    """The slopes table of the probe files under ``out``; 1 if a count changed after warm-up."""
    files = sorted(glob.glob(os.path.join(out, "probe", "probe-rank*.jsonl")))
    if not files:
        print(f"no probe files under {out}/probe")
        return 1
    bad = []
    print(f"{'rank':>4} {'figure':<13} {'first':>10} {'last':>10} {'min':>10} {'max':>10} {'slope /1k it':>13}")
    for path in files:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        rows = [r for r in rows if r["global_batch"] >= warmup]
        if len(rows) < 3:
            print(f"{path}: {len(rows)} samples after warm-up")
            bad.append(path)
            continue
        rank = rows[0]["rank"]
        its = [r["global_batch"] for r in rows]
        for key in COUNTS + tuple(BOUNDED) + REPORTED:
            vals = [r[key] for r in rows if key in r]
            if len(vals) != len(rows):
                continue
            s = slope(its, vals) * 1000
            print(f"{rank:>4} {key:<13} {vals[0]:>10} {vals[-1]:>10} {min(vals):>10} {max(vals):>10} {s:>13.3f}")
            if key in COUNTS and min(vals) != max(vals):
                bad.append(f"rank {rank} {key} {min(vals)}..{max(vals)}")
            if key in BOUNDED and max(vals) > BOUNDED[key]:
                bad.append(f"rank {rank} {key} up to {max(vals)} (bound {BOUNDED[key]})")
        times = [(b["time"] - a["time"]) / (b["global_batch"] - a["global_batch"]) * 1e3
                 for a, b in zip(rows, rows[1:])]
        mids = [(a["global_batch"] + b["global_batch"]) / 2 for a, b in zip(rows, rows[1:])]
        print(f"{rank:>4} {'iter ms':<13} {times[0]:>10.1f} {times[-1]:>10.1f} {min(times):>10.1f} "
              f"{max(times):>10.1f} {slope(mids, times) * 1000:>13.3f}")
        print(f"{rank:>4} samples {len(rows)}, iterations {its[0]}..{its[-1]}")
    print("PASS: threads and descriptors constant after warm-up, queue depths within their bounds" if not bad
          else f"FAIL: {bad}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm", help="a Megatron-LM checkout with scripts/apply_patches.sh applied")
    ap.add_argument("--data", help="DATA_PATH (mm-balance make-dataset OUT prints it)")
    ap.add_argument("--tokenizer", help="TOKENIZER_MODEL (make-dataset prints it)")
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--every", type=int, default=50, help="iterations between samples (and log lines)")
    ap.add_argument("--warmup", type=int, default=500, help="iterations left out of the slopes")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (data-parallel: EP=1, a dense LM)")
    ap.add_argument("--gbs", type=int, default=4, help="global batch: 2 micro-batches per rank at DP=2")
    ap.add_argument("--out", default="/tmp/soak-megatron")
    ap.add_argument("--report", metavar="OUT", help="only print the table of an earlier run's OUT")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report, warmup=args.warmup)
    if not (args.megatron_lm and args.data):
        ap.error("--megatron-lm and --data are required to run")
    os.makedirs(args.out, exist_ok=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
