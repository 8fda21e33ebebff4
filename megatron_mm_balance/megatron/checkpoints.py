"""Bit-exact comparison of two ``torch_dist`` checkpoints: ``mm-balance compare-checkpoints A B``.

Printed losses carry 7 digits; two runs that print the same values may still differ in
their weights. Where the arithmetic allows exact equality (fp32 without expert-parallel
reordering of sums, e.g. Megatron-Bridge's fp32 DP=2 x EP=2 run with balancing off and on),
equality is checked on bits: every tensor of the two checkpoints (parameters and optimizer
state) is loaded and hashed (SHA-256 of its dtype, shape and raw bytes).

A ``torch_dist`` checkpoint (Megatron-LM's and Megatron-Bridge's default format) is a
``torch.distributed.checkpoint`` directory (``.metadata`` plus ``*.distcp`` shards); it is
read here in one process without a process group (``no_dist``), every tensor whole. Its
non-tensor entries (RNG and data-loader states, which balancing legitimately changes per
rank) and ``common.pt`` are not compared. ``ckpt`` may be the checkpoint directory itself or
a save directory (``latest_checkpointed_iteration.txt`` names the iteration, Megatron's
``iter_NNNNNNN`` layout).
"""
from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Dict, List

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """A path that is not a readable torch_dist checkpoint (the message names it)."""


def checkpoint_dir(path: str) -> str:
    """The torch_dist checkpoint directory of ``path``: itself when it holds ``.metadata``,
    else the iteration its tracker file names (``iter_NNNNNNN``)."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{path}: not a torch_dist checkpoint (no .metadata, no {TRACKER})")
    with open(tracker) as f:
        it = f.read().strip()
    sub = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
    if not os.path.isfile(os.path.join(sub, ".metadata")):
        raise CheckpointError(f"{sub}: not a torch_dist checkpoint (no .metadata)")
    return sub


def load_tensors(path: str) -> Dict[str, "object"]:
    """Every tensor of the torch_dist checkpoint at ``path``, whole, on the CPU."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = checkpoint_dir(path)
    reader = dcp.FileSystemReader(ckpt)
    try:
        meta = reader.read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{ckpt}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})") from None
    state = {key: torch.empty(m.size, dtype=m.properties.dtype)
             for key, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(f"{ckpt}: the checkpoint holds no tensor")
    with warnings.catch_warnings():          # "assuming ... a single process": that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def tensor_digest(tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (equal digests: bit-identical tensors)."""
    import torch
    t = tensor.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checkpoint_digests(path: str) -> Dict[str, str]:
    """``{key: digest}`` of every tensor of the checkpoint at ``path``."""
    return {k: tensor_digest(v) for k, v in sorted(load_tensors(path).items())}


@dataclass
class CheckpointComparison:
    """Which tensors two checkpoints share bit for bit, which differ, which only one has."""

    same: List[str] = field(default_factory=list)
    different: List[str] = field(default_factory=list)
    only_a: List[str] = field(default_factory=list)
    only_b: List[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return bool(self.same) and not (self.different or self.only_a or self.only_b)

    def summary(self) -> str:
        verdict = "IDENTICAL" if self.identical else "DIFFERENT"
        parts = [f"{len(self.same)} tensors bit-identical", f"{len(self.different)} differ"]
        if self.only_a or self.only_b:
            parts.append(f"{len(self.only_a)} only in A, {len(self.only_b)} only in B")
        first = (self.different + self.only_a + self.only_b)[:5]
        return ", ".join(parts) + (f" (e.g. {', '.join(first)})" if first else "") + f": {verdict}"


def compare_checkpoints(a: str, b: str) -> CheckpointComparison:
    """Compare every tensor of checkpoints ``a`` and ``b`` by digest."""
    da, db = checkpoint_digests(a), checkpoint_digests(b)
    out = CheckpointComparison()
    for key in sorted(set(da) | set(db)):
        if key not in db:
            out.only_a.append(key)
        elif key not in da:
            out.only_b.append(key)
        else:
            (out.same if da[key] == db[key] else out.different).append(key)
    return out
