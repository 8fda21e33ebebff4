"""One global batch's statistics, as a typed record.

:class:`BatchStats` is what every balancing mode records per global batch (the
exchange and shadow mode in ``BalancedDataIterator.stats``, sampler mode in its
batch sampler's ``.stats``): the plan's figures, what travelled, and where the
time went. It is built once, when the batch's last micro-batch is delivered;
readers (Megatron telemetry, benchmarks, tests) read its fields, and
``megatron.telemetry`` turns a run of them into the log line and the
TensorBoard scalars.

Costs are in the unit of the cost function (image tokens by default,
microseconds for a calibrated cost model). "Before" is the order the packs were
drawn in (no balancing), "after" the placement the planner solved.

Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..solver.placement import PlanStats

#: how a global batch's plan is carried out (:attr:`BatchStats.mode`)
MODES = ("exchange", "shadow", "control", "sampler")


@dataclass(frozen=True)
class BatchStats:
    """One global batch as one rank delivered it."""

    #: index of the global batch, counted from 0 since the iterator was built
    global_batch: int
    #: micro-batches per rank in this global batch (G)
    num_microbatches: int
    #: the placement the planner solved: costs before (as drawn) and after (as solved),
    #: packs it moves (:class:`~megatron_mm_balance.solver.placement.PlanStats`)
    plan: PlanStats
    #: how the plan was carried out: ``"exchange"`` (packs moved between ranks),
    #: ``"shadow"`` (solved but not delivered: every rank kept its own packs in their own
    #: order, so ``plan`` says what balancing *would* do) or ``"sampler"`` (sample indices
    #: reassigned before loading: nothing travels) or ``"control"`` (every rank kept its own
    #: packs, permuted across micro-steps in balancing's order; ``plan`` is that permutation's)
    mode: str = "exchange"
    #: nodes the data-parallel group spans (None: unknown, then no node figure is reported)
    nodes: Optional[int] = None
    #: delivered packs whose node differs from the node that drew them (whole group;
    #: None: nodes unknown)
    inter_node_packs: Optional[int] = None
    #: slots (whole group) computing a pack at another micro-step than it was drawn for
    packs_reordered: int = 0
    #: this rank: packs it sent to peers / received from peers
    packs_sent: int = 0
    packs_received: int = 0
    #: this rank: bytes it sent / received (records, headers and tensor data)
    bytes_sent: int = 0
    bytes_received: int = 0
    #: this rank: bytes it sent to a rank on another node (None: nodes unknown)
    inter_node_bytes_sent: Optional[int] = None
    #: this rank's delivered micro-batches' costs, in delivery order
    my_costs: Tuple[int, ...] = ()
    #: milliseconds: the cost all-gather (including the wait for the slowest peer),
    #: the planner, and the exchange's point-to-point steps (including waits for peers)
    allgather_ms: float = 0.0
    solver_ms: float = 0.0
    exchange_ms: float = 0.0
    #: milliseconds of CPU time (``time.thread_time``) of the thread that pulled, agreed,
    #: planned and exchanged the batch: the background thread with overlap, whose share of
    #: the cores the training thread also needs
    exchange_cpu_ms: float = 0.0
    #: the batch was pulled and solved before the training loop asked for it
    prefetched: bool = False
    #: milliseconds the consumer's ``next()`` blocked on this batch, in all / at its first
    #: micro-batch
    consumer_wait_ms: float = 0.0
    consumer_wait_first_ms: float = 0.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def shadow(self) -> bool:
        """The plan was solved but not delivered (shadow mode)."""
        return self.mode == "shadow"

    @property
    def control(self) -> bool:
        """Every rank kept its own packs, reordered across micro-steps (control mode)."""
        return self.mode == "control"

    @property
    def packs_moved(self) -> int:
        """Packs delivered to a rank other than the one that drew them (whole group;
        0 in shadow mode, where nothing moves)."""
        return 0 if self.shadow else self.plan.packs_moved

    @property
    def packs_would_move(self) -> int:
        """Packs the solved plan moves, delivered or not (shadow mode's figure)."""
        return self.plan.packs_moved
