"""Images mode on the exchange thread: each micro-step's frames planned inside its meeting
group, and the pixel rows a rank encodes for others sent to it ahead of time.

Encoders that compute every unit (a Qwen-VL frame, a CLIP tile) on its own let a rank encode
another rank's units and return the outputs: the loss and every gradient are those of the
unbalanced run. Ranks only wait for each other within an iteration inside a per-micro-step
group (the expert-parallel group within the data-parallel group, ``runtime/meeting.py``), so
that is where a micro-step's units are balanced; without expert parallelism nobody waits for
anybody within an iteration and nothing is gained per micro-step.

Everything that decides, and every transfer that can be done early, runs here, on the exchange
thread, behind the training's compute (:class:`FrameAhead`, driven by :class:`~.engine.Engine`):

1. **At the batch's meeting** (the per-global-batch all-gather of pack costs), each rank reads
   its pulled packs' units (``reader(pack)``: :class:`Units`, the rows the tower will receive,
   their integer costs, row counts and what the encoder needs to run them elsewhere) and the
   exchange group all-gathers the table once (:meth:`FrameAhead.start`): every rank then knows
   every pack's units, and so, from the pack placement, which units each rank holds at every
   micro-step.
2. **During micro-step k-1**, when the thread exchanges micro-step k's packs, every rank plans
   micro-step k's units for its step group (:func:`plan_step`: the frame planner,
   ``runtime/frames.py::plan_frame_encoders``, then the byte cap on rows held ahead), the same
   plan on every rank that computes it. The rank that pulled a pack sends the rows of its units
   that another rank encodes to that rank, straight from the pack (it may not be the rank
   that computes the pack), one message per pair, tagged apart from the packs' messages
   (:meth:`FrameAhead.post`, :meth:`FrameAhead.complete`). The received rows ride with the
   micro-step's pack as a :class:`StepFrames`, which the data iterator hands to the model's
   training forward through a :class:`FrameRelay`.
3. **In the micro-step** only point-to-point transfers inside the step group remain, on the
   training thread's own group: the outputs back to their owners and, in backward, their
   gradients both ways (``runtime/image_exchange.py::FrameSteps``). No collective, no plan.

The rows sent ahead live until their micro-step's backward: under 1F1B pipelining up to ``pp``
micro-steps, plus the ones the thread runs ahead. ``ahead_bytes`` bounds them: each micro-step's
moves are planned so that no rank receives more than ``ahead_bytes / (pp + THREAD_AHEAD_STEPS)``
bytes of rows (without the thread, where a batch's rows all arrive at its first micro-step,
``ahead_bytes / G``). Knows nothing of Megatron; the glue supplies the reader and the encoder.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .errors import BalancerError, PeerFailure
from .frames import FrameFigures, FrameTransfer, default_patch_cap, frame_figures, plan_frame_encoders, \
    within_receive_budget
from .rates import LINK_UNIT, TOWER_UNIT, RateWindow, agreed_rate, header_value

#: the gloo tag of the rows sent ahead; a pack's messages use the default tag 0, so the two
#: streams between a pair of ranks never interleave
AHEAD_TAG = 0x6672
#: row dtypes by code, the same table on every rank
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8)
MAX_ROW_DIMS = 4
#: default cap on the bytes of other ranks' rows a rank holds ahead at once
DEFAULT_AHEAD_BYTES = 1 << 30
#: micro-steps the exchange thread delivers ahead of the consumer: one ready, one in flight
THREAD_AHEAD_STEPS = 2
#: the batch header: status, unit count, row dtype code, row dims, MAX_ROW_DIMS sizes, rates
_HEADER = 4 + MAX_ROW_DIMS + 2
#: table columns before the reader's own: pack index, unit index in the pack, cost, rows in, rows out
_FIXED = 5
_STATUS_WHAT = {1: "reading its packs' units raised", 2: "its units' rows are not one tensor of a supported dtype"}


@dataclass(frozen=True)
class Units:
    """One pack's units as this rank's encoder will receive them.

    ``cost[u]``: integer cost; ``in_rows[u]`` / ``out_rows[u]``: the unit's rows in the
    encoder's input and in its output (a Qwen-VL frame of ``h x w`` patches: ``h*w`` and
    ``h*w/merge^2``; a tile: 1 and 1); ``meta[u]``: the integers the encoder needs to run the
    unit on another rank (a frame's ``h, w``); ``rows``: the input rows, units one after the
    other in order (host memory; None only when there is no unit)."""

    cost: np.ndarray
    in_rows: np.ndarray
    out_rows: np.ndarray
    meta: np.ndarray
    rows: Optional[torch.Tensor] = None

    def __post_init__(self):
        cost = np.asarray(self.cost, dtype=np.int64).reshape(-1)
        n = cost.size
        in_rows = np.asarray(self.in_rows, dtype=np.int64).reshape(n)
        out_rows = np.asarray(self.out_rows, dtype=np.int64).reshape(n)
        meta = np.asarray(self.meta, dtype=np.int64)
        meta = meta.reshape(n, -1) if n else np.zeros((0, meta.shape[-1] if meta.ndim == 2 else 0), np.int64)
        if (cost < 0).any() or (in_rows < 1).any() or (out_rows < 1).any():
            raise ValueError("units: costs must be >= 0 and every unit must have rows in and out")
        if n and self.rows is None:
            raise ValueError(f"units: {n} units without their rows")
        if self.rows is not None and self.rows.shape[0] != int(in_rows.sum()):
            raise ValueError(f"units: {self.rows.shape[0]} rows for units of {int(in_rows.sum())} rows")
        for name, value in (("cost", cost), ("in_rows", in_rows), ("out_rows", out_rows), ("meta", meta)):
            object.__setattr__(self, name, value)

    @classmethod
    def none(cls, meta_width: int) -> "Units":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, np.zeros((0, meta_width), dtype=np.int64))

    def __len__(self) -> int:
        return int(self.cost.size)


@dataclass(frozen=True)
class MovePrices:
    """What moving a unit costs the training thread, in the unit cost's unit: its outputs
    come back and, when the encoder trains, their gradients go to it, over the step group's
    link; the rows themselves travel ahead, off the critical path. ``out_row_bytes``: one
    output row's bytes (every output side by side); ``flops_per_unit``: the forward FLOPs of
    one unit of cost; ``link_gbps``, ``tower_tflops``: the prior rates; ``measured``: charge
    the rates the group measures where it has them."""

    out_row_bytes: float
    flops_per_unit: float
    trains: bool
    link_gbps: float
    tower_tflops: float
    measured: bool = False

    def rates(self, measured: Tuple[float, float]) -> Tuple[float, float]:
        """The ``(link GB/s, tower TFLOP/s)`` moves are charged at."""
        if not self.measured:
            return self.link_gbps, self.tower_tflops
        return tuple(m if m > 0 else p for m, p in zip(measured, (self.link_gbps, self.tower_tflops)))

    def transfer(self, out_rows: np.ndarray, rates: Tuple[float, float]) -> np.ndarray:
        link, tflops = rates
        passes = 3 if self.trains else 1
        per_row = self.out_row_bytes * (2 if self.trains else 1)
        return FrameTransfer(per_row, link, self.flops_per_unit * passes / (tflops * 1e12)).cost(out_rows)


class MeasuredRates:
    """The rates this rank measured (the training thread adds samples, the exchange thread
    reads the medians at the batch's meeting, where every rank reads every rank's)."""

    def __init__(self, link_min_bytes: float = 256 * 1024):
        self.link = RateWindow(min_amount=link_min_bytes)      # bytes / s
        self.tower = RateWindow()                              # FLOP / s

    def header(self) -> List[int]:
        return [header_value(_rate(self.link), LINK_UNIT), header_value(_rate(self.tower), TOWER_UNIT)]


def _rate(window: RateWindow) -> Optional[float]:
    samples = list(window.samples)           # another thread may append while this one reads
    return float(np.median(samples)) if samples else None


@dataclass(frozen=True)
class BatchUnits:
    """Every unit of one global batch, the same on every rank of the exchange group: rank
    ``source[i]`` pulled the pack ``pack[i]`` holding unit ``index[i]`` of it."""

    source: np.ndarray
    pack: np.ndarray
    index: np.ndarray
    cost: np.ndarray
    in_rows: np.ndarray
    out_rows: np.ndarray
    meta: np.ndarray
    row_shape: Tuple[int, ...]
    row_dtype: Optional[torch.dtype]
    #: the group's measured ``(link GB/s, tower TFLOP/s)`` (0: none yet)
    measured: Tuple[float, float] = (0.0, 0.0)
    _of_pack: Dict[Tuple[int, int], np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        order = np.lexsort((self.index, self.pack, self.source))
        keys = np.stack([self.source[order], self.pack[order]], axis=1) if order.size else np.zeros((0, 2))
        start = 0
        for i in range(1, order.size + 1):
            if i == order.size or (keys[i] != keys[start]).any():
                self._of_pack[(int(keys[start, 0]), int(keys[start, 1]))] = order[start:i]
                start = i

    def of_pack(self, source: int, pack: int) -> np.ndarray:
        """The table indices of one pulled pack's units, in the pack's order."""
        return self._of_pack.get((int(source), int(pack)), np.zeros(0, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        if self.row_dtype is None:
            return 0
        return int(np.prod(self.row_shape, dtype=np.int64)) * torch.empty((), dtype=self.row_dtype).element_size()


@dataclass(frozen=True)
class StepPlan:
    """One step group's units at one micro-step and where each is encoded, the same on every
    rank that plans it. ``members``: the group's exchange indices, in group order;
    ``owner[i]`` / ``encoder[i]``: positions in ``members``; ``unit[i]``: the table index.
    Units are in group order: the first member's units in its order, then the second's..."""

    members: Tuple[int, ...]
    owner: np.ndarray
    encoder: np.ndarray
    unit: np.ndarray
    figures: Optional[FrameFigures]
    #: each unit's transfer charge (None: moves are free)
    transfer: Optional[np.ndarray] = None

    @property
    def moved(self) -> np.ndarray:
        return self.owner != self.encoder

    def describe(self, table: "BatchUnits") -> dict:
        """The plan as lists: owner, encoder, cost, patches (rows in), transfer."""
        return dict(owner=self.owner.tolist(), encoder=self.encoder.tolist(), cost=table.cost[self.unit].tolist(),
                    patches=table.in_rows[self.unit].tolist(),
                    transfer=(np.zeros(self.unit.size, np.int64) if self.transfer is None else self.transfer).tolist())


def plan_step(table: BatchUnits, src_rank: np.ndarray, src_index: np.ndarray, members: Sequence[int], *,
              patch_cap: Optional[int] = None, prices: Optional[MovePrices] = None,
              budget_rows: Optional[int] = None) -> StepPlan:
    """Micro-step ``k``'s plan for one step group: ``src_rank[d]``, ``src_index[d]``: where the
    pack data-parallel rank ``d`` computes at ``k`` was pulled (the placement's column ``k``).
    Pure: the frame planner on the group's units (cost, rows in as patches, the transfer of
    their outputs when ``prices`` is given), then no rank above ``budget_rows`` rows received."""
    owner, unit = [], []
    for pos, d in enumerate(members):
        idx = table.of_pack(int(src_rank[d]), int(src_index[d]))
        owner.append(np.full(idx.size, pos, dtype=np.int64))
        unit.append(idx)
    owner = np.concatenate(owner) if owner else np.zeros(0, np.int64)
    unit = np.concatenate(unit).astype(np.int64) if unit else np.zeros(0, np.int64)
    if unit.size == 0:
        return StepPlan(tuple(members), owner, owner.copy(), unit, None)
    cost, rows = table.cost[unit], table.in_rows[unit]
    D = len(members)
    rates = prices.rates(table.measured) if prices is not None else None
    transfer = prices.transfer(table.out_rows[unit], rates) if prices is not None else None
    cap = default_patch_cap(owner, rows, D) if patch_cap is None else int(patch_cap)
    encoder = plan_frame_encoders(owner, cost, D, patches=rows, patch_cap=cap, transfer=transfer)
    if budget_rows is not None:
        encoder = within_receive_budget(owner, encoder, cost, rows, budget_rows)
    figures = frame_figures(owner, encoder, cost, rows, D, transfer, rates, table.measured)
    return StepPlan(tuple(members), owner, encoder, unit, figures, transfer)


@dataclass
class StepFrames:
    """What the training thread needs for one micro-step's units on this rank, prepared by the
    exchange thread (see the module docstring). ``balanced`` False: this rank neither sends nor
    receives outputs at this micro-step, and runs its tower as it is.

    As an owner: its ``local_rows`` input rows hold its units in order; the kept ones are the
    rows ``kept_rows`` (None: all of them), encoded with ``kept_args``; the others' outputs
    arrive from their encoders, ``recv_out[peer] = (start, rows)`` of the arrived tensor
    (``arrived_rows`` rows). ``order``: the rows of ``cat(kept outputs, arrived)`` in its unit
    order (None: already in order). As an encoder: ``received`` rows (sent ahead), encoded with
    ``received_args``, whose outputs go back as ``send_out[peer] = (start, rows)``. Peers are
    global ranks. ``event`` / ``buffers``: the side stream's copy to the device (CUDA)."""

    where: str
    #: this rank's step group's plan: every unit's owner and encoder (positions in ``group``),
    #: cost, rows in and transfer charge, in group order (None: no unit in the group)
    plan: Optional[dict] = None
    balanced: bool = False
    #: the global batch's units are balanced (False: crossover's other parity, nothing planned)
    planned: bool = False
    figures: Optional[FrameFigures] = None
    group: Tuple[int, ...] = ()
    #: the encoder's input rows' trailing shape and dtype (the batch's; () / None: no unit in it)
    row_shape: Tuple[int, ...] = ()
    row_dtype: Optional[torch.dtype] = None
    local_rows: int = 0
    kept_units: int = 0
    kept_out_rows: int = 0
    #: the integer cost of the units this rank keeps and of those it encodes for others
    kept_cost: int = 0
    received_cost: int = 0
    #: the integer cost of all of this rank's units (what its tower computes unbalanced)
    local_cost: int = 0
    kept_rows: Optional[torch.Tensor] = None
    kept_args: tuple = ()
    sends_away: bool = False
    received: Optional[torch.Tensor] = None
    received_args: tuple = ()
    send_out: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    recv_out: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    arrived_rows: int = 0
    order: Optional[torch.Tensor] = None
    event: object = None
    buffers: tuple = ()

    def ready(self, mover) -> None:
        """Consumer side: the compute stream waits for the side stream's copies (CUDA)."""
        if self.event is not None and mover is not None:
            mover.ready(self.event, self.buffers)
            self.event = None


class FrameRelay:
    """The micro-steps' :class:`StepFrames`, from the data iterator's ``next()`` to the model's
    training forward (both on the training thread, one forward per ``next()``, in order)."""

    def __init__(self, limit: int = 64):
        self._queue: deque = deque()
        self.limit = int(limit)
        self.mover = None                 # the exchange thread's CUDA side stream, when it has one

    def put(self, frames: StepFrames) -> None:
        if len(self._queue) >= self.limit:
            raise BalancerError(f"images mode: {len(self._queue)} micro-steps' frames were delivered and none "
                                "taken by a training forward of the model (is the vision tower's model chunk "
                                "the one this iterator feeds?)")
        self._queue.append(frames)

    def take(self) -> StepFrames:
        if not self._queue:
            raise BalancerError("images mode: a training forward of the model found no frame plan: its "
                                "micro-batch did not come from the balanced data iterator (a replayed or "
                                "extra forward?)")
        frames = self._queue.popleft()
        frames.ready(self.mover)
        return frames

    def __len__(self) -> int:
        return len(self._queue)


@dataclass
class _BatchState:
    """One global batch's units on this rank: the table, this rank's pulled packs' units
    (their rows kept until sent) and the plan's settings."""

    table: Optional[BatchUnits]
    local: List[Units]
    budget_rows: Optional[int]


@dataclass
class _Posted:
    """One micro-step's transfers of rows in flight on the exchange thread."""

    frames: StepFrames
    plan: Optional[StepPlan] = None
    table: Optional[BatchUnits] = None
    sends: list = field(default_factory=list)            # (peer, work, tensor)
    recvs: list = field(default_factory=list)            # (peer, work, buffer, units)
    local: list = field(default_factory=list)            # (units, rows) this rank keeps for itself
    step: int = 0
    gb: int = 0


class FrameAhead:
    """This rank's exchange-thread side of images mode (see the module docstring).

    ``reader(pack) -> Units`` reads a pack's units (``reader.meta_width``: the integers per
    unit; ``reader.encode_args(meta)``: the host tensors the encoder takes beside the rows of
    units ``meta``, e.g. a grid); ``step_groups``: the per-micro-step groups, tuples of global
    ranks covering the exchange group (``MeetingGroups.steps``); ``device``: where the encoder
    runs (CUDA: rows and index tensors go there on the side stream); ``patch_cap``: no rank
    that receives units ends above it (rows; None: the most any rank held);
    ``ahead_bytes``: the cap on other ranks' rows held ahead; ``pipeline_stages``: ``pp``, how
    many micro-steps' rows a rank may hold between forward and backward; ``prices``: moves'
    transfer charges (None: free); ``rates``: this rank's :class:`MeasuredRates`."""

    def __init__(self, reader, step_groups, *, device=None, patch_cap: Optional[int] = None,
                 ahead_bytes: int = DEFAULT_AHEAD_BYTES, pipeline_stages: int = 1,
                 prices: Optional[MovePrices] = None, rates: Optional[MeasuredRates] = None):
        self.reader = reader
        self.meta_width = int(reader.meta_width)
        self.step_groups = tuple(tuple(int(r) for r in g) for g in step_groups)
        if not self.step_groups or any(not g for g in self.step_groups):
            raise ValueError("images mode: the per-micro-step groups are empty")
        self.device = torch.device(device) if device is not None else None
        if patch_cap is not None and (isinstance(patch_cap, bool) or int(patch_cap) < 1):
            raise ValueError(f"images mode: the patch cap must be a positive integer, got {patch_cap!r}")
        self.patch_cap = patch_cap
        if isinstance(ahead_bytes, bool) or int(ahead_bytes) < 0:
            raise ValueError(f"images mode: the byte cap on rows sent ahead must be >= 0, got {ahead_bytes!r}")
        self.ahead_bytes = int(ahead_bytes)
        self.pipeline_stages = max(1, int(pipeline_stages))
        self.prices = prices
        self.rates = rates if rates is not None else MeasuredRates()
        self.relay = FrameRelay()
        self.mover = None
        self.transport = None
        #: what this rank sent ahead: units, rows, bytes, and units of packs another rank computes
        self.sent = dict(units=0, rows=0, bytes=0, units_of_others_packs=0)

    # -- binding to the engine ----------------------------------------------------------------
    def bind(self, transport, ranks: Sequence[int], me: int, name_batch: Callable[[int], str], board=None,
             peer_message: Optional[Callable[[int], str]] = None) -> None:
        """Called by the engine: the exchange group's transport, its global ranks (group order),
        this rank's index in them, and where a failing rank posts its error (the progress
        board) and its peers read it (``peer_message(global rank)``)."""
        self.transport, self.ranks, self.me, self.name_batch = transport, list(ranks), int(me), name_batch
        self.board, self.peer_message = board, peer_message
        covered = sorted(r for g in self.step_groups for r in g)
        if covered != sorted(self.ranks):
            raise ValueError(f"images mode: the per-micro-step groups {[list(g) for g in self.step_groups]} do not "
                             f"cover the exchange group {self.ranks} once each")
        index = {r: i for i, r in enumerate(self.ranks)}
        self.members = [tuple(index[r] for r in g) for g in self.step_groups]
        self.my_group = next(i for i, g in enumerate(self.members) if self.me in g)
        if self.device is not None and self.device.type == "cuda":
            from .device import CudaMover
            self.mover = CudaMover(self.device)
            self.relay.mover = self.mover

    def where(self, gb: int, k: Optional[int] = None) -> str:
        return self.name_batch(gb) + ("" if k is None else f", micro-step {k}")

    # -- at the batch's meeting ----------------------------------------------------------------
    def start(self, plan, balanced: bool, budget_steps: int) -> None:
        """Global batch ``plan``'s units: read from this rank's pulled packs and all-gathered
        once over the exchange group (every rank calls it for every batch; ``balanced`` False,
        the same on every rank: nothing is read or gathered and every micro-step runs its tower
        as it is). ``budget_steps``: how many micro-steps' rows a rank may hold at once."""
        if not balanced:
            plan.frames = _BatchState(None, [], None)
            return
        gb = plan.global_batch
        local, status, error = [], 0, None
        try:
            local = [self.reader(pack) for pack in plan.packs]
            status = 0 if _rows_kind(local) is not None else 2
        except Exception as e:                      # every rank stops, this one with its own error
            status, error = 1, e
            if self.board:
                self.board.post_error(self.ranks[self.me], f"{type(e).__name__}: {e}")
        table = self._gather(local, status, error, gb)
        budget = None
        if table.row_bytes:
            budget = self.ahead_bytes // max(1, budget_steps) // table.row_bytes
        plan.frames = _BatchState(table, local, budget)

    def _gather(self, local: List[Units], status: int, error, gb: int) -> BatchUnits:
        kind = _rows_kind(local) if status == 0 else None
        n = sum(len(u) for u in local) if status == 0 else 0
        header = np.zeros(_HEADER, dtype=np.int64)
        header[0], header[1] = status, n
        header[2:4] = (-1, 0) if kind is None else (kind[0], len(kind[1]))
        if kind is not None:
            header[4: 4 + len(kind[1])] = kind[1]
        header[-2:] = self.rates.header()
        heads = self.transport.all_gather(torch.from_numpy(header), "all-gather of the frame table's sizes",
                                          gb).numpy()
        self._check_status(heads[:, 0], error, gb)
        kinds = {(int(h[2]), tuple(int(x) for x in h[4: 4 + int(h[3])])) for h in heads if h[1] > 0}
        if len(kinds) > 1:
            raise BalancerError(f"images mode: the ranks' unit rows differ in dtype or shape at {self.where(gb)} "
                                f"({sorted(kinds)}); every rank's encoder input must be alike", global_batch=gb)
        width = _FIXED + self.meta_width
        counts = heads[:, 1].astype(np.int64)
        cols = np.zeros((0, width), dtype=np.int64)
        if counts.max(initial=0) > 0:
            mine = np.zeros((int(counts.max()), width), dtype=np.int64)
            row = 0
            for p, units in enumerate(local):
                m = len(units)
                mine[row: row + m, 0], mine[row: row + m, 1] = p, np.arange(m)
                mine[row: row + m, 2], mine[row: row + m, 3], mine[row: row + m, 4] = \
                    units.cost, units.in_rows, units.out_rows
                mine[row: row + m, _FIXED:] = units.meta
                row += m
            every = self.transport.all_gather(torch.from_numpy(mine.reshape(-1)), "all-gather of the frame table",
                                              gb).numpy().reshape(len(self.ranks), -1, width)
            cols = np.concatenate([every[r, : counts[r]] for r in range(len(self.ranks))])
        source = np.repeat(np.arange(len(self.ranks), dtype=np.int64), counts)
        code, shape = (kinds.pop() if kinds else (-1, ()))
        measured = (agreed_rate(heads[:, -2], LINK_UNIT, 0.0) / 1e9, agreed_rate(heads[:, -1], TOWER_UNIT, 0.0) / 1e12)
        return BatchUnits(source, cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], cols[:, 4], cols[:, _FIXED:],
                          shape, ROW_DTYPES[code] if code >= 0 else None, measured)

    def _check_status(self, statuses: np.ndarray, error, gb: int) -> None:
        if error is not None:
            raise error
        bad = [(self.ranks[r], int(s)) for r, s in enumerate(statuses.tolist()) if s]
        if bad:
            said = (lambda r: self.peer_message(r)) if self.peer_message else (lambda r: "")  # noqa: E731
            what = "; ".join(f"rank {r}: {_STATUS_WHAT.get(s, f'status {s}')}{said(r) if s == 1 else ''}"
                             for r, s in bad)
            raise PeerFailure(f"images mode: {what} at {self.where(gb)}", global_batch=gb,
                              peers=tuple(r for r, _ in bad))

    # -- one micro-step ---------------------------------------------------------------------------
    def post(self, plan, k: int) -> _Posted:
        """Plan micro-step ``k``'s units and post the transfers of their rows (sends of the rows
        this rank pulled and another rank encodes, receives of the rows it encodes for others).
        Before the packs of step ``k`` leave this rank."""
        gb = plan.global_batch
        state: _BatchState = plan.frames
        frames = StepFrames(self.where(gb, k))
        if state is None or state.table is None:
            return _Posted(frames, step=k, gb=gb)
        P, table = plan.placement, state.table
        src_rank, src_index = P.src_rank[:, k], P.src_index[:, k]
        plans = {}
        for g, members in enumerate(self.members):
            if g == self.my_group or self.me in {int(src_rank[d]) for d in members}:
                plans[g] = plan_step(table, src_rank, src_index, members, patch_cap=self.patch_cap,
                                     prices=self.prices, budget_rows=state.budget_rows)
        posted = _Posted(frames, plans[self.my_group], table, step=k, gb=gb)
        frames.planned = True
        frames.group = tuple(self.ranks[d] for d in self.members[self.my_group])
        frames.row_shape, frames.row_dtype = table.row_shape, table.row_dtype
        outgoing: Dict[int, list] = {}
        for g in sorted(plans):
            p = plans[g]
            for i in np.flatnonzero(p.moved & (table.source[p.unit] == self.me)).tolist():
                to = p.members[int(p.encoder[i])]
                rows = self._rows_of(state, table, int(p.unit[i]))
                if to == self.me:
                    posted.local.append((i, rows))
                    continue
                outgoing.setdefault(to, []).append(rows)
                self.sent["units"] += 1
                self.sent["rows"] += int(rows.shape[0])
                self.sent["bytes"] += int(rows.numel() * rows.element_size())
                self.sent["units_of_others_packs"] += int(p.members[int(p.owner[i])] != self.me)
        for to in sorted(outgoing):
            t = torch.cat(outgoing[to]) if len(outgoing[to]) > 1 else outgoing[to][0].contiguous()
            work = self.transport.post(lambda t=t, to=to: dist.isend(t, dst=self.ranks[to], group=self.transport.group,
                                                                     tag=AHEAD_TAG),
                                       "sending frames ahead", gb, (self.ranks[to],), k)
            posted.sends.append((to, work, t))
        for d in np.flatnonzero(src_rank == self.me).tolist():      # this rank's packs of step k: done
            state.local[int(src_index[d])] = None
        mine = posted.plan
        me = mine.members.index(self.me)
        into = np.flatnonzero(mine.moved & (mine.encoder == me))
        by_source: Dict[int, list] = {}
        for i in into.tolist():
            s = int(table.source[mine.unit[i]])
            if s != self.me:
                by_source.setdefault(s, []).append(i)
        for s in sorted(by_source):
            units = by_source[s]
            n = int(table.in_rows[mine.unit[units]].sum())
            buf = self._host_rows(n, table)
            work = self.transport.post(lambda buf=buf, s=s: dist.irecv(buf, src=self.ranks[s], group=self.transport.group,
                                                                       tag=AHEAD_TAG),
                                       "receiving frames ahead", gb, (self.ranks[s],), k)
            posted.recvs.append((s, work, buf, units))
        return posted

    def _rows_of(self, state: _BatchState, table: BatchUnits, u: int) -> torch.Tensor:
        units = state.local[int(table.pack[u])]
        start = int(units.in_rows[: int(table.index[u])].sum())
        return units.rows[start: start + int(units.in_rows[int(table.index[u])])]

    def complete(self, posted: _Posted) -> StepFrames:
        """Wait for micro-step ``k``'s rows (bounded, naming the peer) and build its
        :class:`StepFrames`, on the encoder's device."""
        gb, k = posted.gb, posted.step
        for to, work, _ in posted.sends:
            self.transport.wait(work, "sending frames ahead", gb, (self.ranks[to],), k)
        for s, work, _, _ in posted.recvs:
            self.transport.wait(work, "receiving frames ahead", gb, (self.ranks[s],), k)
        frames = posted.frames
        if posted.plan is None:
            return frames
        frames.figures = posted.plan.figures
        frames.plan = posted.plan.describe(posted.table) if posted.plan.unit.size else None
        self._fill(frames, posted)
        return frames

    def _fill(self, frames: StepFrames, posted: _Posted) -> None:
        plan, table = posted.plan, posted.table
        me = plan.members.index(self.me)
        peer = lambda pos: self.ranks[plan.members[int(pos)]]           # noqa: E731
        local = np.flatnonzero(plan.owner == me)
        away = local[plan.encoder[local] != me]
        into = np.flatnonzero(plan.moved & (plan.encoder == me))
        in_rows, out_rows, meta = table.in_rows[plan.unit], table.out_rows[plan.unit], table.meta[plan.unit]
        frames.local_rows = int(in_rows[local].sum())
        frames.local_cost = int(table.cost[plan.unit[local]].sum())
        if away.size == 0 and into.size == 0:
            return                                                  # nothing crosses this rank
        frames.balanced = True
        frames.sends_away = bool(away.size)
        kept = local[plan.encoder[local] == me]
        frames.kept_units, frames.kept_out_rows = int(kept.size), int(out_rows[kept].sum())
        cost = table.cost[plan.unit]
        frames.kept_cost, frames.received_cost = int(cost[kept].sum()), int(cost[into].sum())
        host = {}
        if kept.size:
            frames.kept_args = tuple(self.reader.encode_args(meta[kept]))
            if away.size:
                starts = np.cumsum(in_rows[local]) - in_rows[local]
                keep = plan.encoder[local] == me
                host["kept_rows"] = torch.from_numpy(_row_ranges(starts[keep], in_rows[local][keep]))
        if into.size:
            frames.received = self._received(posted, into, table)
            frames.received_args = tuple(self.reader.encode_args(meta[into]))
            start = 0
            for o in sorted(set(plan.owner[into].tolist())):
                n = int(out_rows[into[plan.owner[into] == o]].sum())
                frames.send_out[peer(o)] = (start, n)
                start += n
        start, arrived = 0, []
        for e in sorted(set(plan.encoder[away].tolist())):
            units = away[plan.encoder[away] == e]
            n = int(out_rows[units].sum())
            frames.recv_out[peer(e)] = (start, n)
            start += n
            arrived.append(units)
        frames.arrived_rows = start
        done = np.concatenate([kept] + arrived) if kept.size or arrived else np.zeros(0, np.int64)
        if done.size and (done != local).any():
            lengths = out_rows[done]
            starts = np.cumsum(lengths) - lengths
            where = {int(u): (int(s), int(n)) for u, s, n in zip(done, starts, lengths)}
            host["order"] = torch.from_numpy(_row_ranges(np.array([where[int(u)][0] for u in local]),
                                                          out_rows[local]))
        self._place(frames, host)

    def _received(self, posted: _Posted, into: np.ndarray, table: BatchUnits) -> torch.Tensor:
        """The rows this rank encodes for others, in group order, from the messages and from
        the rows it pulled itself."""
        pieces: Dict[int, torch.Tensor] = {int(i): rows for i, rows in posted.local}
        for _, _, buf, units in posted.recvs:
            offsets = np.cumsum([0] + [int(table.in_rows[posted.plan.unit[i]]) for i in units])
            for j, i in enumerate(units):
                pieces[int(i)] = buf[offsets[j]: offsets[j + 1]]
        if len(posted.recvs) == 1 and not posted.local:
            return posted.recvs[0][2]                               # one message, already in order
        order = [pieces[int(i)] for i in into.tolist()]
        return torch.cat(order, out=self._host_rows(sum(int(p.shape[0]) for p in order), table))

    def _host_rows(self, n: int, table: BatchUnits) -> torch.Tensor:
        """Host memory for ``n`` rows of the batch's kind: on a CUDA encoder from the transport's
        capped pinned pool (pageable when it is full), else plain."""
        pool = getattr(self.transport, "pool", None) if self.mover is not None else None
        if pool is None:
            return torch.empty((n, *table.row_shape), dtype=table.row_dtype)
        return pool.take(n * table.row_bytes).view(table.row_dtype).view(n, *table.row_shape)

    def _place(self, frames: StepFrames, host: dict) -> None:
        """On a CUDA encoder, every tensor the training thread reads goes to the device on the
        side stream (pinned host memory, one event); on the host they stay as they are."""
        names = ["received"] if frames.received is not None else []
        tensors = {"received": frames.received, **host}
        args = {"kept_args": frames.kept_args, "received_args": frames.received_args}
        if self.mover is None:
            for name, t in host.items():
                setattr(frames, name, t)
            return
        names += list(host)
        pool = getattr(self.transport, "pool", None)
        with torch.cuda.stream(self.mover.stream):
            for name in names:
                t = tensors[name]
                setattr(frames, name, (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True))
                if pool is not None:                # the pool's buffer is free once the copy is done
                    tensors[name] = t
            for name, values in args.items():
                setattr(frames, name, tuple((v if v.is_pinned() else v.pin_memory()).to(self.device, non_blocking=True)
                                            for v in values))
            event = torch.cuda.Event()
            event.record(self.mover.stream)
        if pool is not None and frames.received is not None:
            pool.release_after(tensors["received"], event)
        frames.event = event
        frames.buffers = tuple(getattr(frames, n) for n in names) + frames.kept_args + frames.received_args


def _rows_kind(local: List[Units]):
    """``(dtype code, row shape)`` of the packs' unit rows (all alike), ``(-1, ())`` with none,
    None when they differ or are of an unsupported dtype or rank."""
    kinds = {(r.rows.dtype, tuple(r.rows.shape[1:])) for r in local if len(r)}
    if not kinds:
        return (-1, ())
    if len(kinds) > 1:
        return None
    dtype, shape = kinds.pop()
    if dtype not in ROW_DTYPES or len(shape) > MAX_ROW_DIMS:
        return None
    return ROW_DTYPES.index(dtype), shape


def _row_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ``arange(s, s + n)`` of every (start, length) pair."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(total, dtype=np.int64)
