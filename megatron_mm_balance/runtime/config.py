"""The balanced iterator's settings, as one frozen object.

:class:`BalancerConfig` replaces the iterator's loose keyword arguments; the
keywords still work (``BalancedDataIterator(src, num_microbatches=8, sync="step")``
builds the config). No torch import: a framework's glue can build and check one
before any process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from ..solver.placement import SYNC_MODES

#: seconds any wait on a peer may take before a clear error (the one default)
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class BalancerConfig:
    """How one :class:`~.iterator.BalancedDataIterator` balances."""

    #: ``"microstep"``: ranks meet every micro-step (MoE expert parallel), balance each
    #: micro-step; ``"step"``: ranks meet at the step's end, balance rank totals.
    sync: Literal["microstep", "step"] = "microstep"
    #: exchange on a background thread ahead of the consumer.
    overlap: bool = True
    #: seconds any wait on a peer may take before a clear error.
    timeout: float = DEFAULT_TIMEOUT_S
    #: None (tensors keep their device type), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    device: Any = None
    #: False: pure pass-through of the source, no collectives, no thread.
    enabled: bool = True
    #: the solver's knob (None: the solver's default).
    balance_tolerance: Optional[float] = None
    #: True: gather costs and solve as usual, record the plan's statistics (the
    #: predicted gain), but deliver every rank its own packs in their own order.
    shadow: bool = False
    #: how many global batches ``.stats`` keeps.
    stats_history: int = 1024
    #: GPUs per node (global rank ``r`` on node ``r // ranks_per_node``, as torchrun
    #: numbers them): moves prefer node-mates; None: every rank its own node.
    ranks_per_node: Optional[int] = None

    def __post_init__(self):
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync must be 'microstep' or 'step', got {self.sync!r}")
        try:
            timeout_ok = float(self.timeout) > 0
        except (TypeError, ValueError):
            timeout_ok = False
        if not timeout_ok:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")
        if self.balance_tolerance is not None and not self.balance_tolerance >= 0:
            raise ValueError(f"balance_tolerance must be >= 0, got {self.balance_tolerance!r}")
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool) or
                                                not isinstance(self.ranks_per_node, int) or
                                                self.ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be an integer >= 1, got {self.ranks_per_node!r}")
        if int(self.stats_history) < 1:
            raise ValueError(f"stats_history must be >= 1, got {self.stats_history!r}")
