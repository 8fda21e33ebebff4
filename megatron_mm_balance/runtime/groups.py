"""Process groups for the exchange, and the store-backed progress board used to
name the peer behind a failure.

The exchange never issues collectives on the training's groups: a second thread
doing so on a communicator the training also uses can deadlock (NCCL) or
interleave messages. It gets its own gloo group over the same ranks.

Each exchange group is a gloo full mesh: :mod:`.mesh` creates it with lazy connections
where torch offers them and checks, on every rank at once, that the file descriptors it
needs fit the limit (a one-line error naming the remedy otherwise).

``torch.distributed.new_group`` is collective over the WORLD: every world rank
must call it, in the same order, even ranks not in the new group. So

* :func:`new_exchange_groups` is what a framework calls at initialisation on
  every rank with the list of all data-parallel rank lists; it returns the group
  holding this rank;
* :func:`exchange_group_for` (used when ``BalancedDataIterator`` gets no
  ``exchange_group``) creates one on the spot, which is only safe when every
  world rank constructs its iterator at the same time.

Which ranks share a node is found, not assumed: each rank names its node
(:func:`node_identity`: torchrun's ``GROUP_RANK``, else Slurm's ``SLURM_NODEID``,
else the host name) and the names are all-gathered once, when the exchange groups
are created (:func:`gather_node_ids`, or piggybacked on a gather the framework
already does, as ``megatron.groups`` does); :func:`node_ids_from_identities` turns
them into the same node ids on every rank. ``rank // local world size`` would be
wrong for ``srun`` launches without torchrun and for cyclic rank placement.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Mapping, Optional, Sequence, Tuple

import torch.distributed as dist

from ..solver.topology import dense_node_ids
from .config import DEFAULT_TIMEOUT_S
from .mesh import check_descriptors, lazy_gloo

EXCHANGE_BACKEND = "gloo"


def _timedelta(timeout) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


#: what names a rank's node, in order of preference: (environment variable, label)
NODE_ENV_VARS = (("GROUP_RANK", "torchrun agent"), ("SLURM_NODEID", "slurm node"))


def node_identity(environ: Optional[Mapping[str, str]] = None) -> str:
    """What identifies this rank's node: ``"torchrun agent <GROUP_RANK>"`` (torchrun starts
    one agent per node and numbers them), else ``"slurm node <SLURM_NODEID>"`` (``srun``
    without torchrun), else ``"host <host name>"``."""
    env = os.environ if environ is None else environ
    for var, label in NODE_ENV_VARS:
        value = (env.get(var) or "").strip()
        if value:
            return f"{label} {value}"
    return f"host {socket.gethostname()}"


def node_ids_from_identities(identities: Sequence[str]) -> Tuple[int, ...]:
    """Node id of each rank from every rank's :func:`node_identity` (index: global rank):
    dense, numbered by first appearance in rank order (rank 0's node is 0), so every rank
    that holds the same list computes the same ids. Pure function."""
    return tuple(int(i) for i in dense_node_ids([str(name) for name in identities]))


def gather_node_ids(environ: Optional[Mapping[str, str]] = None) -> Tuple[int, ...]:
    """Every global rank's node id (:func:`node_ids_from_identities`), the same tuple on
    every rank. Collective over the world: every rank must call it at the same point."""
    if not dist.is_initialized():
        raise RuntimeError("gather_node_ids needs torch.distributed to be initialised")
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, node_identity(environ))
    return node_ids_from_identities(names)


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
    lists = [[int(r) for r in ranks] for ranks in rank_lists]
    for ranks in lists:
        dup = seen.intersection(ranks)
        if dup:
            raise ValueError(f"rank(s) {sorted(dup)} appear in more than one exchange group")
        seen.update(ranks)
    with lazy_gloo() as lazy:             # gloo pairs connect on first use, where torch can
        check_descriptors(next((len(r) for r in lists if me in r), 1), lazy=lazy)
        for ranks in lists:
            g = dist.new_group(ranks, timeout=_timedelta(timeout), backend=backend)
            if me in ranks:
                mine = g
    return mine


def exchange_group_for(ranks, timeout=DEFAULT_TIMEOUT_S, backend: str = EXCHANGE_BACKEND):
    """A new exchange group over ``ranks`` (collective over the world, see module doc)."""
    ranks = list(ranks)
    with lazy_gloo() as lazy:
        check_descriptors(len(ranks) if dist.get_rank() in ranks else 1, lazy=lazy)
        return dist.new_group(ranks, timeout=_timedelta(timeout), backend=backend)


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
