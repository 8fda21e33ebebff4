"""The balanced iterator's settings, as one frozen object validated once.

:class:`BalancerConfig` replaces the iterator's loose keyword arguments; the
keywords still work (``BalancedDataIterator(src, num_microbatches=8, sync="step")``
builds the config). Each field's default is written here once (the tolerance's
is the solver's :data:`~megatron_mm_balance.solver.placement.DEFAULT_BALANCE_TOLERANCE`),
each value is checked here once, and ``None`` for the tolerance means that
default, resolved here. A framework's glue builds one (``megatron.config``) and
passes it down; an invalid value raises :class:`SettingError`, which names the
field, so the glue can name its own flag instead.

No torch import: a framework's glue can build and check one before any process
group exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Tuple

from ..solver.placement import DEFAULT_BALANCE_TOLERANCE, SYNC_MODES
from ..solver.step_groups import check_step_groups

#: seconds any wait on a peer may take before a clear error (the one default)
DEFAULT_TIMEOUT_S = 300.0
#: the pinned host memory one iterator may keep for packs on a GPU job (the default cap)
DEFAULT_PINNED_BYTES = 1 << 30
#: the parities :attr:`BalancerConfig.crossover` balances
CROSSOVER_PARITIES = ("even", "odd")
#: the tolerance's valid range, [0, TOLERANCE_BELOW): a fraction of the mean rank total
TOLERANCE_BELOW = 1.0


class SettingError(ValueError):
    """An invalid :class:`BalancerConfig` value; ``field`` names the setting."""

    def __init__(self, field: str, requirement: str, value):
        super().__init__(f"{field} {requirement}, got {value!r}")
        self.field = field
        self.requirement = requirement
        self.value = value

    def __reduce__(self):
        return type(self), (self.field, self.requirement, self.value)


@dataclass(frozen=True)
class BalancerConfig:
    """How one :class:`~.iterator.BalancedDataIterator` balances."""

    #: ``"microstep"``: ranks meet every micro-step (MoE expert parallel), balance each
    #: micro-step; ``"step"``: ranks meet at the step's end, balance rank totals.
    sync: Literal["microstep", "step"] = "microstep"
    #: exchange on a background thread ahead of the consumer. False: a global batch's whole
    #: exchange runs inside its first ``next()`` (the ranks meet once per global batch).
    overlap: bool = True
    #: seconds any wait on a peer may take before a clear error.
    timeout: float = DEFAULT_TIMEOUT_S
    #: None (tensors keep their device type), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``, or
    #: ``"auto"``: the current CUDA device where CUDA is available, else None.
    device: Any = None
    #: cap on the pinned host memory one iterator keeps for packs on a GPU job (received
    #: packs, local ones staged for the device); reused, never grown past it. 0: none pinned.
    pinned_bytes: int = DEFAULT_PINNED_BYTES
    #: False: pure pass-through of the source, no collectives, no thread.
    enabled: bool = True
    #: the solver's knob: how far (a fraction of the mean rank total) a rank's total may
    #: end above the mean; larger keeps more packs home. None: the default.
    balance_tolerance: Optional[float] = DEFAULT_BALANCE_TOLERANCE
    #: True: gather costs and solve as usual, record the plan's statistics (what
    #: balancing would do), but deliver every rank its own packs in their own order.
    shadow: bool = False
    #: True: gather costs and solve as usual, then deliver every rank exactly its own
    #: packs, permuted across micro-steps in the order balancing gives them
    #: (:func:`~megatron_mm_balance.solver.placement.control_placement`): nothing crosses
    #: ranks. A run in this mode shows the job's arithmetic-order band
    #: (docs/notes/2026-12-02-control-band.md).
    control: bool = False
    #: ``"even"`` or ``"odd"``: balance only the global batches of training iterations of
    #: that parity, and deliver the others as shadow mode does (solved, nothing moved). Two
    #: jobs, one of each parity, run every iteration once balanced and once not, on the same
    #: data, each job's own speed in both: balancing's gain measured free of the drift
    #: between jobs (``bench-realpath --modes crossover-even,crossover-odd``). None: every
    #: batch balanced.
    crossover: Optional[str] = None
    #: how many global batches ``.stats`` keeps.
    stats_history: int = 1024
    #: the planner's override of the found nodes (the iterator's ``node_ids``): global rank
    #: ``r`` on node ``r // ranks_per_node``; moves prefer node-mates. None: the found
    #: nodes, or flat (every rank its own node) when none were found.
    ranks_per_node: Optional[int] = None
    #: the job's per-micro-step meeting groups in this iterator's data-parallel group: one
    #: label per rank, in the group's rank order (``runtime.meeting.MeetingGroups.labels()``);
    #: the statistics count the packs that change group against them. None: not read.
    job_step_groups: Optional[Tuple[int, ...]] = None
    #: the groups the planner places by (``microstep`` sync: each micro-step balanced inside
    #: each group, rank totals across groups; :func:`~.planner.plan_batch`). None: every rank
    #: meets every micro-step (one group of all)
    step_groups: Optional[Tuple[int, ...]] = None
    #: ``"even"`` or ``"odd"``: place by ``step_groups`` only at training iterations of that
    #: parity, as if every rank met every micro-step at the others (both delivered). Two jobs,
    #: one of each parity, time both placements on the same data inside the same processes
    #: (``--mm-balance-mode groups-crossover-even`` / ``-odd``). None: every batch by ``step_groups``.
    step_groups_parity: Optional[str] = None

    def __post_init__(self):
        if self.sync not in SYNC_MODES:
            raise SettingError("sync", "must be 'microstep' or 'step'", self.sync)
        try:
            timeout_ok = float(self.timeout) > 0
        except (TypeError, ValueError):
            timeout_ok = False
        if not timeout_ok:
            raise SettingError("timeout", "must be > 0 seconds", self.timeout)
        if self.balance_tolerance is None:
            object.__setattr__(self, "balance_tolerance", DEFAULT_BALANCE_TOLERANCE)
        tol = self.balance_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < TOLERANCE_BELOW:
            raise SettingError("balance_tolerance", f"must be in [0, {TOLERANCE_BELOW:g})", tol)
        object.__setattr__(self, "balance_tolerance", float(tol))
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise SettingError("ranks_per_node", "must be an integer >= 1", rpn)
        if self.shadow and self.control:
            raise SettingError("control", "cannot be combined with shadow", self.control)
        if self.crossover is not None:
            if self.crossover not in CROSSOVER_PARITIES:
                raise SettingError("crossover", "must be 'even', 'odd' or None", self.crossover)
            if self.shadow or self.control:
                raise SettingError("crossover", "cannot be combined with shadow or control", self.crossover)
        pinned = self.pinned_bytes
        if isinstance(pinned, bool) or not isinstance(pinned, int) or pinned < 0:
            raise SettingError("pinned_bytes", "must be an integer >= 0", pinned)
        hist = self.stats_history
        if isinstance(hist, bool) or not isinstance(hist, int) or hist < 1:
            raise SettingError("stats_history", "must be an integer >= 1", hist)
        if self.step_groups_parity is not None and self.step_groups_parity not in CROSSOVER_PARITIES:
            raise SettingError("step_groups_parity", "must be 'even', 'odd' or None", self.step_groups_parity)
        for name in ("job_step_groups", "step_groups"):
            labels = getattr(self, name)
            if labels is None:
                continue
            try:
                checked = check_step_groups(labels)
            except ValueError:
                raise SettingError(name, "must be None or one integer label >= 0 per data-parallel rank",
                                   labels) from None
            object.__setattr__(self, name, checked)
