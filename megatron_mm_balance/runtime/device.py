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

import torch


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
    """Normalise ``device``; a clear error if it names an unavailable accelerator."""
    if device is None:
        return None
    api = cuda_api()
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
        with api.stream(self.stream):
            dev = api.to_device(buf, self.device)
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

