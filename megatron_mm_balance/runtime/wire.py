"""Wire format of one pack: a pickled header plus one contiguous byte buffer.

A pack is any nesting of dicts, lists and tuples whose leaves are tensors or
plain picklable values. :func:`encode` replaces every tensor by a
:class:`TensorRef` (shape, dtype, device type, byte offset) and writes

    [ pickled header | pad | tensor 0 bytes | pad | tensor 1 bytes | ... ]

into a single ``uint8`` tensor, so a pack of ragged tensors travels as two
point-to-point messages (a 2-int64 size record, then the buffer) with no
padding to a common shape. :func:`decode` rebuilds the structure with tensors
that are views into the received buffer (offsets are 64-byte aligned, so the
dtype views are legal for every dtype). Values arrive bit-identical; a
non-contiguous tensor arrives contiguous with the same values.
"""
from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

import torch

ALIGN = 64


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for a tensor in the pickled header."""

    offset: int
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    device_type: str


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of the tensor's values (copying only if needed)."""
    if t.layout != torch.strided:
        raise TypeError(f"cannot exchange a tensor with layout {t.layout}; only dense tensors")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.uint8:
        return t
    return t.view(torch.uint8)


@dataclass(frozen=True)
class _Slot:
    index: int


def _map(obj, leaf, kind):
    """Rebuild dicts / lists / tuples / namedtuples, applying ``leaf`` to ``kind`` leaves."""
    if isinstance(obj, kind):
        return leaf(obj)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: _map(v, leaf, kind) for k, v in obj.items()}
        out = copy.copy(obj)                     # OrderedDict, defaultdict, ...
        for k, v in obj.items():
            out[k] = _map(v, leaf, kind)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):          # namedtuple
        return type(obj)(*(_map(v, leaf, kind) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, leaf, kind) for v in obj)
    return obj


def _strip(obj, tensors: list):
    """The structure with tensors replaced by their index in ``tensors``."""
    def leaf(t):
        tensors.append(t)
        return _Slot(len(tensors) - 1)
    return _map(obj, leaf, torch.Tensor)


def encode(pack, *, pin_memory: bool = False) -> tuple[torch.Tensor, int]:
    """``(buffer, header_len)``: the pack as one CPU ``uint8`` buffer."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(pack, tensors)
    flats = [_as_bytes(t) for t in tensors]
    # The header's size depends on the offsets, the offsets on the header's size:
    # pickle once with relative offsets and shift them by the aligned header size.
    rel, pos = [], 0
    for f in flats:
        rel.append(pos)
        pos = _align(pos + f.numel())
    refs = [TensorRef(o, f.numel(), tuple(t.shape), t.dtype, t.device.type)
            for o, f, t in zip(rel, flats, tensors)]
    header = pickle.dumps(_map(skeleton, lambda s: refs[s.index], _Slot),
                          protocol=pickle.HIGHEST_PROTOCOL)
    base = _align(len(header))
    total = base + pos
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin_memory)
    buf[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for o, f in zip(rel, flats):
        if f.numel():
            buf[base + o: base + o + f.numel()].copy_(f, non_blocking=False)
    return buf, len(header)


def read_header(buf: torch.Tensor, header_len: int):
    """The pickled structure at the head of a CPU buffer (tensors as :class:`TensorRef`)."""
    return pickle.loads(buf[:header_len].numpy().tobytes())


def device_types(header) -> set[str]:
    """Device types the sender's tensors lived on."""
    found: set[str] = set()

    def leaf(ref):
        found.add(ref.device_type)
        return ref

    _map(header, leaf, TensorRef)
    return found


def decode(header, header_len: int, pick) -> object:
    """Rebuild a pack from its header; ``pick(ref)`` gives the buffer (CPU or device)
    holding the bytes. Tensors are views into that buffer."""
    base = _align(header_len)

    def leaf(ref: TensorRef):
        buf = pick(ref)
        raw = buf[base + ref.offset: base + ref.offset + ref.nbytes]
        if ref.dtype != torch.uint8:
            raw = raw.view(ref.dtype)
        return raw.reshape(ref.shape)

    return _map(header, leaf, TensorRef)
