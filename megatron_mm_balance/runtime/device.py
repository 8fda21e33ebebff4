"""Moving received / local packs to the compute device without blocking compute.

Every CUDA call the runtime makes goes through :class:`CudaApi` (:func:`cuda_api`): the
current device of a thread, the side stream, events, host-to-device copies,
``record_stream``. A test puts a stand-in with the same methods in its place
(:func:`set_cuda_api`; :mod:`megatron_mm_balance.testing.fake_cuda`) and checks on a CPU
which device each thread uses and what each stream is asked to do.

On the host (no CUDA) there is nothing to do: buffers are used as received.
:class:`CudaMover` owns a dedicated stream: the exchange thread copies each pack's
pinned host buffer to the device on that stream and records an event; the consumer
makes its current stream wait on that event (not on the whole side stream) and calls
``record_stream`` so the caching allocator never hands the memory to another tensor
while the compute stream may still read it.

The current CUDA device is per thread, and a new thread starts on device 0. The
exchange thread therefore sets the device its iterator was built on
(:func:`thread_device`) before anything else: it pulls from the train loader, whose
first ``next()`` may start the loader's pin-memory thread, which pins for the device
current where it is started.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch

from .config import DEFAULT_PINNED_BYTES


class CudaApi:
    """The CUDA calls of the runtime (``torch.cuda``), in one place."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def new_stream(self, device: torch.device):
        with torch.cuda.device(device):
            return torch.cuda.Stream(device)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def new_event(self):
        return torch.cuda.Event()

    def to_device(self, buf: torch.Tensor, device: torch.device) -> torch.Tensor:
        return buf.to(device, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def range_push(self, name: str) -> None:
        torch.cuda.nvtx.range_push(name)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()


_API = CudaApi()


def cuda_api():
    """The CUDA calls the runtime makes (a test may have put a stand-in in their place)."""
    return _API


def set_cuda_api(api):
    """Put ``api`` in place of :class:`CudaApi` (tests); returns the one it replaces."""
    global _API
    previous, _API = _API, api
    return previous


def resolve_device(device) -> torch.device | None:
    """Normalise ``device``; a clear error if it names an unavailable accelerator.
    ``"auto"``: the current CUDA device where CUDA is available, else None (packs stay
    where the source put them)."""
    if device is None:
        return None
    api = cuda_api()
    if device == "auto":
        return torch.device("cuda", api.current_device()) if api.is_available() else None
    try:
        dev = torch.device(device) if not isinstance(device, torch.device) else device
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda":
        if not api.is_available():
            raise ValueError(f"device={device!r} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", api.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range around a phase of the exchange (seen in Nsight Systems); nothing
    without CUDA."""
    api = cuda_api()
    if not api.is_available():
        yield
        return
    api.range_push(name)
    try:
        yield
    finally:
        api.range_pop()


def thread_device(device: torch.device | None) -> int | None:
    """The CUDA device the exchange thread must run on: the delivery device when it is a
    GPU, else the device current where the iterator is built (the rank's, as the
    training set it); None without CUDA."""
    if device is not None and device.type == "cuda":
        return device.index
    api = cuda_api()
    return api.current_device() if api.is_available() else None


def enter_thread(index: int | None) -> None:
    """First thing in the exchange thread: make ``index`` its current CUDA device."""
    if index is not None:
        cuda_api().set_device(index)


class CudaMover:
    """Host-to-device copies on a dedicated stream, released to the consumer by event."""

    pin_memory = True

    def __init__(self, device: torch.device):
        self.device = device
        self.api = cuda_api()
        self.stream = self.api.new_stream(device)

    def to_device(self, buf: torch.Tensor):
        """Copy a (pinned) host buffer on the side stream; returns (device buffer, event)."""
        api = self.api
        with nvtx_range("mm-balance copy to device"), api.stream(self.stream):
            dev = api.to_device(buf, self.device)
            event = api.new_event()
            event.record(self.stream)
        return dev, event

    def parts_to_device(self, parts, offsets, nbytes: int):
        """Copy each pinned host tensor of ``parts`` (flat bytes) into one device buffer at its
        offset, on the side stream (no staging copy on the host); ``(device buffer, event)``."""
        api = self.api
        with nvtx_range("mm-balance copy to device"), api.stream(self.stream):
            dev = api.device_empty(nbytes, self.device)
            for part, offset in zip(parts, offsets):
                if part.numel():
                    api.copy_async(dev[offset: offset + part.numel()], part)
            event = api.new_event()
            event.record(self.stream)
        return dev, event

    def ready(self, event, buffers) -> None:
        """Consumer side: compute stream waits for the copy; allocator learns of the use."""
        if event is None:
            return
        current = self.api.current_stream(self.device)
        current.wait_event(event)
        for b in buffers:                   # the device buffers this mover's copies made
            self.api.record_stream(b, current)


#: the smallest pinned buffer the pool makes (smaller packs share its size class)
MIN_SLAB_BYTES = 1 << 16


def _slab_size(nbytes: int) -> int:
    return max(MIN_SLAB_BYTES, 1 << (int(nbytes) - 1).bit_length())


class _Slab:
    """One pinned buffer of the pool: free, or lent out (``lent``) until its host tensor is
    gone (``alive`` False) and the device work that reads it is done (``fence`` completed)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.array = tensor.numpy()          # the memory, for per-lease tensors of their own
        self.size = tensor.numel()
        self.lent = False
        self.alive = False
        self.fence = None

    def released(self) -> None:              # a finalizer: any thread, no lock
        self.alive = False


@dataclass(frozen=True)
class PoolStats:
    """What a :class:`PinnedPool` holds and has done (``bytes`` never exceeds ``cap``)."""

    cap: int
    bytes: int
    buffers: int
    lent: int
    takes: int
    reused: int
    overflows: int
    evicted: int


class PinnedPool:
    """Pinned host memory for the packs of one iterator, capped at ``cap`` bytes and reused.

    :meth:`take` lends a buffer of at least ``nbytes`` (powers of two from 64 KiB): a free
    one that fits, else a new one while the pool stays under its cap (making room by freeing
    smaller free ones if it must), else pageable memory (an ``overflow``, counted: correct,
    only slower). Each lent buffer is a tensor with its own storage over the pool's memory,
    so the pool learns when the last view of it is gone (a finalizer), whichever thread
    drops it. It is free again once the device work that may read it has completed:

    * a copy this iterator made (:meth:`release_after`: the side stream's event);
    * when it was delivered on the host (``device`` None/``"cpu"`` on a GPU job, where the
      framework copies it to the device itself): everything the consumer's stream had
      been given when the consumer next asks for a micro-batch, :meth:`fence` (a copy the
      framework enqueued from it came before its last view was dropped).

    Nothing here blocks: completion is polled with ``event.query()``. Used only where CUDA
    is available; the host-only runtime allocates plain tensors.
    """

    def __init__(self, cap: int = DEFAULT_PINNED_BYTES, api=None):
        self.cap = int(cap)
        self.api = api or cuda_api()
        self._slabs: list[_Slab] = []
        self._by_ptr: dict[int, _Slab] = {}
        self._held: list[tuple] = []        # (event, objects kept alive until it completes)
        self._lock = threading.Lock()
        self.bytes = 0
        self.takes = self.reused = self.overflows = self.evicted = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` (uint8): pinned from the pool, or pageable when it is full."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            self._reclaim()
            self.takes += 1
            slab = self._fit(nbytes)
            if slab is not None:
                self.reused += 1
            else:
                slab = self._grow(nbytes)
            if slab is None:
                self.overflows += 1
                return torch.empty(nbytes, dtype=torch.uint8)
            slab.lent, slab.alive, slab.fence = True, True, None
        view = slab.array[:nbytes]
        out = torch.from_numpy(view)            # a storage of its own, over the slab's memory
        weakref.finalize(view, slab.released)
        return out

    def release_after(self, tensor: torch.Tensor, event, keep=()) -> None:
        """``tensor`` (and ``keep``) may be reused / dropped once ``event`` has completed."""
        with self._lock:
            slab = self._by_ptr.get(tensor.data_ptr())
            if slab is not None and slab.lent:
                slab.fence = event
            if keep:
                self._held.append((event, tuple(keep)))

    def fence(self, stream) -> None:
        """Consumer side, at each delivery: buffers whose host views are gone and that no
        copy of ours fences wait for everything ``stream`` has been given so far."""
        with self._lock:
            waiting = [s for s in self._slabs if s.lent and not s.alive and s.fence is None]
        if not waiting:
            return
        event = self.api.new_event()
        event.record(stream)
        with self._lock:
            for s in waiting:
                if s.fence is None:
                    s.fence = event

    def stats(self) -> PoolStats:
        with self._lock:
            self._reclaim()
            return PoolStats(cap=self.cap, bytes=self.bytes, buffers=len(self._slabs),
                             lent=sum(s.lent for s in self._slabs), takes=self.takes,
                             reused=self.reused, overflows=self.overflows, evicted=self.evicted)

    # -- under the lock -------------------------------------------------------------------
    def _reclaim(self) -> None:
        for s in self._slabs:
            if s.lent and not s.alive and s.fence is not None and s.fence.query():
                s.lent, s.fence = False, None
        self._held = [(e, k) for e, k in self._held if not e.query()]

    def _fit(self, nbytes: int):
        free = [s for s in self._slabs if not s.lent and s.size >= nbytes]
        return min(free, key=lambda s: s.size) if free else None

    def _grow(self, nbytes: int):
        size = _slab_size(nbytes)
        if size > self.cap:
            return None
        if self.bytes + size > self.cap:         # free smaller idle buffers to make room
            for s in sorted((s for s in self._slabs if not s.lent), key=lambda s: s.size):
                if self.bytes + size <= self.cap:
                    break
                self._slabs.remove(s)
                del self._by_ptr[s.tensor.data_ptr()]
                self.bytes -= s.size
                self.evicted += 1
            if self.bytes + size > self.cap:
                return None
        slab = _Slab(self.api.pinned_empty(size))
        self._slabs.append(slab)
        self._by_ptr[slab.tensor.data_ptr()] = slab
        self.bytes += size
        return slab
