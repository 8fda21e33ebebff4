"""The host side of a GPU node, for benchmarks on a small CPU host (both frameworks' harnesses).

On a GPU node the data loader's workers run on host cores the training loop does not use, and
CUDA's caching allocator holds a job's peak after its first iterations. On a 2-core host the
workers take the cores the ranks compute on (more of them the less the ranks wait for each
other, so an unbalanced run gets its data almost for free and a balanced one pays for it in
compute), and glibc faults in each page past the heap's peak so far. Two benchmark settings,
read by :mod:`.cpu_bridge` and :mod:`.cpu_pretrain` at setup, take both out of the measured
iterations: ``MM_BALANCE_CPU_PREDRAW`` draws the train loader's micro-batches before the first
iteration (the same batches, in the same order), ``MM_BALANCE_CPU_HEAP_MB`` grows each rank's
heap. The loader's checkpoint state is not carried through the predraw, so a run with it saves
no resumable data position: a benchmark setting, not a training one.
"""
from __future__ import annotations

import os

#: ``MM_BALANCE_CPU_PREDRAW=all`` (or a micro-batch count): the benchmark's setting that
#: moves the data loader's work before the clock starts (:func:`_host_side_at_setup`).
PREDRAW_ENV = "MM_BALANCE_CPU_PREDRAW"


class PredrawnBatches:
    """The first ``count`` items of ``iterable``, drawn at once, then the rest as they come.

    Same items, same order: only *when* the loader does its work changes."""

    def __init__(self, iterable, count: int):
        self._inner = iter(iterable)
        self._ready = []
        for _ in range(count):
            try:
                self._ready.append(next(self._inner))
            except StopIteration:
                break
        self._ready.reverse()

    def __iter__(self):
        return self

    def __next__(self):
        return self._ready.pop() if self._ready else next(self._inner)


def predraw_count(value: str, *, train_iters: int, global_batch_size: int, micro_batch_size: int,
                  dp_size: int) -> int:
    """Micro-batches to draw: ``all`` is the job's whole run on this rank
    (``train_iters x global_batch_size / (micro_batch_size x dp_size)``), else a count."""
    if value.strip().lower() == "all":
        return train_iters * (global_batch_size // (micro_batch_size * dp_size))
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{PREDRAW_ENV} must be 'all' or a micro-batch count (got {value!r})") from None
    if count < 0:
        raise ValueError(f"{PREDRAW_ENV} must not be negative (got {count})")
    return count


def predraw_into(iterators, count: int) -> int:
    """Replace the ``iterable`` of each of ``iterators`` (Megatron's train iterator, a
    ``RerunDataIterator`` holding the loader's iterator there, or a list of them, one per model
    chunk; None for a rank without data) by :class:`PredrawnBatches` of ``count``: drawn here,
    below anything that later wraps the iterator (the balancer pulls from the drawn batches).
    Returns how many were replaced."""
    done = 0
    for it in iterators if isinstance(iterators, list) else [iterators]:
        if it is not None and hasattr(it, "iterable"):
            it.iterable = PredrawnBatches(it.iterable, count)
            done += 1
    return done


def host_side_settings():
    """``(predraw, heap_mb)`` from the environment, checked together: the predraw setting
    (``""`` when unset) and the MiB of heap to grow."""
    value = os.environ.get(PREDRAW_ENV, "").strip()
    mb = heap_mb(os.environ.get(HEAP_ENV, "").strip())
    check_heap_settings(mb)
    return ("" if value == "0" else value), mb


def announce(count: int, value: str, mb: int) -> None:
    """Rank 0's line that the bench's reports look for (the runs' host side)."""
    import torch
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"mm-balance CPU harness: drew {count} micro-batches before the first iteration "
              f"({PREDRAW_ENV}={value})" + (f"; grew each rank's heap by {mb} MiB ({HEAP_ENV}={mb})"
                                             if mb else ""), flush=True)


#: ``MM_BALANCE_CPU_HEAP_MB=N``: the benchmark's setting that faults in N MiB of each rank's
#: heap before the first iteration (:func:`grow_heap`).
HEAP_ENV = "MM_BALANCE_CPU_HEAP_MB"


def heap_mb(value: str) -> int:
    """The heap to grow at setup, in MiB (0: none)."""
    try:
        mb = int(value or 0)
    except ValueError:
        raise ValueError(f"{HEAP_ENV} must be a whole number of MiB (got {value!r})") from None
    if mb < 0:
        raise ValueError(f"{HEAP_ENV} must not be negative (got {mb})")
    return mb


def check_heap_settings(mb: int, env=os.environ) -> None:
    """Refuse a heap the allocator would not keep, or whose pages the loader's workers share.

    glibc maps large blocks outside the heap unless ``MALLOC_MMAP_MAX_=0`` and gives freed
    heap back to the kernel above ``MALLOC_TRIM_THRESHOLD_``; and a worker forked after the
    heap has grown shares its pages copy-on-write, so the rank's every first write to one
    would copy it (the batches drawn first fork the workers at setup)."""
    if not mb:
        return
    why = []
    if env.get("MALLOC_MMAP_MAX_", "").strip() != "0":
        why.append("MALLOC_MMAP_MAX_=0 (else the block is mapped outside the heap and unmapped when freed)")
    try:
        trim = int(env.get("MALLOC_TRIM_THRESHOLD_", "").strip())
    except ValueError:
        trim = -1
    if trim < mb << 20:
        why.append(f"MALLOC_TRIM_THRESHOLD_ of at least {mb << 20} (else the freed heap goes back to the kernel)")
    if env.get(PREDRAW_ENV, "").strip() in ("", "0"):
        why.append(f"{PREDRAW_ENV} (else the loader's workers fork after the heap grows and share its "
                   f"pages copy-on-write)")
    if why:
        raise ValueError(f"{HEAP_ENV}={mb} needs " + "; ".join(why))


def grow_heap(mb: int) -> None:
    """Fault in ``mb`` MiB of this process's heap and free it: with the allocator keeping
    what it frees (:func:`check_heap_settings`), later allocations up to that size reuse
    resident pages instead of faulting new ones in during the measured iterations."""
    if mb:
        import torch
        block = torch.empty(mb << 20, dtype=torch.uint8)
        block.fill_(1)
        del block


def prepare(train, count: int, value: str, mb: int) -> None:
    """What both harnesses do once their framework has built the train iterator(s): draw
    ``count`` micro-batches under them (:func:`predraw_into`), then grow the heap (after the
    loader's workers are forked) and say so (:func:`announce`)."""
    predraw_into(train, count)
    grow_heap(mb)
    announce(count, value, mb)
