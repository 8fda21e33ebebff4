"""``--mm-balance-record-samples DIR``: what each rank's training loop consumed, per iteration.

Opt-in, with balancing on or off (the training.py patch calls the glue when either flag
is set). Every micro-batch Megatron takes from the train iterator of a rank that reads
data is written, as the loop receives it (after balancing), as one JSON line to
``DIR/samples-rank<RANK>.jsonl`` (``-chunk<C>`` under virtual pipeline)::

    {"iteration": 4, "microbatch": 0, "rank": 0, "dp_rank": 0, "job_start": 3,
     "keys": ["captions/part_00000.tar/000017,captions/part_00000.tar/000042"], "digest": "9c1e..."}

``iteration`` is the one Megatron logs (``args.curr_iteration + 1``), ``job_start`` the
iteration the job loaded (0: a fresh job; a resumed job appends to the same file),
``keys`` the micro-batch's ``__key__`` (energon's sample keys; a packed sample's keys
joined by commas; null when the loader gives none) and ``digest`` a BLAKE2b digest of
the micro-batch's content (every tensor by dtype, shape and bytes; energon's ``__*``
bookkeeping entries left out), so that the same key with different content is seen too.

It reads the micro-batch and changes nothing; with the flag unset nothing of this module
runs. Used by the resume tests (tests/realpath) to compare the samples a resumed job
consumes with the uninterrupted run's, rank by rank.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Optional


def batch_keys(item) -> Optional[list]:
    """The micro-batch's sample keys (``__key__``), as a list of strings, or None."""
    if not isinstance(item, dict) or "__key__" not in item:
        return None
    keys = item["__key__"]
    return [str(k) for k in keys] if isinstance(keys, (list, tuple)) else [str(keys)]


def batch_digest(item) -> str:
    """A digest of the micro-batch's content: every value (dicts by sorted key, tensors by
    dtype, shape and bytes) except energon's bookkeeping entries (``__key__``, recorded
    apart, ``__restore_key__``, ...: keys starting with ``__``)."""
    h = hashlib.blake2b(digest_size=16)

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                if str(k).startswith("__"):
                    continue
                h.update(f"<{k}>".encode())
                visit(value[k])
        elif isinstance(value, (list, tuple)):
            h.update(b"[")
            for v in value:
                visit(v)
            h.update(b"]")
        elif hasattr(value, "detach") and hasattr(value, "dtype"):       # a tensor
            import torch
            t = value.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(value.shape)}".encode())
            h.update((t if t.dtype == torch.uint8 else t.view(torch.uint8)).numpy().tobytes())
        else:
            h.update(repr(value).encode())

    visit(item)
    return h.hexdigest()


class SampleRecorder:
    """Writes one JSON line per consumed micro-batch of one rank (and model chunk)."""

    def __init__(self, directory: str, *, iteration_fn: Optional[Callable[[], Optional[int]]] = None,
                 job_start: int = 0, rank: Optional[int] = None, dp_rank: Optional[int] = None,
                 chunk: int = 0):
        """``iteration_fn``: the iteration Megatron's loop is in (:func:`~.config.live_iteration`);
        ``job_start``: the iteration the job loaded (0: a fresh job)."""
        self.iteration_fn = iteration_fn
        self.rank = _global_rank() if rank is None else rank
        self.dp_rank = _dp_rank() if dp_rank is None else dp_rank
        self.chunk = chunk
        self.job_start = int(job_start)
        os.makedirs(directory, exist_ok=True)
        name = f"samples-rank{self.rank:05d}" + (f"-chunk{chunk}" if chunk else "") + ".jsonl"
        self.path = os.path.join(directory, name)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)
        self._iteration = None
        self._microbatch = 0

    def record(self, item) -> None:
        it = self.iteration_fn() if self.iteration_fn is not None else None
        it = self._microbatch if it is None else it
        if it != self._iteration:
            self._iteration, self._microbatch = it, 0
        rec = {"iteration": it, "microbatch": self._microbatch, "rank": self.rank,
               "dp_rank": self.dp_rank, "job_start": self.job_start,
               "keys": batch_keys(item), "digest": batch_digest(item)}
        self._file.write(json.dumps(rec) + "\n")
        self._microbatch += 1

    def close(self) -> None:
        self._file.close()


class RecordingIterable:
    """Pass-through that records each item (balancing off); keeps ``save_state`` and the rest."""

    def __init__(self, source, recorder: SampleRecorder):
        self.source = source
        self._it = source if hasattr(source, "__next__") else iter(source)
        self.recorder = recorder

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        self.recorder.record(item)
        return item

    def __getattr__(self, name):          # save_state and anything else the loader offers
        if name in ("source", "_it", "recorder"):
            raise AttributeError(name)
        return getattr(self.source, name)


def read_records(directory: str) -> list:
    """Every record of every ``samples-rank*.jsonl`` file under ``directory``, in file order."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("samples-rank") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                out.extend(json.loads(line) for line in f if line.strip())
    return out


def _global_rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_initialized() else 0
    except Exception:
        return 0


def _dp_rank() -> Optional[int]:
    try:
        from megatron.core import parallel_state as mpu
        return int(mpu.get_data_parallel_rank())
    except Exception:
        return None
