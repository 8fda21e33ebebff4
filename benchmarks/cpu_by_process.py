"""Where a command's CPU goes, by process: run it, read every descendant's ``/proc/PID/stat``
once a second, and print each process's CPU seconds (user + kernel), kernel seconds, minor
page faults and peak resident memory over its life, grouped by role (training rank, data
worker, launcher, other).

    python benchmarks/cpu_by_process.py -- mm-balance bench-realpath --bridge ... --modes off,images --rounds 1

What it answers on a 2-core machine: how much of the cores the data workers take while the
ranks train, how much of a rank's time is the kernel's (page faults of large allocations), and
how much memory a rank touches at its peak (what ``--host gpu-node``'s heap must hold).
Linux only; a process that lives less than a second may be missed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Dict, List

TICK = os.sysconf("SC_CLK_TCK")


def read_stat(pid: int):
    """(ppid, comm, user s, kernel s, minor faults) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[1]), comm, int(rest[11]) / TICK, int(rest[12]) / TICK, int(rest[7])


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (``VmHWM``, MiB), 0.0 when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def descendants(root: int) -> Dict[int, tuple]:
    """Every live process under ``root`` (itself included): its :func:`read_stat`, by pid."""
    stats = {int(name): read_stat(int(name)) for name in os.listdir("/proc") if name.isdigit()}
    children: Dict[int, List[int]] = {}
    for pid, st in stats.items():
        if st:
            children.setdefault(st[0], []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if stats.get(pid):
            out[pid] = stats[pid]
        todo.extend(children.get(pid, []))
    return out


def role(comm: str, cmdline: str) -> str:
    if comm.startswith("pt_data_worker"):
        return "data worker"
    if "cpu_bridge" in cmdline or "cpu_pretrain" in cmdline or "train.py" in cmdline:
        return "training rank"
    if "torch.distributed.run" in cmdline or comm in ("torchrun", "pt_elastic"):
        return "launcher"
    return "other"


def cmdline_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def main(argv: List[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python benchmarks/cpu_by_process.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1:]
    proc = subprocess.Popen(cmd)
    first: Dict[int, tuple] = {}        # pid: (role, first seen s)
    last: Dict[int, tuple] = {}         # pid: (last seen s, user s, kernel s, minor faults, peak MiB)
    start = time.monotonic()
    while proc.poll() is None:
        now = time.monotonic() - start
        for pid, st in descendants(proc.pid).items():
            if pid not in first:
                first[pid] = (role(st[1], cmdline_of(pid)), now)
            last[pid] = (now, *st[2:], max(peak_rss_mb(pid), last.get(pid, (0,) * 5)[4]))
        time.sleep(1.0)
    rows = sorted(((first[pid][0], pid, first[pid][1], *last[pid]) for pid in last
                   if last[pid][1] + last[pid][2] > 0.05), key=lambda x: (x[2], x[1]))
    print(f"\n{'role':<14} {'pid':>7} {'seen s':>13} {'CPU s':>7} {'kernel s':>9} {'minor faults':>13} "
          f"{'CPU share while seen':>21} {'peak RSS MiB':>13}")
    for r, pid, t0, t1, u, s, mf, peak in rows:
        share = (u + s) / max(t1 - t0, 1e-9)
        print(f"{r:<14} {pid:>7} {t0:6.0f}-{t1:<6.0f} {u + s:7.1f} {s:9.1f} {mf:13,d} {share:21.2f} "
              f"{peak:13,.0f}")
    totals: Dict[str, List[float]] = {}
    for r, _, _, _, u, s, mf, _ in rows:
        t = totals.setdefault(r, [0.0, 0.0, 0])
        t[0] += u + s
        t[1] += s
        t[2] += mf
    print("\nby role: " + "; ".join(f"{r} {t[0]:.1f} s CPU ({t[1]:.1f} s kernel, {t[2]:,d} minor faults)"
                                   for r, t in sorted(totals.items())))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
