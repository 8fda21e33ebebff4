"""Wire format of one pack: a pickled header, then the tensors' raw bytes.

A pack is any nesting of dicts, lists, tuples and dataclass instances (their
fields; e.g. Megatron-Bridge's ``GenericVisualInputs``) whose leaves are tensors
or plain picklable values. :func:`split` replaces every tensor by a
:class:`TensorRef` (shape, dtype, device type, byte offset in the data buffer)
and returns the pickled header plus each tensor's bytes as a flat ``uint8``
view, with no copy for contiguous CPU tensors. The receiver learns the sizes
from the header, allocates one data buffer laid out as

    [ tensor 0 bytes | pad | tensor 1 bytes | pad | ... ]     (64-byte aligned)

and receives each tensor straight into its slice, so ragged packs travel with
no padding to a common shape and no staging copy on either side.
:func:`decode` rebuilds the structure with tensors that are views into that
buffer (aligned offsets make the dtype views legal for every dtype). Values
arrive bit-identical; a non-contiguous tensor arrives contiguous with the same
values. :func:`encode` writes header-less packs into one buffer (used to move a
local pack to the device in a single copy).
"""
from __future__ import annotations

import copy
import dataclasses
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
    """Rebuild dicts / lists / tuples / namedtuples / dataclasses, applying ``leaf`` to ``kind`` leaves."""
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
    if dataclasses.is_dataclass(obj) and not isinstance(obj, (type, TensorRef, _Slot)):
        out = copy.copy(obj)                     # fields set directly: no __init__ re-run
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _map(getattr(obj, f.name), leaf, kind))
        return out
    return obj


def tensor_devices(obj) -> list:
    """The device of every tensor in a pack, in structure order."""
    found = []
    _map(obj, lambda t: found.append(t.device) or t, torch.Tensor)
    return found


def _strip(obj, tensors: list):
    """The structure with tensors replaced by their index in ``tensors``."""
    def leaf(t):
        tensors.append(t)
        return _Slot(len(tensors) - 1)
    return _map(obj, leaf, torch.Tensor)


@dataclass
class Split:
    """A pack ready to send: header bytes, each tensor's flat bytes, data size."""

    header: bytes
    parts: list
    data_nbytes: int


def split(pack) -> Split:
    """Header plus flat byte views of the pack's tensors (see module docstring)."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(pack, tensors)
    parts = [_as_bytes(t) for t in tensors]
    offsets, pos = [], 0
    for f in parts:
        offsets.append(pos)
        pos = _align(pos + f.numel())
    refs = [TensorRef(o, f.numel(), tuple(t.shape), t.dtype, t.device.type)
            for o, f, t in zip(offsets, parts, tensors)]
    header = pickle.dumps(_map(skeleton, lambda s: refs[s.index], _Slot),
                          protocol=pickle.HIGHEST_PROTOCOL)
    return Split(header, parts, pos)


def refs_of(header) -> list[TensorRef]:
    """The header's tensor references, in data-buffer order."""
    out: list[TensorRef] = []

    def leaf(ref):
        out.append(ref)
        return ref

    _map(header, leaf, TensorRef)
    return sorted(out, key=lambda r: r.offset)


def encode(pack, *, alloc=None):
    """``(header, data)``: the unpickled header and one CPU buffer holding every tensor
    (``alloc(nbytes)``: where that buffer comes from, e.g. a pinned pool; default a new
    pageable one)."""
    sp = split(pack)
    data = alloc(sp.data_nbytes) if alloc is not None else torch.empty(sp.data_nbytes, dtype=torch.uint8)
    header = pickle.loads(sp.header)
    for ref, f in zip(refs_of(header), sp.parts):
        if f.numel():
            data[ref.offset: ref.offset + f.numel()].copy_(f.cpu() if f.is_cuda else f)
    return header, data


def read_header(raw: torch.Tensor):
    """Unpickle a header received as a ``uint8`` tensor."""
    return pickle.loads(raw.numpy().tobytes())


def device_types(header) -> set[str]:
    """Device types the sender's tensors lived on."""
    found: set[str] = set()

    def leaf(ref):
        found.add(ref.device_type)
        return ref

    _map(header, leaf, TensorRef)
    return found


def decode(header, pick) -> object:
    """Rebuild a pack from its header; ``pick(ref)`` gives the data buffer (CPU or
    device) holding the bytes. Tensors are views into that buffer."""
    def leaf(ref: TensorRef):
        raw = pick(ref)[ref.offset: ref.offset + ref.nbytes]
        if ref.dtype != torch.uint8:
            raw = raw.view(ref.dtype)
        return raw.reshape(ref.shape)

    return _map(header, leaf, TensorRef)
