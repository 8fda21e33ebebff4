"""One rank's side of one global batch: pull, agree, place, exchange.

:class:`Engine` has two operations, used either synchronously from ``next()``
(``overlap=False``) or from the background thread (``overlap=True``):

* :meth:`Engine.start_batch` pulls ``num_microbatches`` packs from the source,
  all-gathers a fixed-size record (global batch index, num_microbatches, packs
  pulled, settings hash, status, and the integer costs when there are at most
  64 of them; more take a second all-gather), checks that every rank agrees,
  and solves the placement (identical on every rank);
* :meth:`Engine.step` performs micro-step ``k``'s exchange: this rank posts the
  sends of every pack some peer computes at step ``k`` and receives the one pack
  it computes itself (if that pack lives elsewhere). Only moved packs travel.

All collectives run on the dedicated exchange group and every wait is bounded by
``timeout``; a failure names the global batch, the micro-step and the peer.
"""
from __future__ import annotations

import datetime
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..solver.placement import DEFAULT_BALANCE_TOLERANCE, Placement, PlanStats, plan_placement
from ..solver.topology import traffic
from . import wire
from ..cost.pack import to_int_costs
from .device import CudaMover
from .errors import InconsistentConfig, PeerFailure

MAGIC = 0x6D6D62                       # "mmb"
PROTOCOL = 1
OK, SOURCE_ERROR, COST_ERROR = 0, 1, 2
RECORD = 8
INLINE_COSTS = 64          # costs that ride in the record; more need a second all-gather


def settings_string(sync: str, tolerance, cost_identity: str, ranks_per_node=None) -> str:
    return (f"protocol={PROTOCOL} sync={sync} balance_tolerance={tolerance!r} cost_fn={cost_identity}"
            + (f" ranks_per_node={ranks_per_node}" if ranks_per_node else ""))


def settings_hash(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class SourceExhausted(StopIteration):
    """Some rank's source could not fill the global batch (all ranks stop here).

    ``pulled[i]``: packs group rank ``i`` had drawn for this batch; none of them
    is delivered."""

    def __init__(self, global_batch: int, pulled: list[int]):
        super().__init__(f"data source exhausted at global batch {global_batch}: packs pulled per "
                         f"rank {pulled}, {sum(pulled)} pulled but not delivered")
        self.global_batch = global_batch
        self.pulled = pulled


@dataclass
class BatchPlan:
    global_batch: int
    num_microbatches: int
    packs: list                        # this rank's pulled packs (None once sent/used)
    placement: Placement
    stats: dict = field(default_factory=dict)
    #: the source's ``save_state()`` right after this batch was pulled, i.e. the state
    #: before the next global batch (set only when the engine has a ``state_fn``)
    state_after: object = None


@dataclass
class Item:
    """One delivered micro-batch, plus what the consumer must wait on."""

    pack: object
    event: object = None
    buffers: tuple = ()
    last: bool = False
    stats: dict | None = None
    state_after: object = None         # on the last item: the plan's ``state_after``
    num_microbatches: int = 0          # the global batch's G, as the thread ran it


def _gather_stats(costs: np.ndarray, placement: Placement, me: int, planned=None) -> dict:
    """The batch's :class:`PlanStats` record plus this rank's own share of the moves.

    ``planned`` (shadow mode): the placement that was solved but not delivered; the
    record then describes it (``shadow``, ``predicted_gain``), the rank's own share
    describes what was delivered."""
    moved = placement.moved()
    plan = PlanStats.of(costs, placement if planned is None else planned)
    st = {
        **plan.record(),
        "packs_sent": int(((placement.src_rank == me) & moved).sum()),
        "packs_received": int(moved[me].sum()),
        "my_costs": [int(x) for x in placement.apply(costs)[me]],
    }
    if planned is not None:
        st.update(shadow=True, predicted_gain=plan.predicted_gain)
    return st


class Engine:
    """Exchange state of one rank (see module docstring). Not thread-safe: one
    thread (the consumer or the background thread) drives it."""

    def __init__(self, source, *, ranks, rank_index, exchange_group, cost_fn, cost_identity,
                 sync, balance_tolerance, device, timeout, board, shadow: bool = False,
                 ranks_per_node: int | None = None, state_fn=None):
        self.source = source
        #: the source's ``save_state`` (or None): called right after each global batch is
        #: pulled, on the thread that pulls, so the state is exact for that position
        self.state_fn = state_fn
        self.ranks = list(ranks)
        self.me = rank_index
        self.world = len(self.ranks)
        self.group = exchange_group
        self.cost_fn = cost_fn
        self.sync = sync
        self.tolerance = DEFAULT_BALANCE_TOLERANCE if balance_tolerance is None else float(balance_tolerance)
        self.settings = settings_string(sync, self.tolerance, cost_identity, ranks_per_node)
        #: ints per pack cost: 2 for a two-phase cost_fn (``components = 2``), else 1
        self.components = int(getattr(cost_fn, "components", 1) or 1)
        if self.components not in (1, 2):
            raise ValueError(f"cost_fn.components must be 1 or 2, got {self.components}")
        # Node of each data-parallel rank, from its global rank (None: flat).
        self.nodes = (None if not ranks_per_node else
                      tuple(int(r) // int(ranks_per_node) for r in self.ranks))
        self.hash = settings_hash(self.settings)
        self.device = device
        self.timeout = float(timeout)
        self.board = board
        self.shadow = bool(shadow)
        self.cuda_mover = CudaMover(device) if device is not None and device.type == "cuda" else None
        self.heartbeat = time.monotonic()
        self.phase = "idle"

    # -- helpers -----------------------------------------------------------
    def _beat(self, phase: str) -> None:
        self.phase = phase
        self.heartbeat = time.monotonic()

    def _wait(self, work, what: str, gb: int, peers=(), step=None) -> None:
        t0 = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            where = f"global batch {gb}" + (f", micro-step {step}" if step is not None else "")
            peer_txt = (" with rank " + ", ".join(str(p) for p in peers)) if peers else ""
            me = self.ranks[self.me]
            diag = self.board.diagnose(me, gb) if self.board else ""
            first = (str(e).splitlines() or [""])[0][:300]
            msg = (f"rank {me}: {what}{peer_txt} failed at {where} after "
                   f"{time.monotonic() - t0:.1f}s ({type(e).__name__}: {first}); {diag}")
            if self.board:                           # lets peers name the root cause
                self.board.post_error(me, f"{what}{peer_txt} failed at {where}")
            raise PeerFailure(msg, global_batch=gb, peers=peers) from e

    def _all_gather(self, t: torch.Tensor, what: str, gb: int) -> torch.Tensor:
        out = torch.empty(self.world * t.numel(), dtype=t.dtype)
        outs = list(out.view(self.world, -1).unbind(0))
        work = dist.all_gather(outs, t, group=self.group, async_op=True)
        self._wait(work, what, gb)
        return out.view(self.world, -1)

    # -- start of a global batch ---------------------------------------------
    def start_batch(self, gb: int, G: int) -> BatchPlan:
        """Pull, agree and solve global batch ``gb``; with a ``state_fn`` the plan also
        carries the source's state right after the pull (before batch ``gb + 1``).

        A ``cost_fn`` with ``for_batch(gb)`` (``--mm-balance-cost auto``) gives this batch's
        cost function, called here on every rank at the same batch (it may agree on a
        calibration over the exchange group first)."""
        cpu0 = time.thread_time()
        plan = self._start_batch(gb, G)
        plan.stats["exchange_cpu_ms"] = (time.thread_time() - cpu0) * 1e3
        return plan

    def _start_batch(self, gb: int, G: int) -> BatchPlan:
        cost_fn = self.cost_fn.for_batch(gb) if hasattr(self.cost_fn, "for_batch") else self.cost_fn
        self._beat("pulling packs from the data source")
        packs, costs, status, err, state_after = [], [], OK, None, None
        try:
            for _ in range(G):
                try:
                    packs.append(next(self.source))
                except StopIteration:
                    break
                self.heartbeat = time.monotonic()
            if self.state_fn is not None and len(packs) == G:
                # Nothing else touches the source until the next pull: this is the state
                # before global batch gb + 1. A failure is a source error, seen by all ranks.
                self._beat("saving the data source's state")
                state_after = self.state_fn()
        except Exception as e:                       # reported to peers via the record
            status, err = SOURCE_ERROR, e
        if status == OK:
            try:
                costs = [to_int_costs(cost_fn(p), self.components,
                                      f" for a pack at global batch {gb}") for p in packs]
            except Exception as e:
                status, err = COST_ERROR, e
        pulled = len(packs)
        if self.world == 1:
            if err is not None:
                raise err
            if pulled < G:
                raise SourceExhausted(gb, [pulled])
            return self._plan(gb, G, packs, self._matrix(np.asarray([costs], dtype=np.int64), G),
                              0.0, 0.0, state_after=state_after)

        me_global = self.ranks[self.me]
        if err is not None and self.board:
            self.board.post_error(me_global, f"data source raised at global batch {gb}: "
                                  f"{type(err).__name__}: {err}" if status == SOURCE_ERROR else
                                  f"cost_fn raised at global batch {gb}: {type(err).__name__}: {err}")
        if self.board:
            self.board.post_progress(me_global, gb)
        self._beat("all-gathering pack costs")
        t0 = time.perf_counter()
        # Fixed size whatever G is, so ranks that disagree on G still meet here.
        rec = torch.zeros(RECORD + INLINE_COSTS, dtype=torch.int64)
        rec[:RECORD] = torch.tensor([MAGIC, gb, G, pulled, self.hash, status, 0, 0])
        k = self.components                          # ints per pack: 1, or (vision, language)
        if G * k <= INLINE_COSTS and costs:
            flat = [x for c in costs for x in c]
            rec[RECORD: RECORD + len(flat)] = torch.tensor(flat, dtype=torch.int64)
        recs = self._all_gather(rec, "all-gather of the per-batch record", gb).numpy()
        self._check_records(recs, gb, G, err)
        if (recs[:, 3] < recs[:, 2]).any():
            raise SourceExhausted(gb, [int(x) for x in recs[:, 3]])
        if G * k <= INLINE_COSTS:                    # every rank agrees on G by now
            all_costs = recs[:, RECORD: RECORD + G * k].copy()
        else:
            c = torch.tensor([x for c in costs for x in c], dtype=torch.int64)
            all_costs = self._all_gather(c, "all-gather of pack costs", gb).numpy().copy()
        all_costs = self._matrix(all_costs, G)
        gather_ms = (time.perf_counter() - t0) * 1e3
        self._beat("solving placement")
        t0 = time.perf_counter()
        placement = plan_placement(all_costs, sync=self.sync, balance_tolerance=self.tolerance,
                                   ranks_per_node=None if self.nodes is None else list(self.nodes))
        solve_ms = (time.perf_counter() - t0) * 1e3
        return self._plan(gb, G, packs, all_costs, gather_ms, solve_ms, placement,
                          state_after=state_after)

    def _matrix(self, flat: np.ndarray, G: int) -> np.ndarray:
        """``[D, G]`` scalar costs, or ``[D, G, 2]`` (vision, language) ones."""
        D = flat.shape[0]
        return flat.reshape(D, G) if self.components == 1 else flat.reshape(D, G, self.components)

    def _plan(self, gb, G, packs, costs, gather_ms, solve_ms, placement=None, *,
              state_after=None) -> BatchPlan:
        if placement is None:
            placement = Placement.identity(self.world, G)
        if costs.ndim == 3:                          # statistics on the total (vision + language)
            costs = costs.sum(axis=2)
        if self.shadow:
            # Measured and solved as usual, but every rank keeps its own packs in their
            # order: the statistics are the plan's (what balancing would give), marked so.
            planned, placement = placement, Placement.identity(self.world, G)
            st = _gather_stats(costs, placement, self.me, planned=planned)
        else:
            st = _gather_stats(costs, placement, self.me)
        st.update(global_batch=gb, num_microbatches=G, allgather_ms=gather_ms, solver_ms=solve_ms,
                  bytes_sent=0, bytes_received=0, exchange_ms=0.0, consumer_wait_ms=0.0,
                  inter_node_packs=traffic(placement.src_rank,
                                           None if self.nodes is None else list(self.nodes)
                                           )["inter_node_packs"],
                  inter_node_bytes_sent=0)
        return BatchPlan(gb, G, list(packs), placement, st, state_after)

    def _check_records(self, recs: np.ndarray, gb: int, G: int, err) -> None:
        me = self.ranks[self.me]
        bad = [self.ranks[i] for i in range(self.world) if recs[i, 0] != MAGIC]
        if bad:
            raise InconsistentConfig(f"rank {me}: ranks {bad} sent a malformed record at global batch "
                                     f"{gb} (different runtime version?)", global_batch=gb, peers=bad)
        failed = [i for i in range(self.world) if recs[i, 5] != OK]
        if failed:
            if err is not None:
                raise err                               # this rank's own error, unchanged
            msgs = []
            for i in failed:
                what = "data source" if recs[i, 5] == SOURCE_ERROR else "cost_fn"
                msgs.append(f"rank {self.ranks[i]}'s {what} raised"
                            + self._peer_message(self.ranks[i]))
            raise PeerFailure(f"rank {me}: global batch {gb} aborted: " + "; ".join(msgs),
                              global_batch=gb, peers=[self.ranks[i] for i in failed])
        gbs = recs[:, 1]
        if (gbs != gb).any():
            raise InconsistentConfig(
                f"rank {me}: ranks are at different global batches "
                f"{dict(zip(self.ranks, map(int, gbs)))} (iterators created out of step?)",
                global_batch=gb)
        gs = recs[:, 2]
        if (gs != G).any():
            raise InconsistentConfig(
                f"rank {me}: num_microbatches differs across ranks at global batch {gb}: "
                f"{dict(zip(self.ranks, map(int, gs)))}", global_batch=gb,
                peers=[self.ranks[i] for i in np.flatnonzero(gs != G)])
        hs = recs[:, 4]
        if (hs != self.hash).any():
            odd = [self.ranks[i] for i in np.flatnonzero(hs != self.hash)]
            raise InconsistentConfig(
                f"rank {me}: solver settings differ across ranks at global batch {gb}: ranks {odd} "
                f"disagree with this rank's [{self.settings}]", global_batch=gb, peers=odd)

    def _peer_message(self, rank: int) -> str:
        store = self.board.store if self.board else None
        if store is None:
            return ""
        key = self.board.key("err", rank)
        try:
            store.wait([key], datetime.timedelta(seconds=min(5.0, self.timeout)))
            return ": " + store.get(key).decode(errors="replace")
        except Exception:
            return ""

    # -- one micro-step's exchange -------------------------------------------
    # A moved pack is three kinds of messages from its owner to its computer,
    # matched in order: a 3-int64 record (header bytes, data bytes, tensor
    # count), the pickled header, then each non-empty tensor's bytes.
    def step(self, plan: BatchPlan, k: int) -> Item:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        gb, P, me = plan.global_batch, plan.placement, self.me
        st = plan.stats
        src_r, src_i = int(P.src_rank[me, k]), int(P.src_index[me, k])
        sends = []
        if self.world > 1:
            self._beat(f"exchange of micro-step {k}")
            for dst in range(self.world):
                if dst != me and int(P.src_rank[dst, k]) == me:
                    idx = int(P.src_index[dst, k])
                    pack, plan.packs[idx] = plan.packs[idx], None
                    sends.append(self._send(pack, self.ranks[dst], st))
        if src_r == me:
            pack, plan.packs[src_i] = plan.packs[src_i], None
            item = self._local(pack)
        else:
            item = self._receive(gb, k, self.ranks[src_r], st)
        for peer, works, _keep in sends:
            for w in works:
                self._wait(w, "sending a pack", gb, (peer,), k)
        st["exchange_ms"] += (time.perf_counter() - t0) * 1e3
        # CPU time of the thread that ran it (the exchange thread with overlap): its share of
        # the core the training thread also needs.
        st["exchange_cpu_ms"] = st.get("exchange_cpu_ms", 0.0) + (time.thread_time() - cpu0) * 1e3
        item.last = k == plan.num_microbatches - 1
        self._beat("idle")
        return item

    def _send(self, pack, peer: int, st: dict):
        sp = wire.split(pack)
        parts = [p.cpu() if p.is_cuda else p for p in sp.parts if p.numel()]
        header = torch.frombuffer(bytearray(sp.header), dtype=torch.uint8)
        meta = torch.tensor([len(sp.header), sp.data_nbytes, len(parts)], dtype=torch.int64)
        works = [dist.isend(t, dst=peer, group=self.group) for t in [meta, header] + parts]
        st["bytes_sent"] += 24 + len(sp.header) + sum(p.numel() for p in parts)
        if self.nodes is not None and self.nodes[self.ranks.index(peer)] != self.nodes[self.me]:
            st["inter_node_bytes_sent"] += 24 + len(sp.header) + sum(p.numel() for p in parts)
        return peer, works, (meta, header, parts)        # keep buffers alive until sent

    def _receive(self, gb: int, k: int, peer: int, st: dict) -> Item:
        def recv(t, what):
            self._wait(dist.irecv(t, src=peer, group=self.group), what, gb, (peer,), k)

        meta = torch.empty(3, dtype=torch.int64)
        recv(meta, "receiving a pack record")
        hlen, nbytes, nparts = (int(x) for x in meta)
        raw = torch.empty(max(hlen, 0), dtype=torch.uint8)
        if hlen <= 0 or nbytes < 0:
            raise PeerFailure(f"rank {self.ranks[self.me]}: corrupt pack record {meta.tolist()} from "
                              f"rank {peer} at global batch {gb}, micro-step {k}",
                              global_batch=gb, peers=(peer,))
        recv(raw, "receiving a pack header")
        header = wire.read_header(raw)
        refs = [r for r in wire.refs_of(header) if r.nbytes]
        if len(refs) != nparts or (refs and refs[-1].offset + refs[-1].nbytes > nbytes):
            raise PeerFailure(f"rank {self.ranks[self.me]}: pack header from rank {peer} does not match "
                              f"its record at global batch {gb}, micro-step {k}",
                              global_batch=gb, peers=(peer,))
        data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda_mover is not None)
        works = [dist.irecv(data[r.offset: r.offset + r.nbytes], src=peer, group=self.group) for r in refs]
        for w in works:
            self._wait(w, "receiving a pack", gb, (peer,), k)
        st["bytes_received"] += 24 + hlen + sum(r.nbytes for r in refs)
        return self._place(header, data)

    def _local(self, pack) -> Item:
        if self.device is None or _all_on(pack, self.device):
            return Item(pack)
        header, data = wire.encode(pack, pin_memory=self.device.type == "cuda")
        return self._place(header, data)

    def _place(self, header, data) -> Item:
        """Decode a host data buffer onto the target device(s)."""
        if self.device is not None:
            target_cuda = self.device.type == "cuda"
        else:                                        # keep each tensor's device type
            target_cuda = "cuda" in wire.device_types(header)
        if not target_cuda:
            return Item(wire.decode(header, lambda ref: data))
        dev, event = self._cuda().to_device(data)
        if self.device is not None:
            return Item(wire.decode(header, lambda ref: dev), event, (dev,))
        return Item(wire.decode(header, lambda ref: dev if ref.device_type == "cuda" else data),
                    event, (dev,))

    def _cuda(self) -> CudaMover:
        if self.cuda_mover is None:
            if not torch.cuda.is_available():
                raise RuntimeError("a peer sent CUDA tensors but CUDA is not available on this rank; "
                                   "pass device='cpu' to receive them on the host")
            self.cuda_mover = CudaMover(torch.device("cuda", torch.cuda.current_device()))
            self.cuda_mover.enter_thread()
        return self.cuda_mover


def _all_on(pack, device: torch.device) -> bool:
    return all(d.type == device.type and (device.index is None or d.index == device.index)
               for d in wire.tensor_devices(pack))
