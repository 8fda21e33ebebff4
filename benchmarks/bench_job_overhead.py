"""What a CPU-harness job spends outside training: the launch, and the end after training.

Runs one launcher command several times, alternating the CPU harness's ranks ending with the
interpreter's full teardown (``MM_BALANCE_FULL_TEARDOWN=1``) and without it (the default,
``megatron_mm_balance/testing/rank_exit.py``), each run with its own ``OUTPUT_DIR`` and
``MASTER_PORT``. From the output as it arrives it reads when the ranks began importing
Megatron (torch's ``cpp_extension`` warning), when Megatron was initialised, and when
training was done (``[after training is done]``); it prints each variant's medians: the whole
run, start to the first rank's import, start to initialised, and training done to exit.

    MEGATRON_BRIDGE_DIR=... MEGATRON_LM_DIR=... DATA_PATH=... PYTHON=.venv-bridge/bin/python \\
      NPROC_PER_NODE=4 EP=1 PRECISION=fp32 GBS=16 TRAIN_ITERS=1 \\
      python benchmarks/bench_job_overhead.py --reps 3 -- \\
        bash scripts/pretrain_bridge_vlm.sh --config configs/bridge/qwen3_vl_moe_tiny_cpu.sh

The command's environment is this one's; ``--out`` holds the runs (default a temporary
directory). Timings of a shared machine: run it with nothing else running.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_mm_balance.bench.runtime import free_port

MARKS = {"import": "cpp_extension", "initialized": "after megatron is initialized",
         "trained": "after training is done"}


def timed_run(cmd, env) -> dict:
    """One run: seconds from the start to each mark's first line, and to the exit."""
    t0 = time.monotonic()
    seen = {}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    for line in proc.stdout:
        for name, text in MARKS.items():
            if name not in seen and text in line:
                seen[name] = time.monotonic() - t0
    rc = proc.wait()
    seen["exit"] = time.monotonic() - t0
    seen["rc"] = rc
    return seen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="runs of each variant (alternating)")
    p.add_argument("--out", default=None, help="directory for the runs' OUTPUT_DIRs")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the launcher command")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("give the launcher command after --")
    out = a.out or tempfile.mkdtemp(prefix="mm-balance-overhead-")
    variants = {"full teardown": "1", "default": "0"}
    runs = {name: [] for name in variants}
    for rep in range(a.reps):
        for name, flag in variants.items():
            env = dict(os.environ, MM_BALANCE_FULL_TEARDOWN=flag, MASTER_PORT=str(free_port()),
                       OUTPUT_DIR=os.path.join(out, f"{flag}-{rep}"))
            r = timed_run(cmd, env)
            if r["rc"] != 0:
                print(f"{name}, run {rep + 1}: exit {r['rc']} (output in {env['OUTPUT_DIR']})", file=sys.stderr)
                return 1
            runs[name].append(r)
            print(f"{name:<14} run {rep + 1}: {r['exit']:.1f} s", flush=True)
    med = lambda rs, f: statistics.median(f(r) for r in rs)  # noqa: E731
    print(f"\n{'variant':<14} {'whole run':>9} {'to import':>9} {'to init':>8} {'trained to exit':>15}  (s, median of {a.reps})")
    for name, rs in runs.items():
        print(f"{name:<14} {med(rs, lambda r: r['exit']):>9.1f} {med(rs, lambda r: r.get('import', float('nan'))):>9.1f} "
              f"{med(rs, lambda r: r.get('initialized', float('nan'))):>8.1f} "
              f"{med(rs, lambda r: r['exit'] - r.get('trained', float('nan'))):>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
