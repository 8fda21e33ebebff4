"""Where a command's CPU goes, by process: run it, read every descendant's ``/proc/PID/stat``
once a second, and print each process's CPU seconds (user + kernel), kernel seconds and minor
page faults over its life, grouped by role (training rank, data worker, launcher, other).

    python benchmarks/cpu_by_process.py -- mm-balance bench-realpath --bridge ... --modes off,images --rounds 1

What it answers on a 2-core machine: how much of the cores the data workers take while the
ranks train, and how much of a rank's time is the kernel's (page faults of large allocations).
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


def descendants(root: int) -> List[int]:
    """Every live process under ``root`` (itself included)."""
    children: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_stat(int(name))
            if st:
                children.setdefault(st[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
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


def main(argv: List[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python benchmarks/cpu_by_process.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1:]
    proc = subprocess.Popen(cmd)
    last: Dict[int, tuple] = {}
    start = time.monotonic()
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            st = read_stat(pid)
            if st is None:
                continue
            if pid not in last:
                try:
                    with open(f"/proc/{pid}/cmdline") as f:
                        cmdline = f.read().replace("\0", " ")
                except OSError:
                    cmdline = ""
                last[pid] = (role(st[1], cmdline), time.monotonic() - start, 0.0, *st[2:])
            last[pid] = (last[pid][0], last[pid][1], time.monotonic() - start, *st[2:])
        time.sleep(1.0)
    rows = sorted(((r, pid, t0, t1, u, s, mf) for pid, (r, t0, t1, u, s, mf) in last.items() if u + s > 0.05),
                  key=lambda x: (x[2], x[1]))
    print(f"\n{'role':<14} {'pid':>7} {'seen s':>13} {'CPU s':>7} {'kernel s':>9} {'minor faults':>13} "
          f"{'CPU share while seen':>21}")
    for r, pid, t0, t1, u, s, mf in rows:
        share = (u + s) / max(t1 - t0, 1e-9)
        print(f"{r:<14} {pid:>7} {t0:6.0f}-{t1:<6.0f} {u + s:7.1f} {s:9.1f} {mf:13,d} {share:21.2f}")
    totals: Dict[str, List[float]] = {}
    for r, _, _, _, u, s, mf in rows:
        t = totals.setdefault(r, [0.0, 0.0, 0])
        t[0] += u + s
        t[1] += s
        t[2] += mf
    print("\nby role: " + "; ".join(f"{r} {t[0]:.1f} s CPU ({t[1]:.1f} s kernel, {t[2]:,d} minor faults)"
                                   for r, t in sorted(totals.items())))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
