"""One rank's side of one global batch: pull, agree, plan, exchange.

:class:`Engine` is the tensor exchange's coordinator. It decides nothing itself
and moves nothing itself: the agreement protocol is :mod:`.agreement`, the plan
:func:`~.planner.plan_batch` (the same planner every mode uses), and the network
and device work :class:`~.transport.PackTransport`. Its operations run on the
background thread (``overlap=True``: a batch's start, then its steps one by one)
or inside ``next()`` (``overlap=False``: a batch's start, then its whole exchange):

* :meth:`Engine.start_batch` pulls ``num_microbatches`` packs from the source,
  checks each (``check_fn``: bad input is refused here, before anything moves) and costs it,
  all-gathers a fixed-size :class:`~.agreement.BatchRecord` (with the integer
  costs when there are at most 64 of them; more take a second all-gather),
  checks that every rank agrees, and plans the placement (identical on every
  rank);
* :meth:`Engine.step` performs micro-step ``k``'s exchange: this rank posts the
  sends of every pack some peer computes at step ``k`` and receives the one pack
  it computes itself (if that pack lives elsewhere). Only moved packs travel;
* :meth:`Engine.exchange_batch` performs every micro-step's exchange of a batch at
  once (the path without the thread: one meeting per global batch).

All collectives run on the dedicated exchange group and every wait is bounded by
``timeout``; a failure names the global batch, the micro-step and the peer.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ..cost.pack import to_int_costs
from ..cost.pack_check import sample_keys
from ..solver.placement import Placement, PlanStats, control_placement, reordered_packs
from ..solver.topology import traffic
from . import faults
from .agreement import (INLINE_COSTS, STATUS_WHAT, BatchRecord, BatchStatus, check_agreement,
                        settings_hash, settings_string)
from .config import CROSSOVER_PARITIES, BalancerConfig
from .device import nvtx_range
from .errors import add_context, batch_name
from .planner import node_of_ranks, plan_batch
from .stats import BatchStats
from .transport import Item, PackTransport


class SourceExhausted(StopIteration):
    """Some rank's source could not fill the global batch (all ranks stop here).

    ``pulled[i]``: packs group rank ``i`` (global rank ``ranks[i]``) had drawn for this
    batch of ``num_microbatches``; none of them is delivered. The message names the ranks
    whose source ended, and how many packs were read for the batch and not trained on."""

    def __init__(self, global_batch: int, pulled: list[int], *, num_microbatches: int | None = None,
                 ranks: list[int] | None = None, where: str | None = None):
        ranks = list(range(len(pulled))) if ranks is None else list(ranks)
        G = max(pulled) if num_microbatches is None else num_microbatches
        short = [f"rank {r} after {n} of {G}" for r, n in zip(ranks, pulled) if n < G]
        super().__init__(f"data source exhausted at {where or f'global batch {global_batch}'}: the source "
                         f"of {', '.join(short)} packs ended; {sum(pulled)} packs pulled for this global "
                         f"batch (per rank {pulled}) are not delivered, and training stops before it")
        self.global_batch = global_batch
        self.pulled = pulled

    @property
    def not_delivered(self) -> int:
        return sum(self.pulled)


@dataclass
class Traffic:
    """What this rank's exchange of one global batch moved so far (counted while it runs)."""

    packs_sent: int = 0
    packs_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    inter_node_bytes_sent: int = 0
    exchange_ms: float = 0.0
    #: CPU time of the thread that drove the batch (pull, agreement, plan, exchange)
    exchange_cpu_ms: float = 0.0


@dataclass
class BatchPlan:
    """One global batch in flight: its packs, the placement delivered, and the figures
    from which :meth:`stats` builds the batch's :class:`~.stats.BatchStats`."""

    global_batch: int
    num_microbatches: int
    packs: list                        # this rank's pulled packs (None once sent/used)
    placement: Placement               # what is delivered (the identity in shadow mode)
    plan: PlanStats                    # the solved placement's figures (control: the delivered one's)
    mode: str = "exchange"             # "exchange", "shadow" or "control" (BatchStats.mode)
    my_costs: tuple = ()
    #: nodes the group spans and delivered packs that changed node (None: nodes unknown)
    nodes: int | None = None
    inter_node_packs: int | None = None
    allgather_ms: float = 0.0
    solver_ms: float = 0.0
    traffic: Traffic = field(default_factory=Traffic)
    prefetched: bool = False
    #: the source's ``save_state()`` right after this batch was pulled, i.e. the state
    #: before the next global batch (set only when the engine has a ``state_fn``)
    state_after: object = None
    #: images mode: the batch's units (:meth:`~.frame_ahead.FrameAhead.start`; None without)
    frames: object = None

    def stats(self, *, consumer_wait_ms: float = 0.0, consumer_wait_first_ms: float = 0.0) -> BatchStats:
        """The batch's record, completed with what the consumer measured."""
        t = self.traffic
        return BatchStats(
            global_batch=self.global_batch, num_microbatches=self.num_microbatches, plan=self.plan,
            mode=self.mode, nodes=self.nodes, inter_node_packs=self.inter_node_packs,
            packs_reordered=reordered_packs(self.placement), packs_sent=t.packs_sent,
            packs_received=t.packs_received, bytes_sent=t.bytes_sent, bytes_received=t.bytes_received,
            inter_node_bytes_sent=None if self.nodes is None else t.inter_node_bytes_sent,
            my_costs=self.my_costs,
            allgather_ms=self.allgather_ms, solver_ms=self.solver_ms, exchange_ms=t.exchange_ms,
            exchange_cpu_ms=t.exchange_cpu_ms, prefetched=self.prefetched, consumer_wait_ms=consumer_wait_ms,
            consumer_wait_first_ms=consumer_wait_first_ms)


def delivery_mode(config: BalancerConfig, iteration: int | None = None) -> str:
    """How the plan of the global batch of training ``iteration`` is delivered: ``"shadow"``,
    ``"control"`` or ``"exchange"``. With ``config.crossover``, ``"exchange"`` at iterations of
    that parity and ``"shadow"`` at the others; without an iteration, the setting itself
    (``"crossover-even"``, ``"crossover-odd"``), which every rank must share."""
    if config.crossover is not None:
        if iteration is None:
            return f"crossover-{config.crossover}"
        return "exchange" if iteration % 2 == CROSSOVER_PARITIES.index(config.crossover) else "shadow"
    return "shadow" if config.shadow else "control" if config.control else "exchange"


class Engine:
    """Exchange state of one rank (see module docstring). Not thread-safe: one
    thread (the consumer or the background thread) drives it."""

    def __init__(self, source, *, ranks, rank_index, exchange_group, cost_fn, cost_identity,
                 config: BalancerConfig, device=None, board=None, state_fn=None, found_nodes=None,
                 check_fn=None, first_iteration: int | None = None, describe=None, frames=None):
        self.source = source
        #: ``pack -> None``, raising for a pack that must not be balanced (None: no check)
        self.check_fn = check_fn
        #: the training iteration of global batch 0 (None: unknown; errors name the batch only)
        self.first_iteration = first_iteration
        self.name_batch = partial(batch_name, first_iteration=first_iteration)
        #: the source's ``save_state`` (or None): called right after each global batch is
        #: pulled, on the thread that pulls, so the state is exact for that position
        self.state_fn = state_fn
        self.config = config
        self.ranks = list(ranks)
        self.me = rank_index
        self.world = len(self.ranks)
        self.cost_fn = cost_fn
        #: node of each data-parallel rank as the planner places by: the override
        #: (``ranks_per_node``), else the found node ids (``found_nodes``, in group order), else
        #: None (flat)
        self.nodes = node_of_ranks(self.ranks, config.ranks_per_node, found_nodes)
        #: the nodes traffic is counted against: the found ones (where packs really travel,
        #: also when the planner is told otherwise), else the planner's; None: unknown
        self.traffic_nodes = (tuple(int(n) for n in found_nodes) if found_nodes is not None
                              else self.nodes)
        if self.traffic_nodes is not None and len(self.traffic_nodes) != len(self.ranks):
            raise ValueError(f"found_nodes: {len(self.traffic_nodes)} node ids for "
                             f"{len(self.ranks)} ranks")
        for name in ("job_step_groups", "step_groups"):
            labels = getattr(config, name)
            if labels is not None and len(labels) != len(self.ranks):
                raise ValueError(f"{name}: {len(labels)} labels for {len(self.ranks)} ranks")
        self.settings = settings_string(config.sync, config.balance_tolerance, cost_identity,
                                        config.ranks_per_node, self.nodes, delivery_mode(config),
                                        config.step_groups, config.step_groups_parity)
        self.hash = settings_hash(self.settings)
        #: ints per pack cost: 2 for a two-phase cost_fn (``components = 2``), else 1
        self.components = int(getattr(cost_fn, "components", 1) or 1)
        if self.components not in (1, 2):
            raise ValueError(f"cost_fn.components must be 1 or 2, got {self.components}")
        self.board = board
        self.transport = PackTransport(exchange_group, self.ranks, rank_index,
                                       timeout=config.timeout, device=device, board=board,
                                       name_batch=self.name_batch, pinned_bytes=config.pinned_bytes,
                                       describe=describe)
        #: the test hook's fault for this rank (:mod:`.faults`; None whenever it is unset)
        self.fault = faults.configured(self.ranks[rank_index])
        #: images mode's exchange-thread side (:class:`~.frame_ahead.FrameAhead`; None without):
        #: the batch's units gathered at its meeting, each micro-step's planned and sent ahead
        self.frames = frames
        if frames is not None:
            if self.world == 1:
                raise ValueError("images mode needs an exchange group of more than one rank")
            frames.bind(self.transport, self.ranks, rank_index, self.name_batch, board, self._peer_message)
        self.heartbeat = time.monotonic()
        self.phase = "idle"
        #: where the last failed pull stopped (``micro-step K (samples ...)``), for the peers
        self.failed_at = ""

    @property
    def cuda_mover(self):
        return self.transport.cuda_mover

    def iteration_of(self, gb: int) -> int:
        """The training iteration of global batch ``gb`` (a fresh job's, ``gb + 1``, when unknown)."""
        return (gb + 1) if self.first_iteration is None else self.first_iteration + gb

    def _beat(self, phase: str) -> None:
        self.phase = phase
        self.heartbeat = time.monotonic()

    # -- start of a global batch ---------------------------------------------
    def start_batch(self, gb: int, G: int) -> BatchPlan:
        """Pull, agree and plan global batch ``gb``; with a ``state_fn`` the plan also
        carries the source's state right after the pull (before batch ``gb + 1``).

        A ``cost_fn`` with ``for_batch(gb)`` (``--mm-balance-cost auto``) gives this batch's
        cost function, called here on every rank at the same batch (it may agree on a
        calibration over the exchange group first). The CPU time of the thread that runs
        this (the exchange thread with overlap) is counted in the batch's traffic."""
        cpu0 = time.thread_time()
        plan = self._start_batch(gb, G)
        plan.traffic.exchange_cpu_ms += (time.thread_time() - cpu0) * 1e3
        return plan

    def _start_batch(self, gb: int, G: int) -> BatchPlan:
        with nvtx_range("mm-balance pull"):
            packs, costs, status, err, state_after = self._pull(gb, G)
        pulled = len(packs)
        if self.world == 1:
            if err is not None:
                raise err
            if pulled < G:
                raise SourceExhausted(gb, [pulled], num_microbatches=G, ranks=self.ranks,
                                      where=self.name_batch(gb))
            return self._plan(gb, G, packs, self._matrix(np.asarray([costs], dtype=np.int64), G),
                              0.0, state_after)
        self._post_to_board(gb, status, err)
        self._beat("all-gathering pack costs")
        t0 = time.perf_counter()
        with nvtx_range("mm-balance all-gather"):
            all_costs = self._agree(gb, G, costs, pulled, status, err)
        gather_ms = (time.perf_counter() - t0) * 1e3
        plan = self._plan(gb, G, packs, all_costs, gather_ms, state_after)
        if self.frames is not None:
            self._beat(f"all-gathering the frame table of {self.name_batch(gb)}")
            self.frames.start(plan, balanced=plan.mode == "exchange", budget_steps=self._frame_steps_alive(G))
        return plan

    def _frame_steps_alive(self, G: int) -> int:
        """How many micro-steps' rows sent ahead a rank may hold at once: with the thread, the
        ones it runs ahead plus those between forward and backward (``pp`` under 1F1B);
        without it, the batch's ``G`` (they all arrive at its first micro-step)."""
        from .frame_ahead import THREAD_AHEAD_STEPS
        if self.config.overlap:
            return self.frames.pipeline_stages + THREAD_AHEAD_STEPS
        return max(G, self.frames.pipeline_stages)

    def _pull(self, gb: int, G: int):
        """This rank's packs of batch ``gb``, their integer costs, how it went (a
        :class:`~.agreement.BatchStatus` and the error), and the source's state after.

        Each pack is checked (``check_fn``) and costed as it is pulled: a pack the check
        refuses, or whose cost is not a finite number >= 0, stops every rank at the
        agreement, before anything of this batch moves. An error keeps its type and gains
        where it happened (:func:`~.errors.add_context`: rank, batch, micro-step, the
        pack's sample keys)."""
        cost_fn = self.cost_fn.for_batch(gb) if hasattr(self.cost_fn, "for_batch") else self.cost_fn
        where = self.name_batch(gb)
        self._beat(f"pulling packs of {where} from the data source")
        packs, costs, err, state_after = [], [], None, None
        stage, at = BatchStatus.SOURCE_ERROR, "micro-step 0"
        try:
            for k in range(G):
                stage, at = BatchStatus.SOURCE_ERROR, f"micro-step {k}"
                if self.fault is not None and self.fault.at_pull(self.iteration_of(gb), k, where):
                    break                            # the injected end of the data
                try:
                    pack = next(self.source)
                except StopIteration:
                    break
                if self.fault is not None:
                    pack = self.fault.after_pull(self.iteration_of(gb), k, pack)
                packs.append(pack)
                self.heartbeat = time.monotonic()
                stage, at = BatchStatus.PACK_REFUSED, f"micro-step {k}{pack_keys(pack)}"
                if self.check_fn is not None:
                    self.check_fn(pack)
                stage = BatchStatus.COST_ERROR
                costs.append(to_int_costs(cost_fn(pack), self.components,
                                          f" for the pack of micro-step {k}{pack_keys(pack)} at {where}"))
            if self.state_fn is not None and len(packs) == G:
                # Nothing else touches the source until the next pull: this is the state
                # before global batch gb + 1. A failure is a source error, seen by all ranks.
                stage, at = BatchStatus.SOURCE_ERROR, "save_state after the pull"
                self._beat("saving the data source's state")
                state_after = self.state_fn()
            status = BatchStatus.OK
        except Exception as e:                       # reported to peers via the record
            status, self.failed_at = stage, at
            err = add_context(e, f"rank {self.ranks[self.me]}, {where}, {at}: the {STATUS_WHAT[stage]}")
        return packs, costs, status, err, state_after

    def _post_to_board(self, gb: int, status: BatchStatus, err) -> None:
        """Tell the peers (through the store) this rank reached ``gb``, and its error if any."""
        me = self.ranks[self.me]
        if err is not None and self.board:         # peers quote it after "rank R's data source raised"
            self.board.post_error(me, f"{self.failed_at}: {type(err).__name__}: {err}")
        if self.board:
            self.board.post_progress(me, gb)

    def _agree(self, gb: int, G: int, costs: list, pulled: int, status: BatchStatus, err) -> np.ndarray:
        """All-gather every rank's :class:`~.agreement.BatchRecord`, check them, and return
        the group's cost matrix (a second all-gather when the costs do not fit inline)."""
        k = self.components                          # ints per pack: 1, or (vision, language)
        inline = G * k <= INLINE_COSTS
        flat = tuple(x for c in costs for x in c)
        mine = BatchRecord(global_batch=gb, num_microbatches=G, packs_pulled=pulled,
                           settings_hash=self.hash, status=status,
                           costs=flat if inline and costs else ())
        rows = self.transport.all_gather(torch.from_numpy(mine.encode()),
                                         "all-gather of the per-batch record", gb).numpy()
        records = [BatchRecord.decode(row, G * k if inline else 0) for row in rows]
        check_agreement(records, ranks=self.ranks, me=self.ranks[self.me], global_batch=gb,
                        num_microbatches=G, settings=self.settings, own_error=err,
                        peer_message=self._peer_message, where=self.name_batch(gb))
        if any(r.packs_pulled < r.num_microbatches for r in records):
            raise SourceExhausted(gb, [r.packs_pulled for r in records], num_microbatches=G,
                                  ranks=self.ranks, where=self.name_batch(gb))
        if inline:                                   # every rank agrees on G by now
            all_costs = np.array([r.costs for r in records], dtype=np.int64)
        else:
            c = torch.tensor(flat, dtype=torch.int64)
            all_costs = self.transport.all_gather(c, "all-gather of pack costs", gb).numpy().copy()
        return self._matrix(all_costs, G)

    def _matrix(self, flat: np.ndarray, G: int) -> np.ndarray:
        """``[D, G]`` scalar costs, or ``[D, G, 2]`` (vision, language) ones."""
        D = flat.shape[0]
        return flat.reshape(D, G) if self.components == 1 else flat.reshape(D, G, self.components)

    def _plan(self, gb, G, packs, costs, gather_ms, state_after) -> BatchPlan:
        """Plan the batch (:func:`~.planner.plan_batch`); shadow mode (and crossover's other
        parity) delivers the identity, control mode every rank's own packs in balancing's
        micro-step order (and records that permutation's figures: nothing moved)."""
        self._beat("solving placement")
        t0 = time.perf_counter()
        with nvtx_range("mm-balance solve"):
            placed_by = self.step_groups_of(gb)
            solved, plan = plan_batch(costs, self.config, nodes=self.nodes, step_groups=placed_by)
        mode = delivery_mode(self.config, self.iteration_of(gb))
        scalar = costs.sum(axis=2) if costs.ndim == 3 else costs
        judged_by = self.config.job_step_groups          # the job's groups judge every placement
        if mode == "shadow":
            delivered = Placement.identity(self.world, G)
        elif mode == "control":
            delivered = control_placement(solved)
            plan = PlanStats.of(scalar, delivered, step_groups=judged_by, nodes=self.nodes)
        else:
            delivered = solved
        if mode != "control" and judged_by is not None and judged_by != placed_by:
            plan = PlanStats.of(scalar, solved, step_groups=judged_by, nodes=self.nodes)
        solve_ms = (time.perf_counter() - t0) * 1e3
        nodes = self.traffic_nodes
        return BatchPlan(
            global_batch=gb, num_microbatches=G, packs=list(packs), placement=delivered, plan=plan,
            mode=mode, my_costs=tuple(int(x) for x in delivered.apply(scalar)[self.me]),
            nodes=None if nodes is None else len(set(nodes)),
            inter_node_packs=None if nodes is None else traffic(delivered.src_rank, list(nodes))["inter_node_packs"],
            allgather_ms=gather_ms, solver_ms=solve_ms, state_after=state_after)

    def step_groups_of(self, gb: int):
        """The meeting groups global batch ``gb`` is placed by: ``config.step_groups``, at the
        iterations of ``config.step_groups_parity`` only when it is set (None at the others:
        every rank as if it met every micro-step)."""
        parity = self.config.step_groups_parity
        if parity is None or self.iteration_of(gb) % 2 == CROSSOVER_PARITIES.index(parity):
            return self.config.step_groups
        return None

    def _peer_message(self, rank: int) -> str:
        store = self.board.store if self.board else None
        if store is None:
            return ""
        key = self.board.key("err", rank)
        try:
            store.wait([key], datetime.timedelta(seconds=min(5.0, self.config.timeout)))
            return ": " + store.get(key).decode(errors="replace")
        except Exception:
            return ""

    # -- one micro-step's exchange -------------------------------------------
    def step(self, plan: BatchPlan, k: int) -> Item:
        """Deliver micro-step ``k``: send the packs peers compute now, receive (or take)
        the one this rank computes, placed on the target device."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        frames = self.frames.post(plan, k) if self.frames is not None else None
        with nvtx_range("mm-balance exchange"):
            sends = self._post_sends(plan, k)
            item = self._take(plan, k, place=True)
            self._finish_sends(plan, sends)
        if frames is not None:
            item.frames = self.frames.complete(frames)
        self._account(plan, t0, cpu0)
        return item

    def exchange_batch(self, plan: BatchPlan) -> list:
        """Every micro-step's exchange of the batch at once: the items of micro-steps
        0..G-1, each still on the host until :meth:`~.transport.PackTransport.placed` puts
        it on the device at its delivery.

        Without the exchange thread this is what ``next()`` runs at a batch's first
        micro-step: the ranks meet once per global batch, right after the optimizer step
        where they already met, instead of at every micro-step that moves a pack, where a
        rank still finishing its previous micro-step's backward keeps its partner waiting.
        All of this rank's sends are posted first, then the receives run in micro-step
        order: a pair's messages still match in the order posted (each rank posts its sends
        and its receives in micro-step order), and the transfers of different micro-steps,
        in both directions, share the link instead of taking turns."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        G = plan.num_microbatches
        frames = [self.frames.post(plan, k) for k in range(G)] if self.frames is not None else []
        with nvtx_range("mm-balance exchange"):
            sends = [s for k in range(G) for s in self._post_sends(plan, k)]
            items = [self._take(plan, k, place=False) for k in range(G)]
            self._finish_sends(plan, sends)
        for item, posted in zip(items, frames):
            item.frames = self.frames.complete(posted)
        self._account(plan, t0, cpu0)
        return items

    def _post_sends(self, plan: BatchPlan, k: int) -> list:
        """Post the sends of the packs peers compute at micro-step ``k``, counted in the
        batch's traffic; ``[(k, pending), ...]``."""
        gb, P, me, t = plan.global_batch, plan.placement, self.me, plan.traffic
        if self.fault is not None:
            self.fault.at_exchange(self.iteration_of(gb), k, self.name_batch(gb))
        sends = []
        if self.world == 1:
            return sends
        self._beat(f"exchange of micro-step {k} of {self.name_batch(gb)}")
        for dst in range(self.world):
            if dst != me and int(P.src_rank[dst, k]) == me:
                idx = int(P.src_index[dst, k])
                pack, plan.packs[idx] = plan.packs[idx], None
                pending = self.transport.send(pack, dst, gb, k)
                sends.append((k, pending))
                t.packs_sent += 1
                t.bytes_sent += pending.nbytes
                if self.traffic_nodes is not None and self.traffic_nodes[dst] != self.traffic_nodes[me]:
                    t.inter_node_bytes_sent += pending.nbytes
        return sends

    def _take(self, plan: BatchPlan, k: int, place: bool) -> Item:
        """Micro-step ``k``'s pack of this rank: its own, or received from its owner."""
        gb, P, me, t = plan.global_batch, plan.placement, self.me, plan.traffic
        src_r, src_i = int(P.src_rank[me, k]), int(P.src_index[me, k])
        if src_r == me:
            pack, plan.packs[src_i] = plan.packs[src_i], None
            item = self.transport.local(pack, place=place)
        else:
            item, nbytes = self.transport.receive(src_r, gb, k, place=place)
            t.packs_received += 1
            t.bytes_received += nbytes
        item.num_microbatches = plan.num_microbatches
        if k == plan.num_microbatches - 1:
            item.batch = plan
        self._beat(f"micro-step {k} of {self.name_batch(gb)} exchanged")
        return item

    def _finish_sends(self, plan: BatchPlan, sends: list) -> None:
        for k, pending in sends:
            self.transport.finish(pending, plan.global_batch, k)

    @staticmethod
    def _account(plan: BatchPlan, t0: float, cpu0: float) -> None:
        t = plan.traffic
        t.exchange_ms += (time.perf_counter() - t0) * 1e3
        # CPU time of the thread that ran it (the exchange thread with overlap): its share of
        # the core the training thread also needs.
        t.exchange_cpu_ms += (time.thread_time() - cpu0) * 1e3


def pack_keys(pack) -> str:
    """`` (samples a, b, ...)``: a pack's sample keys for messages (its ``__key__``,
    :func:`~megatron_mm_balance.cost.pack_check.sample_keys`), or "" when it has none."""
    names = sample_keys(pack)
    if not names:
        return ""
    return " (samples " + ", ".join(names[:12]) + (f", ... {len(names)} in all" if len(names) > 12 else "") + ")"
