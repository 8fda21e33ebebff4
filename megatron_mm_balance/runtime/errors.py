"""Exceptions the runtime raises; every message names the global batch."""
from __future__ import annotations


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
