"""``MM_BALANCE_FAULT``: a test hook that injects one fault into the runtime.

The fault tests (``tests/realpath/test_real_path_faults.py``, ``tests/runtime``) start
real jobs through the user's launcher and need a rank to die or its data source to fail
at a chosen point. The variable is read here and nowhere else (:func:`configured`, once
per :class:`~.engine.Engine`); unset (always, outside tests) nothing of this module
acts::

    MM_BALANCE_FAULT=KIND:rank=R:iteration=I:microstep=K

``KIND``:

* ``kill``: global rank ``R`` SIGKILLs itself when its exchange of micro-step ``K`` of
  iteration ``I`` starts (a rank lost mid-exchange: peers wait on its packs). It prints one
  line first, naming itself and where.
* ``raise``: rank ``R``'s data source raises :class:`InjectedFault` when asked for
  micro-step ``K``'s pack of iteration ``I`` (a loader failing in the middle of a global
  batch).
* ``end``: rank ``R``'s data source ends there, as a finite loader that runs out after
  ``K`` packs of that global batch (a data set that ends mid-global-batch).
* ``corrupt``: rank ``R``'s data source delivers micro-step ``K``'s pack of iteration ``I``
  with image metadata that contradicts its tensors, as a task encoder with a bug would: its
  first image's ``num_tiles`` entry (examples/multimodal packs) or grid ``t`` (Qwen-VL's
  ``image_grid_thw``) is one larger than the pixels hold. (Stock Megatron-LM cannot make one
  from raw data: its example's encoder derives both from the image, and its tokenizer refuses
  an ``<image>`` inside a caption, which energon's error handler then skips.)

``iteration`` is the training iteration that consumes the global batch, as the caller
numbers it (:class:`~.iterator.BalancedDataIterator`'s ``first_iteration`` plus the global
batch; without ``first_iteration``, the global batch + 1: a fresh job's iteration).
``microstep`` is the pack's position in that rank's global batch, 0-based. A fault fires
at most once per process. A malformed value is a one-line ``ValueError`` naming the
variable.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Optional

from .log_line import emit_line

ENV = "MM_BALANCE_FAULT"
KINDS = ("kill", "raise", "end", "corrupt")
_FIELDS = ("rank", "iteration", "microstep")


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault makes the data source raise."""


@dataclass
class Fault:
    """One parsed ``MM_BALANCE_FAULT``: what happens, on which rank, where."""

    kind: str
    rank: int
    iteration: int
    microstep: int
    spec: str = ""
    fired: bool = field(default=False, compare=False)

    def _due(self, kind: str, iteration: int, microstep: int) -> bool:
        if self.fired or self.kind != kind or (iteration, microstep) != (self.iteration, self.microstep):
            return False
        self.fired = True
        return True

    def at_pull(self, iteration: int, microstep: int, where: str) -> bool:
        """Before the source is asked for micro-step ``microstep``'s pack: raises for a
        ``raise`` fault; True for an ``end`` fault (the source has nothing more)."""
        if self._due("raise", iteration, microstep):
            raise InjectedFault(f"{ENV}={self.spec}: rank {self.rank}'s data source raises pulling "
                                f"the pack of micro-step {microstep} at {where}")
        return self._due("end", iteration, microstep)

    def after_pull(self, iteration: int, microstep: int, pack):
        """The pack the source gave for ``microstep``: contradicted by a ``corrupt`` fault."""
        if not self._due("corrupt", iteration, microstep):
            return pack
        return contradict_image_metadata(pack, f"{ENV}={self.spec}")

    def at_exchange(self, iteration: int, microstep: int, where: str) -> None:
        """When this rank's exchange of ``microstep`` starts: a ``kill`` fault ends the process."""
        if self._due("kill", iteration, microstep):
            emit_line(f"[mm-balance] rank {self.rank}: {ENV}={self.spec}: SIGKILL during the exchange of "
                      f"micro-step {microstep} at {where}", sys.stderr)
            os.kill(os.getpid(), signal.SIGKILL)


def contradict_image_metadata(pack, label: str):
    """A copy of ``pack`` whose first image claims one tile (or frame) more than its pixels hold."""
    import torch
    if not isinstance(pack, dict):
        raise ValueError(f"{label}: the pack is a {type(pack).__name__}, not a dict of tensors")
    for key in ("num_tiles", "image_grid_thw"):
        value = pack.get(key)
        if isinstance(value, torch.Tensor) and value.numel():
            bad = value.clone()
            bad.view(-1)[0] += 1
            return {**pack, key: bad}
    raise ValueError(f"{label}: the pack has no image metadata to contradict (num_tiles, image_grid_thw)")


def parse(spec: str) -> Fault:
    """``KIND:rank=R:iteration=I:microstep=K`` as a :class:`Fault` (see the module docstring)."""
    kind, *parts = spec.strip().split(":")
    if kind not in KINDS:
        raise ValueError(f"{ENV}={spec!r}: the kind must be one of {', '.join(KINDS)}")
    values = {}
    for part in parts:
        name, eq, value = part.partition("=")
        if not eq or name not in _FIELDS or name in values:
            raise ValueError(f"{ENV}={spec!r}: expected {kind}:rank=R:iteration=I:microstep=K")
        try:
            values[name] = int(value)
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: {name} must be an integer, got {value!r}") from None
    missing = [f for f in _FIELDS if f not in values]
    if missing or values["rank"] < 0 or values["iteration"] < 1 or values["microstep"] < 0:
        raise ValueError(f"{ENV}={spec!r}: expected {kind}:rank=R:iteration=I:microstep=K "
                         f"(rank >= 0, iteration >= 1, microstep >= 0)")
    return Fault(kind, values["rank"], values["iteration"], values["microstep"], spec.strip())


def configured(rank: int) -> Optional[Fault]:
    """The fault ``MM_BALANCE_FAULT`` asks of global rank ``rank`` (None: unset, or another rank's)."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return None
    fault = parse(spec)
    return fault if fault.rank == rank else None
