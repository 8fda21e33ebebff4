"""The agreement protocol: what every rank announces before a global batch's packs move.

At the start of each global batch every rank of the exchange group all-gathers
one fixed-size :class:`BatchRecord` (so that ranks which disagree on the batch
size still meet at the same collective): which global batch it is at, how many
micro-batches it expects, how many packs it pulled, a hash of its solver
settings, whether its source or cost function failed, and, when they fit, the
packs' integer costs. :func:`check_agreement` then turns any disagreement into
an error naming the ranks, identical on every rank, before anything is solved.

Wire layout (int64): ``HEADER`` named fields (:data:`BatchRecord.FIELDS`, then
zeros), then ``INLINE_COSTS`` cost slots. Imports no torch: the engine moves the
encoded rows.
"""
from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .errors import InconsistentConfig, PeerFailure

MAGIC = 0x6D6D62                       # "mmb"
PROTOCOL = 1
HEADER = 8                             # int64 slots before the costs (the fields, then zeros)
INLINE_COSTS = 64                      # costs that ride in the record; more need a second all-gather


class BatchStatus(enum.IntEnum):
    """How a rank's pull of the global batch went."""

    OK = 0
    SOURCE_ERROR = 1                   #: the data source (or its save_state) raised
    COST_ERROR = 2                     #: the cost function raised
    PACK_REFUSED = 3                   #: the pack check refused a pack (bad input, never balanced)


#: what each failed status says about the rank, in its peers' errors
STATUS_WHAT = {BatchStatus.SOURCE_ERROR: "data source raised", BatchStatus.COST_ERROR: "cost_fn raised",
               BatchStatus.PACK_REFUSED: "pack check refused a pack"}


def settings_string(sync: str, tolerance, cost_identity: str, ranks_per_node=None,
                    nodes=None, delivery: str = "exchange", step_groups=None,
                    step_groups_parity=None) -> str:
    """The solver settings every rank must share, as text (shown when they differ).
    ``nodes``: the node of each rank the planner places by; ``delivery``: ``exchange``,
    ``shadow`` or ``control`` (ranks that deliver differently would wait on packs that never
    come: the agreement names the difference instead); ``step_groups``: the per-micro-step
    meeting groups the planner places by (``step_groups_parity``: at the iterations of that
    parity only)."""
    return (f"protocol={PROTOCOL} sync={sync} balance_tolerance={tolerance!r} cost_fn={cost_identity}"
            + (f" ranks_per_node={ranks_per_node}" if ranks_per_node else "")
            + (f" nodes={','.join(map(str, nodes))}" if nodes is not None else "")
            + (f" delivery={delivery}" if delivery != "exchange" else "")
            + (f" step_groups={','.join(map(str, step_groups))}" if step_groups is not None else "")
            + (f" step_groups_parity={step_groups_parity}" if step_groups_parity is not None else ""))


def settings_hash(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class BatchRecord:
    """One rank's announcement for one global batch."""

    global_batch: int
    num_microbatches: int
    packs_pulled: int
    settings_hash: int
    status: BatchStatus = BatchStatus.OK
    #: the packs' costs flattened (``components`` ints per pack), when they fit inline
    costs: Tuple[int, ...] = ()
    magic: int = MAGIC

    #: the header's slots, in wire order
    FIELDS = ("magic", "global_batch", "num_microbatches", "packs_pulled", "settings_hash", "status")

    def encode(self) -> np.ndarray:
        """The record as ``HEADER + INLINE_COSTS`` int64 values."""
        if len(self.costs) > INLINE_COSTS:
            raise ValueError(f"{len(self.costs)} costs do not fit the record's {INLINE_COSTS} slots")
        row = np.zeros(HEADER + INLINE_COSTS, dtype=np.int64)
        row[:len(self.FIELDS)] = [int(getattr(self, f)) for f in self.FIELDS]
        row[HEADER:HEADER + len(self.costs)] = self.costs
        return row

    @classmethod
    def decode(cls, row: np.ndarray, num_costs: int = 0) -> "BatchRecord":
        """A record from its wire row; ``num_costs`` inline costs are read (0: none).
        An unknown status is kept as its int (the magic check names the rank first)."""
        head = {f: int(v) for f, v in zip(cls.FIELDS, row[:len(cls.FIELDS)])}
        try:
            head["status"] = BatchStatus(head["status"])
        except ValueError:
            pass
        return cls(costs=tuple(int(x) for x in row[HEADER:HEADER + num_costs]), **head)


def check_agreement(records: Sequence[BatchRecord], *, ranks: Sequence[int], me: int,
                    global_batch: int, num_microbatches: int, settings: str,
                    own_error: Optional[BaseException] = None,
                    peer_message: Callable[[int], str] = lambda rank: "",
                    where: Optional[str] = None) -> None:
    """Raise, the same way on every rank, unless every record agrees with this rank's.

    ``records[i]`` is group rank ``i``'s (global rank ``ranks[i]``); ``me`` is this rank's
    global rank. A rank whose source or cost function failed re-raises its own error
    (``own_error``); its peers raise :class:`PeerFailure` naming it (with what
    ``peer_message(rank)`` can tell, e.g. the error it posted). Different global
    batches, micro-batch counts or settings raise :class:`InconsistentConfig`. ``where``
    names the batch in the messages (default ``global batch N``).
    """
    gb, G = global_batch, num_microbatches
    where = where or f"global batch {gb}"
    bad = [ranks[i] for i, r in enumerate(records) if r.magic != MAGIC]
    if bad:
        raise InconsistentConfig(f"rank {me}: ranks {bad} sent a malformed record at {where} "
                                 f"(different runtime version?)", global_batch=gb, peers=bad)
    failed = [i for i, r in enumerate(records) if r.status != BatchStatus.OK]
    if failed:
        if own_error is not None:
            raise own_error                            # this rank's own error, unchanged
        msgs = []
        for i in failed:
            what = STATUS_WHAT.get(records[i].status, f"status {records[i].status}")
            msgs.append(f"rank {ranks[i]}'s {what}" + peer_message(ranks[i]))
        raise PeerFailure(f"rank {me}: {where} aborted before anything moved: " + "; ".join(msgs),
                          global_batch=gb, peers=[ranks[i] for i in failed])
    if any(r.global_batch != gb for r in records):
        at = {ranks[i]: r.global_batch for i, r in enumerate(records)}
        raise InconsistentConfig(f"rank {me}: ranks are at different global batches {at} "
                                 "(iterators created out of step?)", global_batch=gb)
    odd = [i for i, r in enumerate(records) if r.num_microbatches != G]
    if odd:
        counts = {ranks[i]: r.num_microbatches for i, r in enumerate(records)}
        raise InconsistentConfig(f"rank {me}: num_microbatches differs across ranks at {where}: "
                                 f"{counts}", global_batch=gb, peers=[ranks[i] for i in odd])
    mine = settings_hash(settings)
    odd = [ranks[i] for i, r in enumerate(records) if r.settings_hash != mine]
    if odd:
        raise InconsistentConfig(f"rank {me}: solver settings differ across ranks at {where}: "
                                 f"ranks {odd} disagree with this rank's [{settings}]",
                                 global_batch=gb, peers=odd)
