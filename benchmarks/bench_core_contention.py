"""How much slower one rank's compute runs while another rank computes on the machine's other
core: the same single-threaded torch work, timed alone and with a copy of it running at the
same time on another core.

    python benchmarks/bench_core_contention.py [--reps 30] [--patches 2500] [--cores 0,1]

Why: on a GPU node each rank has a device of its own, and what one rank computes does not slow
another. On a CPU machine the ranks share the last-level cache and the memory bandwidth, so a
rank that computes while its peer waits runs faster than one whose peer computes too. An
unbalanced job's ranks often wait for each other, so its measured per-pack times are partly
uncontended; balancing removes the waiting, and with it that speed. The figure this prints is
the part of a CPU benchmark's balanced-vs-unbalanced difference that is the machine's, not the
placement's (docs/real_speed.md).

Workloads (forward + backward, fp32, one thread each), shaped as the native-resolution bench's
model (``configs/bridge/qwen3_vl_moe_native_res_cpu.py``):

* ``vision``: one vision block on a frame of ``--patches`` patches (hidden 48, 3 heads, MLP 256),
  attention scores materialised as the CPU path does;
* ``language``: two transformer layers of hidden 128 over 1,024 positions (8 heads, MLP 512).

Prints one table row per workload: median milliseconds per repetition alone and together, and
the slowdown. Linux only (``os.sched_setaffinity``).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import List


def _attention(x, qkv, out, heads: int):
    import torch
    n, d = x.shape
    q, k, v = (qkv(x).reshape(n, 3, heads, d // heads).permute(1, 2, 0, 3))
    scores = torch.softmax(q @ k.transpose(-1, -2) / (d // heads) ** 0.5, dim=-1)
    return out((scores @ v).permute(1, 0, 2).reshape(n, d))


def _block(x, layers, heads: int):
    import torch
    for qkv, out, up, down in layers:
        x = x + _attention(x, qkv, out, heads)
        x = x + down(torch.nn.functional.gelu(up(x)))
    return x


def _workload(name: str, patches: int):
    """``(run, description)``: ``run()`` does one forward and backward of the workload."""
    import torch
    torch.manual_seed(0)
    if name == "vision":
        hidden, heads, ffn, rows, depth = 48, 3, 256, patches, 1
    elif name == "language":
        hidden, heads, ffn, rows, depth = 128, 8, 512, 1024, 2
    else:
        raise ValueError(f"unknown workload {name!r}")
    lin = torch.nn.Linear
    layers = [(lin(hidden, 3 * hidden), lin(hidden, hidden), lin(hidden, ffn), lin(ffn, hidden))
              for _ in range(depth)]
    x = torch.randn(rows, hidden, requires_grad=True)

    def run():
        _block(x, layers, heads).square().mean().backward()

    return run, f"{depth} layer(s), hidden {hidden}, {heads} heads, MLP {ffn}, {rows} rows"


def _timed(name: str, patches: int, reps: int, core: int, start, out) -> None:
    """One process: pinned to ``core``, one thread, a warm-up, then ``reps`` timed repetitions
    after ``start`` is set; the times (ms) go to ``out``."""
    import torch
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    run, _ = _workload(name, patches)
    for _ in range(3):
        run()
    start.wait()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3)
    out.put((core, times))


def measure(name: str, patches: int, reps: int, cores: List[int]) -> dict:
    """Median ms per repetition of ``name`` on ``cores[0]`` alone, and on every core of
    ``cores`` at once (the median over all of them)."""
    ctx = mp.get_context("spawn")
    result = {}
    for label, where in (("alone", cores[:1]), ("together", cores)):
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_timed, args=(name, patches, reps, c, start, out)) for c in where]
        for p in procs:
            p.start()
        time.sleep(2.0 + 0.5 * len(procs))          # every process built and warmed up
        start.set()
        times = [t for _ in procs for t in out.get(timeout=600)[1]]
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"{name} on core set {where}: a timing process exited {p.exitcode}")
        result[label] = statistics.median(times)
    result["slowdown"] = result["together"] / result["alone"] - 1.0
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--patches", type=int, default=2500, help="the vision workload's frame size")
    ap.add_argument("--cores", default="0,1", help="cores to run on (the first one alone)")
    ap.add_argument("--workloads", default="vision,language")
    a = ap.parse_args(argv)
    cores = [int(c) for c in a.cores.split(",")]
    if len(cores) < 2 or a.reps < 1:
        ap.error("--cores needs at least two cores and --reps at least 1")
    print(f"{'workload':<10} {'alone ms':>9} {'together ms':>12} {'slowdown':>9}   shape")
    for name in a.workloads.split(","):
        r = measure(name, a.patches, a.reps, cores)
        print(f"{name:<10} {r['alone']:9.1f} {r['together']:12.1f} {100 * r['slowdown']:+8.1f}%   "
              f"{_workload(name, a.patches)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
