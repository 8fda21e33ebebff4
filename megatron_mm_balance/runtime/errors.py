"""Exceptions the runtime raises; every message names the global batch."""
from __future__ import annotations

from typing import Optional


class BalancerError(RuntimeError):
    """Base class: the balanced iterator cannot continue."""

    def __init__(self, message: str, *, global_batch: int | None = None, peers=()):
        super().__init__(message)
        self.global_batch = global_batch
        self.peers = tuple(peers)


class PeerFailure(BalancerError):
    """A peer raised, died or stalled (or this rank could not reach it in time)."""


class InconsistentConfig(BalancerError):
    """Ranks disagree on num_microbatches or solver settings."""


class ExchangeThreadError(BalancerError):
    """The background exchange thread failed; the original is ``__cause__``."""


def batch_name(global_batch: int, first_iteration: Optional[int] = None) -> str:
    """How messages name a global batch: ``global batch 2``, or with the training iteration
    that consumes it when the caller numbers them (``global batch 2 (iteration 5)``)."""
    if first_iteration is None:
        return f"global batch {global_batch}"
    return f"global batch {global_batch} (iteration {first_iteration + global_batch})"


def add_context(exc: BaseException, text: str) -> BaseException:
    """Say where ``exc`` happened without changing it: the ``mm_balance_context`` attribute
    (what a framework's glue prints) and, on Python >= 3.11, a note under the traceback.
    Used for errors the runtime re-raises unchanged (a data source's, a cost function's)."""
    if getattr(exc, "mm_balance_context", None) is None:
        try:
            exc.mm_balance_context = text
        except AttributeError:                 # an exception type with __slots__
            return exc
        if hasattr(exc, "add_note"):
            exc.add_note(f"mm-balance: {text}")
    return exc
