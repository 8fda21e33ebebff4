"""Soak of the balanced iterator: many global batches, world 2, small packs.

Prints the thread count and resident memory of every rank after warm-up, at
intervals, and at the end. Targets: no thread growth; RSS growth after warm-up
below 5%.

    python benchmarks/soak_runtime.py --batches 5000
"""
import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mm_balance.bench.runtime import spawn  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _os_threads() -> int:
    """Every thread of the process, including torch / gloo native ones."""
    return len(os.listdir("/proc/self/task"))


def soak_rank(rank, world, cfg):
    import torch
    from megatron_mm_balance.runtime import BalancedDataIterator

    def source():
        i = 0
        while True:
            n = 16 + (i * 7919 + rank * 104729) % 4000
            yield {"image_tokens": n, "pixels": torch.full((n,), i % 251, dtype=torch.uint8),
                   "tokens": torch.arange(256), "id": (rank, i)}
            i += 1

    G, samples = cfg["microbatches"], []
    t0 = time.perf_counter()
    with BalancedDataIterator(source(), num_microbatches=G, overlap=not cfg["no_overlap"], timeout=60) as it:
        moved = 0
        for b in range(cfg["batches"]):
            for _ in range(G):
                next(it)
            moved += it.last_stats.packs_moved
            if b + 1 == cfg["warmup"] or (b + 1) % cfg["every"] == 0 or b + 1 == cfg["batches"]:
                samples.append((b + 1, threading.active_count(), _os_threads(), round(_rss_mb(), 2)))
    return {"samples": samples, "moved": moved, "seconds": time.perf_counter() - t0,
            "threads_after_close": threading.active_count(), "os_threads_after_close": _os_threads()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=5000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--no-overlap", dest="no_overlap", action="store_true")
    args = p.parse_args(argv)
    cfg = vars(args)
    res = spawn(soak_rank, args.world, cfg, hard_timeout=3600)
    ok = True
    for r, x in enumerate(res):
        warm = next(s for s in x["samples"] if s[0] == args.warmup)
        end = x["samples"][-1]
        print(f"rank {r}: {args.batches} global batches x {args.microbatches} micro-batches in "
              f"{x['seconds']:.1f}s, {x['moved']} packs moved")
        for b, threads, os_threads, rss in x["samples"]:
            print(f"  after {b:>6} batches: Python threads {threads}, OS threads {os_threads}, "
                  f"RSS {rss:.1f} MiB")
        growth = (end[3] - warm[3]) / warm[3]
        print(f"  thread growth after warm-up: Python {end[1] - warm[1]}, OS {end[2] - warm[2]}; "
              f"RSS growth after warm-up: {100 * growth:+.2f}%; threads after close: Python "
              f"{x['threads_after_close']}, OS {x['os_threads_after_close']}")
        ok &= end[1] <= warm[1] and end[2] <= warm[2] and growth < 0.05
    print("PASS" if ok else "FAIL: thread growth or RSS growth >= 5%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
