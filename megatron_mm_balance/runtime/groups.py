"""Process groups for the exchange, and the store-backed progress board used to
name the peer behind a failure.

The exchange never issues collectives on the training's groups: a second thread
doing so on a communicator the training also uses can deadlock (NCCL) or
interleave messages. It gets its own gloo group over the same ranks.

``torch.distributed.new_group`` is collective over the WORLD: every world rank
must call it, in the same order, even ranks not in the new group. So

* :func:`new_exchange_groups` is what a framework calls at initialisation on
  every rank with the list of all data-parallel rank lists; it returns the group
  holding this rank;
* :func:`exchange_group_for` (used when ``BalancedDataIterator`` gets no
  ``exchange_group``) creates one on the spot, which is only safe when every
  world rank constructs its iterator at the same time.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from .config import DEFAULT_TIMEOUT_S

EXCHANGE_BACKEND = "gloo"


def _timedelta(timeout) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def group_ranks(group) -> list[int]:
    """Global ranks of ``group`` (None: the world), in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def new_exchange_groups(rank_lists, timeout=DEFAULT_TIMEOUT_S, backend: str = EXCHANGE_BACKEND):
    """Create one exchange group per rank list; returns the one holding this rank.

    Collective over the world: every world rank must call this with the same
    ``rank_lists`` in the same order. Returns None if this rank is in no list.
    """
    if not dist.is_initialized():
        raise RuntimeError("new_exchange_groups needs torch.distributed to be initialised")
    me = dist.get_rank()
    mine = None
    seen: set[int] = set()
    for ranks in rank_lists:
        ranks = [int(r) for r in ranks]
        dup = seen.intersection(ranks)
        if dup:
            raise ValueError(f"rank(s) {sorted(dup)} appear in more than one exchange group")
        seen.update(ranks)
        g = dist.new_group(ranks, timeout=_timedelta(timeout), backend=backend)
        if me in ranks:
            mine = g
    return mine


def exchange_group_for(ranks, timeout=DEFAULT_TIMEOUT_S, backend: str = EXCHANGE_BACKEND):
    """A new exchange group over ``ranks`` (collective over the world, see module doc)."""
    return dist.new_group(list(ranks), timeout=_timedelta(timeout), backend=backend)


class ProgressBoard:
    """Each rank posts "reached global batch b" and, on failure, its error, in the
    default store, so a rank that times out can say which peer is behind or failed.

    Best effort: if the store is unreachable (e.g. rank 0, which hosts it, died)
    the diagnosis says so instead of naming a peer.
    """

    def __init__(self, prefix: str, ranks: list[int]):
        self.prefix = prefix
        self.ranks = ranks
        self.posted = False
        try:
            from torch.distributed.distributed_c10d import _get_default_store
            self.store = _get_default_store()
        except Exception:                                  # pragma: no cover
            self.store = None

    def key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def clear(self, rank: int) -> None:
        """Forget ``rank``'s own posts under this prefix (an earlier iterator's), best effort.
        Each rank clears only its own keys, before posting, so no peer's post is lost."""
        self.posted = False
        if self.store is not None:
            for kind in ("gb", "err"):
                try:
                    self.store.delete_key(self.key(kind, rank))
                except Exception:
                    pass

    def post_progress(self, rank: int, global_batch: int) -> None:
        if self.store is not None:
            try:
                self.store.set(self.key("gb", rank), str(global_batch))
            except Exception:
                pass

    def post_error(self, rank: int, message: str, overwrite: bool = True) -> None:
        if not overwrite and self.posted:
            return
        self.posted = True
        if self.store is not None:
            try:
                self.store.set(self.key("err", rank), message[:2000])
            except Exception:
                pass

    def diagnose(self, me: int, global_batch: int) -> str:
        """One line naming peers that lag behind ``global_batch`` or reported errors."""
        if self.store is None:
            return "peer state unknown (no store)"
        parts = []
        try:
            for r in self.ranks:
                if r == me:
                    continue
                ek = self.key("err", r)
                if self.store.check([ek]):
                    parts.append(f"rank {r} reported: {self.store.get(ek).decode(errors='replace')}")
                    continue
                gk = self.key("gb", r)
                reached = int(self.store.get(gk)) if self.store.check([gk]) else None
                if reached is None or reached < global_batch:
                    seen = "never started" if reached is None else f"last reached global batch {reached}"
                    parts.append(f"rank {r} is behind ({seen}: dead, stalled or closed)")
        except Exception as e:                              # store gone (rank 0 died?)
            parts.append(f"store unreachable ({type(e).__name__}); peer state unknown")
        return "; ".join(parts) if parts else "every peer reached this global batch"
