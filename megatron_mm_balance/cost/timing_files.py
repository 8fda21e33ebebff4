"""Where a run's per-pack timing records live on disk, and how they get there.

``--mm-balance-timing-dir DIR`` (Bridge: ``mm_balance.timing_dir``) writes one JSON line
per micro-batch and rank (the record of :mod:`megatron_mm_balance.megatron.timing`) in one
of two layouts (``--mm-balance-timing-files``):

* ``rank`` (default): ``DIR/timing-rank<R>.jsonl``, one file per rank;
* ``node``: ``DIR/timing-node-<node>.jsonl``, one file per node, which every rank of the
  node appends to (``O_APPEND``, whole lines in each ``write``): 1,024 ranks on 128 nodes
  make 128 files on a shared filesystem instead of 1,024.

``--mm-balance-timing-every N`` writes only the records of every N-th iteration (all the
micro-batches of every rank at that iteration, so each written global batch is whole);
the log lines, the TensorBoard scalars and ``--mm-balance-cost auto`` still see every
record. Every written line carries its rank's ``node`` (what names the node: torchrun's
agent, Slurm's node id or the host name) when the writer knows it.

:func:`timing_paths` and :func:`read_timing_records` read either layout (or both mixed).
Pure file handling: no torch, no Megatron.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import List, Optional

from ..data.jsonl import json_lines

#: the layouts of ``--mm-balance-timing-files``
TIMING_FILE_LAYOUTS = ("rank", "node")
RANK_FILE_PATTERN = "timing-rank*.jsonl"
NODE_FILE_PATTERN = "timing-node-*.jsonl"
#: the fields every record has (``start_s``, ``end_s``, ``grids``, ``details``, ``node`` are optional)
REQUIRED_FIELDS = frozenset({"iteration", "microbatch", "rank", "images", "lengths", "vision_forward_ms",
                             "vision_backward_ms", "lm_forward_ms", "lm_backward_ms"})
#: buffered bytes after which a writer writes, between the recorder's flushes
FLUSH_BYTES = 1 << 20


class TimingFileError(ValueError):
    """A timing directory or line that cannot be read: one line naming the file."""


def rank_file_name(rank: int) -> str:
    return f"timing-rank{int(rank):05d}.jsonl"


def node_file_name(node: str) -> str:
    """``timing-node-<node>.jsonl``, the node's name made safe for a file name."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", str(node)).strip("-.") or "unnamed"
    return f"timing-node-{slug}.jsonl"


class TimingFileWriter:
    """One rank's side of the timing files: :meth:`write` each record, :meth:`flush` at the
    recorder's log interval, :meth:`close` at exit.

    ``layout``: ``rank`` or ``node`` (:data:`TIMING_FILE_LAYOUTS`); ``node``: the node's
    name (needed by ``node``; added to every written line when given); ``every``: write
    the records of iterations divisible by it only."""

    def __init__(self, out_dir: str, *, rank: int, layout: str = "rank", node: Optional[str] = None,
                 every: int = 1):
        if layout not in TIMING_FILE_LAYOUTS:
            raise ValueError(f"timing files must be one of {', '.join(TIMING_FILE_LAYOUTS)}, got {layout!r}")
        if int(every) < 1:
            raise ValueError(f"timing every must be >= 1, got {every}")
        if layout == "node" and not node:
            raise ValueError("one timing file per node needs the node's name")
        os.makedirs(out_dir, exist_ok=True)
        self.rank, self.layout, self.node, self.every = int(rank), layout, node, int(every)
        name = node_file_name(node) if layout == "node" else rank_file_name(rank)
        self.path = os.path.join(out_dir, name)
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: List[bytes] = []
        self._size = 0

    def wants(self, iteration: int) -> bool:
        """Whether the records of ``iteration`` are written (``every``)."""
        return int(iteration) % self.every == 0

    def write(self, record: dict) -> None:
        """Buffer ``record`` as one line when its iteration is written (:meth:`wants`)."""
        if self._fd is None or not self.wants(record["iteration"]):
            return
        if self.node is not None and "node" not in record:
            record = dict(record, node=self.node)
        line = (json.dumps(record) + "\n").encode("utf-8")
        self._pending.append(line)
        self._size += len(line)
        if self._size >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Append the buffered lines in one ``write`` (whole lines: the node's other ranks
        append to the same file)."""
        if self._fd is None or not self._pending:
            return
        data = b"".join(self._pending)
        self._pending, self._size = [], 0
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = None


def timing_paths(directory: str) -> List[str]:
    """The timing files of ``directory`` (both layouts), sorted; one-line errors."""
    if not os.path.isdir(directory):
        raise TimingFileError(f"{directory}: no such timing directory")
    paths = sorted(glob.glob(os.path.join(directory, RANK_FILE_PATTERN))
                   + glob.glob(os.path.join(directory, NODE_FILE_PATTERN)))
    if not paths:
        raise TimingFileError(f"{directory}: no {RANK_FILE_PATTERN} or {NODE_FILE_PATTERN} files "
                              f"(a --mm-balance-timing-dir output)")
    return paths


def read_timing_records(directory: str) -> List[dict]:
    """Every record of ``directory``, either layout, each checked for the fields every record
    has; ordered by rank, iteration and micro-batch (a node file interleaves its ranks)."""
    out = []
    for path in timing_paths(directory):
        with open(path, encoding="utf-8") as f:
            for lineno, rec in json_lines(f, path, TimingFileError):
                if not isinstance(rec, dict):
                    raise TimingFileError(f"{path}:{lineno}: expected a JSON object")
                missing = REQUIRED_FIELDS - set(rec)
                if missing:
                    raise TimingFileError(f"{path}:{lineno}: missing {sorted(missing)}")
                out.append(rec)
    out.sort(key=lambda r: (r["rank"], r["iteration"], r["microbatch"]))
    return out
