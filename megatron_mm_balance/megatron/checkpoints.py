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
rank) and ``common.pt`` are not compared. By default only the model's tensors are: the
distributed optimizer's flat buckets (keys under :data:`OPTIMIZER_PREFIXES`) carry padding
that is saved as whatever memory held (relative "differences" of 1e37 between two runs whose
parameters agree to 1e-7), so they are compared only when asked (``everything=True``). ``ckpt`` may be the checkpoint directory itself or
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
#: key prefixes of optimizer state (megatron-core's distributed optimizer: ``chained_<i>.optimizer...``)
OPTIMIZER_PREFIXES = ("chained_", "optimizer.")


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


def is_optimizer_key(key: str) -> bool:
    return key.startswith(OPTIMIZER_PREFIXES)


def load_tensors(path: str, everything: bool = False) -> Dict[str, "object"]:
    """The model's tensors (``everything``: also the optimizer's) of the torch_dist
    checkpoint at ``path``, whole, on the CPU."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = checkpoint_dir(path)
    reader = dcp.FileSystemReader(ckpt)
    try:
        meta = reader.read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{ckpt}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})") from None
    # zeros: a region no shard covers (padding of a flat optimizer bucket) reads the same in both
    state = {key: torch.zeros(m.size, dtype=m.properties.dtype)
             for key, m in meta.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and (everything or not is_optimizer_key(key))}
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


def relative_difference(a, b) -> float:
    """``max|a - b| / max|a|`` over the tensor (0 for bit-identical ones, inf for a shape
    or dtype mismatch; non-float tensors: 0 or inf)."""
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = a.double().abs().max().item() if a.numel() else 0.0
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


@dataclass
class CheckpointComparison:
    """Which tensors two checkpoints share bit for bit, which differ (and by how much:
    ``max|a - b| / max|a|`` per tensor), which only one has."""

    same: List[str] = field(default_factory=list)
    different: Dict[str, float] = field(default_factory=dict)
    only_a: List[str] = field(default_factory=list)
    only_b: List[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return bool(self.same) and not (self.different or self.only_a or self.only_b)

    #: ``||A - B|| / ||A||`` over all shared float tensors together (L2): one figure for
    #: how far the two models are apart, not dominated by a near-zero bias
    norm_relative_difference: float = 0.0

    @property
    def max_relative_difference(self) -> float:
        """The largest per-tensor relative difference (0 when every shared tensor is identical)."""
        return max(self.different.values(), default=0.0)

    def summary(self) -> str:
        verdict = "IDENTICAL" if self.identical else "DIFFERENT"
        parts = [f"{len(self.same)} tensors bit-identical", f"{len(self.different)} differ"]
        if self.different:
            worst = max(self.different, key=self.different.get)
            parts[-1] += (f" (||A-B||/||A|| {self.norm_relative_difference:.3g}; largest "
                          f"max|a-b|/max|a| {self.different[worst]:.3g}, in {worst})")
        if self.only_a or self.only_b:
            parts.append(f"{len(self.only_a)} only in A, {len(self.only_b)} only in B "
                         f"(e.g. {', '.join((self.only_a + self.only_b)[:3])})")
        return ", ".join(parts) + f": {verdict}"


def compare_checkpoints(a: str, b: str, everything: bool = False) -> CheckpointComparison:
    """Compare every model tensor (``everything``: also the optimizer's) of checkpoints ``a``
    and ``b``: by digest, and for those that differ, by how much."""
    ta, tb = load_tensors(a, everything), load_tensors(b, everything)
    out = CheckpointComparison()
    diff2 = norm2 = 0.0
    for key in sorted(set(ta) | set(tb)):
        if key not in tb:
            out.only_a.append(key)
        elif key not in ta:
            out.only_b.append(key)
        elif tensor_digest(ta[key]) == tensor_digest(tb[key]):
            out.same.append(key)
        else:
            out.different[key] = relative_difference(ta[key], tb[key])
        if key in ta and key in tb and ta[key].is_floating_point() and ta[key].shape == tb[key].shape:
            diff2 += float((ta[key].double() - tb[key].double()).pow(2).sum())
            norm2 += float(ta[key].double().pow(2).sum())
    out.norm_relative_difference = (diff2 / norm2) ** 0.5 if norm2 else (0.0 if diff2 == 0 else float("inf"))
    return out
