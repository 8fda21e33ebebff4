"""A stand-in for the runtime's CUDA calls, so their use can be checked on a CPU.

:class:`FakeCuda` has the methods of :class:`~megatron_mm_balance.runtime.device.CudaApi`
and records every call: which thread made it, on which (fake) current device and under
which stream. Put it in place with :func:`~megatron_mm_balance.runtime.device.set_cuda_api`.
It behaves as CUDA does where it matters to the runtime:

* the current device is per thread and a new thread starts on device 0;
* "device" memory is CPU memory in a :class:`FakeDeviceTensor`, a tensor subclass that
  reports every read that would copy device memory to the host (:class:`DeviceReads`);
* "pinned" memory is ordinary CPU memory (counted, so a pool's growth shows);
* streams and events only record what they are asked to do; a copy completes at once.

:class:`DeviceReads` counts the device-to-host reads (``.cpu()``, ``.item()``,
``.tolist()``, ``.numpy()``, Python conversions, blocking copies to the host, reads with a
data-dependent size) of :class:`FakeDeviceTensor` values while it is active, in every
thread, and attributes each to the code that asked for it: the innermost frame outside
torch, in this package (``ours``) or elsewhere (``upstream``: the framework, the model).

Tests only; the package never imports it on its normal path.
"""
from __future__ import annotations

import contextlib
import os
import threading
import traceback
from dataclasses import dataclass

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TESTING_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclass
class Call:
    """One recorded call: the thread, what was called, its argument, the thread's current
    device and the stream current on that thread when it was made."""

    thread: str
    name: str
    arg: object
    device: int
    stream: str


class FakeStream:
    def __init__(self, cuda: "FakeCuda", device: int, name: str):
        self.cuda, self.device, self.name = cuda, device, name

    def wait_event(self, event) -> None:
        self.cuda._log("wait_event", (self.name, event.name))

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, cuda: "FakeCuda", name: str):
        self.cuda, self.name, self.stream = cuda, name, None

    def record(self, stream=None) -> None:
        self.stream = (stream or self.cuda.current_stream(None)).name
        self.cuda._log("record_event", (self.name, self.stream))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.cuda._log("event_synchronize", self.name)


class FakeCuda:
    """The runtime's CUDA calls on a CPU (see the module docstring)."""

    def __init__(self, device_count: int = 8):
        self.device_count = device_count
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._streams = 0
        self._events = 0
        self.pinned_bytes = 0            # allocated through pinned_empty, ever
        self.pinned_allocations = 0
        self._pinned: list = []          # (address, bytes, tensor) of every pinned allocation

    # -- bookkeeping -------------------------------------------------------------------
    def _log(self, name: str, arg=None) -> None:
        stream = getattr(self._local, "stream", None)
        call = Call(threading.current_thread().name, name, arg, self.current_device(),
                    stream.name if stream is not None else f"default:{self.current_device()}")
        with self._lock:
            self.calls.append(call)

    def calls_named(self, name: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.name == name]

    def by_thread(self, thread: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.thread == thread]

    # -- CudaApi -----------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, index) -> None:
        index = index.index if isinstance(index, torch.device) else int(index)
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"invalid device ordinal {index}")
        self._local.device = index
        self._log("set_device", index)

    def new_stream(self, device: torch.device):
        with self._lock:
            self._streams += 1
            name = f"side{self._streams}:{device.index}"
        self._log("new_stream", name)
        return FakeStream(self, device.index, name)

    @contextlib.contextmanager
    def stream(self, stream):
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def current_stream(self, device):
        stream = getattr(self._local, "stream", None)
        if stream is not None:
            return stream
        index = self.current_device() if device is None else device.index
        return FakeStream(self, index, f"default:{index}")

    def new_event(self):
        with self._lock:
            self._events += 1
            name = f"event{self._events}"
        return FakeEvent(self, name)

    def to_device(self, buf: torch.Tensor, device: torch.device) -> torch.Tensor:
        self._log("to_device", buf.numel())
        with torch._C.DisableTorchFunctionSubclass():
            out = buf.detach().clone()
        return out.as_subclass(FakeDeviceTensor)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self._log("record_stream", stream.name)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self.pinned_bytes += nbytes
            self.pinned_allocations += 1
            self._pinned.append((out.data_ptr(), nbytes, out))
        self._log("pinned_empty", nbytes)
        return out

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in "pinned" memory (what a loader with ``pin_memory`` gives)."""
        flat = self.pinned_empty(tensor.numel() * tensor.element_size())
        out = flat.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.data_ptr()
        with self._lock:
            return any(base <= ptr < base + n for base, n, _ in self._pinned)

    def device_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self._log("device_empty", nbytes)
        return torch.empty(nbytes, dtype=torch.uint8).as_subclass(FakeDeviceTensor)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._log("copy_async", src.numel())
        with torch._C.DisableTorchFunctionSubclass():
            dst.copy_(src)

    def range_push(self, name: str) -> None:
        self._log("range_push", name)

    def range_pop(self) -> None:
        self._log("range_pop")


# -- device-to-host reads -----------------------------------------------------------------

def _is_cpu_target(args, kwargs) -> bool:
    """Whether ``Tensor.to(...)`` asks for the host."""
    for a in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
        if isinstance(a, torch.Tensor) and not isinstance(a, FakeDeviceTensor):
            return True                  # .to(other): like a host tensor
    return False


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


_READS = {
    torch.Tensor.cpu: "cpu()", torch.Tensor.item: "item()", torch.Tensor.tolist: "tolist()",
    torch.Tensor.numpy: "numpy()", torch.Tensor.__bool__: "bool()", torch.Tensor.__int__: "int()",
    torch.Tensor.__float__: "float()", torch.Tensor.__index__: "index()",
    torch.Tensor.__complex__: "complex()", torch.Tensor.__repr__: "repr()",
    torch.Tensor.__format__: "format()", torch.Tensor.nonzero: "nonzero()", torch.nonzero: "nonzero()",
    torch.masked_select: "masked_select()", torch.Tensor.masked_select: "masked_select()",
    torch.unique: "unique()", torch.Tensor.unique: "unique()", torch.equal: "equal()",
    torch.allclose: "allclose()", torch.Tensor.allclose: "allclose()",
}


class FakeDeviceTensor(torch.Tensor):
    """CPU memory standing in for device memory: see :class:`DeviceReads`."""

    #: called with a description of each device-to-host read (set by :class:`DeviceReads`)
    on_read = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _READS.get(func)
        if func is torch.Tensor.to and _is_cpu_target(args, kwargs):
            what = "to(cpu)"
        elif func is torch.Tensor.copy_ and not isinstance(args[0], FakeDeviceTensor):
            what = "copy_ to host" + (" (non_blocking)" if kwargs.get("non_blocking") else "")
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1 \
                and _has_bool_index(args[1]):
            what = "boolean-mask indexing"
        if what is not None and cls.on_read is not None:
            cls.on_read(what)
        if what in ("cpu()", "to(cpu)"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)   # a host tensor, as CUDA gives
        return super().__torch_function__(func, types, args, kwargs)


@dataclass
class Read:
    """One device-to-host read: what, whose (``ours`` / ``upstream``), where, and the thread."""

    what: str
    owner: str
    where: str
    thread: str


def owner_of(stack) -> tuple:
    """``(owner, "file:line")`` of a read from its stack (innermost last): the innermost frame
    outside torch, this module and any ``__torch_function__`` dispatch decides; this package (but not its ``testing`` stand-ins
    for a framework) is ``ours``, anything else ``upstream``."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path == os.path.abspath(__file__) \
                or frame.name == "__torch_function__":          # dispatch (a mode), not a caller
            continue
        mine = path.startswith(_PACKAGE_DIR) and not path.startswith(_TESTING_DIR)
        return ("ours" if mine else "upstream"), f"{path}:{frame.lineno}"
    return "upstream", "?"


class DeviceReads:
    """Count :class:`FakeDeviceTensor` reads to the host, in every thread, while active::

        with DeviceReads() as reads:
            ...                              # one micro-step
        assert reads.ours() == []
    """

    def __init__(self):
        self.reads: list[Read] = []
        self._lock = threading.Lock()

    def _record(self, what: str) -> None:
        owner, where = owner_of(traceback.extract_stack()[:-2])
        with self._lock:
            self.reads.append(Read(what, owner, where, threading.current_thread().name))

    def ours(self) -> list[Read]:
        return [r for r in self.reads if r.owner == "ours"]

    def upstream(self) -> list[Read]:
        return [r for r in self.reads if r.owner == "upstream"]

    def __enter__(self):
        FakeDeviceTensor.on_read = self._record
        return self

    def __exit__(self, *exc):
        FakeDeviceTensor.on_read = None
        return False
