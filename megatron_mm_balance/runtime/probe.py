"""``MM_BALANCE_PROBE=DIR[:EVERY]``: what a long run holds, sampled, for the soak.

Read once per iterator; unset, nothing of it acts. Set, every ``EVERY`` global batches
(default 50) the consumer appends one JSON line to ``DIR/probe-rank<R>.jsonl`` (``R``: the
global rank) with the process's resident memory, its OS and Python threads, its open file
descriptors, the exchange's queue depths (micro-batches ready, requests pending), the
pinned pool's figures and the wall time, so that ``benchmarks/soak_megatron.py`` can
fit each one's slope over thousands of iterations of the framework's own loop. Reading
``/proc`` costs well under a millisecond per sample.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

ENV = "MM_BALANCE_PROBE"
DEFAULT_EVERY = 50


def configured(rank: int, environ=None) -> Optional["Probe"]:
    """The probe ``MM_BALANCE_PROBE`` asks for on global rank ``rank`` (None when unset)."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not value:
        return None
    directory, _, every = value.partition(":")
    try:
        every_n = int(every) if every else DEFAULT_EVERY
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected DIR or DIR:EVERY (an int >= 1)") from None
    if every_n < 1:
        raise ValueError(f"{ENV}={value!r}: EVERY must be >= 1")
    return Probe(directory, rank, every_n)


#: what an open descriptor is, by its /proc link: the exchange's gloo sockets (and the
#: training's) stay; pipes are the loader workers' queues; ``shm``: shared-memory files a
#: loader worker passed a batch in (as many as batches in flight)
FD_KINDS = ("socket", "pipe", "shm", "file", "other")


def _fd_kind(link: str) -> str:
    if link.startswith("socket:"):
        return "socket"
    if link.startswith("pipe:"):
        return "pipe"
    if link.startswith("/dev/shm") or link.endswith("(deleted)"):
        return "shm"
    return "file" if link.startswith("/") else "other"


def process_figures() -> dict:
    """Resident memory (KiB), OS and Python threads and open descriptors of this process,
    in all and by kind (``fd_socket``, ``fd_pipe``, ``fd_shm``, ...; Linux /proc)."""
    out = {"threads": threading.active_count()}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_kib"] = int(line.split()[1])
                elif line.startswith("Threads:"):
                    out["os_threads"] = int(line.split()[1])
        kinds = dict.fromkeys(FD_KINDS, 0)
        for fd in os.listdir("/proc/self/fd"):
            try:
                kinds[_fd_kind(os.readlink(f"/proc/self/fd/{fd}"))] += 1
            except OSError:                  # closed meanwhile (the listing's own)
                continue
        out["fds"] = sum(kinds.values())
        out.update({f"fd_{k}": v for k, v in kinds.items()})
    except OSError:
        pass
    return out


class Probe:
    """Appends a sample every ``every`` global batches (see the module docstring)."""

    def __init__(self, directory: str, rank: int, every: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"probe-rank{rank:05d}.jsonl")
        self.rank = rank
        self.every = every

    def due(self, global_batch: int) -> bool:
        return global_batch % self.every == 0

    def sample(self, global_batch: int, queues: dict, pool=None) -> None:
        row = {"global_batch": global_batch, "rank": self.rank, "time": time.time(),
               **process_figures(), **queues}
        if pool is not None:
            row.update(pool_bytes=pool.bytes, pool_buffers=pool.buffers, pool_lent=pool.lent,
                       pool_overflows=pool.overflows)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
