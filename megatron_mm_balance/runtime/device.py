"""Moving received / local packs to the compute device without blocking compute.

On the host (CPU, gloo) there is nothing to do: the no-op stream is simply the
absence of a mover and buffers are used as received. :class:`CudaMover` owns a dedicated
``torch.cuda.Stream``: the exchange thread copies each pack's pinned host buffer
to the device on that stream and records an event; the consumer makes its
current stream wait on that event (not on the whole side stream) and calls
``record_stream`` so the caching allocator never hands the memory to another
tensor while the compute stream may still read it.
"""
from __future__ import annotations

import torch


def resolve_device(device) -> torch.device | None:
    """Normalise ``device``; a clear error if it names an unavailable accelerator."""
    if device is None:
        return None
    try:
        dev = torch.device(device) if not isinstance(device, torch.device) else device
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


class CudaMover:
    """Host-to-device copies on a dedicated stream, released to the consumer by event."""

    pin_memory = True

    def __init__(self, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)

    def enter_thread(self) -> None:
        # The current device is per thread: pin the exchange thread to ours.
        torch.cuda.set_device(self.device)

    def to_device(self, buf: torch.Tensor):
        """Copy a (pinned) host buffer on the side stream; returns (device buffer, event)."""
        with torch.cuda.stream(self.stream):
            dev = buf.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return dev, event

    def ready(self, event, buffers) -> None:
        """Consumer side: compute stream waits for the copy; allocator learns of the use."""
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for b in buffers:
            if b.is_cuda:
                b.record_stream(current)
