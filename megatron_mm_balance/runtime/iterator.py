"""``BalancedDataIterator``: swaps packs between data-parallel ranks so every
micro-step carries a comparable image-token load, overlapped with compute.

Life of a global batch (``num_microbatches = G``):

1. the consumer's first ``next()`` reads ``G`` (an int, or a callable such as
   Megatron's ``get_num_microbatches`` read exactly here, so batch-size ramp-up
   works) and asks the engine to start the batch;
2. the engine pulls ``G`` packs from this rank's source, all-gathers a small
   record and the integer costs on the exchange group, and solves the placement
   (identical on every rank);
3. micro-step by micro-step it receives the pack this rank computes (if it lives
   elsewhere) and sends the ones peers compute. With ``overlap=True`` a
   background thread runs steps 2-3 ahead of the consumer through a bounded
   queue (one micro-batch ready plus one in flight), so micro-step ``k+1``'s
   exchange hides behind micro-step ``k``'s compute; with ``overlap=False`` the
   first ``next()`` of the batch runs them all (:meth:`~.engine.Engine.exchange_batch`:
   every send posted, then the receives in micro-step order): the ranks meet once
   per global batch, where the optimizer step has just aligned them, and each
   pack goes to the device when it is delivered.

With an int ``num_microbatches`` the thread runs across global-batch
boundaries: batch ``b+1``'s pull, all-gather, solve and first exchange hide
behind batch ``b``'s last micro-step (one global batch may be pulled from the
source and never delivered when training stops). With a callable the thread
starts a batch only when the consumer asks for it, since the value may change
right before that (Megatron updates it at the top of each iteration), so that
batch's all-gather, solve and first exchange are exposed, unless a
``predict_microbatches`` callable is also given: the thread then free-runs on
its predictions, and the consumer checks each against the real value when the
batch starts (a mismatch is an error naming the batch and both counts).

Checkpointable sources (a ``save_state()`` method, as energon's loaders have)
prefetch the same way. The source is only ever touched by the thread that
pulls from it, and that thread calls ``save_state()`` right after pulling each
global batch: the state before the next one. The state travels with the
batch's last micro-batch, so :meth:`BalancedDataIterator.save_state` returns,
at any global-batch boundary, the state that matches exactly the micro-batches
consumed so far, however far the thread has read ahead; a resumed run restores
it and continues with the first global batch not trained on. Only the state of
the last consumed boundary is kept, plus one per batch in flight.
"""
from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
import time
import weakref

import torch.distributed as dist

from .config import BalancerConfig
from ..cost.pack import cost_fn_identity, default_cost_fn
from .device import enter_thread, nvtx_range, resolve_device, thread_device
from .engine import Engine, SourceExhausted
from . import probe
from .errors import BalancerError, ExchangeThreadError
from .groups import ProgressBoard, exchange_group_for, gather_node_ids, group_ranks
from .stats import BatchStats
from .transport import Item

log = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[BalancedDataIterator]" = weakref.WeakSet()
_QUEUE_DEPTH = 1          # micro-batches ready; one more may be in flight in the thread
_POLL_S = 0.05


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _Worker:
    """The background thread's state. Holds no reference to the iterator, so an
    abandoned iterator can still be garbage-collected (and closed by ``__del__``)."""

    def __init__(self, engine: Engine, fixed_G: int | None, predictor=None, device: int | None = None):
        self.engine = engine
        #: the CUDA device the thread runs on (None: no CUDA), set first thing in :meth:`run`
        self.device = device
        self.fixed_G = fixed_G
        self.predictor = predictor          # free-running on predicted counts (checked by the consumer)
        #: the global batch the consumer has asked for last (written by the consumer only);
        #: a batch started before the consumer asked for it was prefetched
        self.requested = -1
        self.requests: queue.Queue = queue.Queue()
        self.items: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="mm-balance-exchange", daemon=True)

    def _put(self, obj) -> bool:
        """Hand over ``obj``; False once stopped and the queue is full.

        The stop flag is only looked at while blocked here: until its queue is
        full, every rank's thread performs the same exchanges whatever its
        consumer does, so a rank that closes never strands a peer mid-exchange.
        """
        while True:
            try:
                self.items.put(obj, timeout=_POLL_S)
                if self.engine is not None:
                    self.engine.heartbeat = time.monotonic()
                return True
            except queue.Full:
                if self.stop.is_set():
                    return False

    def run(self) -> None:
        eng = self.engine
        try:
            enter_thread(self.device)       # before the first pull: the loader pins for it
            gb = -1
            while True:
                if self.fixed_G is not None:        # free-running: the next batch needs no request
                    gb, G = gb + 1, self.fixed_G
                elif self.predictor is not None:
                    gb, G = gb + 1, self.predictor()
                    if not _is_count(G):
                        raise ValueError(f"predict_microbatches returned {G!r} for global batch {gb}; "
                                         f"expected a positive int")
                else:
                    req = self._next_request()
                    if req is None:
                        return
                    gb, G = req
                prefetched = self.requested < gb
                plan = eng.start_batch(gb, G)
                plan.prefetched = prefetched
                for k in range(G):
                    if not self._put(eng.step(plan, k)):
                        return
        except BaseException as e:          # surfaces on the consumer's next next()
            self._put(_Failure(e))
        finally:
            self.engine = None              # drop source / buffers with the thread

    def _next_request(self):
        while not self.stop.is_set():
            try:
                return self.requests.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None


class BalancedDataIterator:
    """Iterator of micro-batches, balanced across the data-parallel group.

    Args:
        source: this rank's iterator of packs (one per micro-batch): nested
            dicts / lists / tuples of tensors and plain values. Read with ``next()``;
            an iterable without ``__next__`` is read through ``iter()``.
        num_microbatches: int, or zero-argument callable read at the start of
            every global batch (Megatron's ``get_num_microbatches``).
        group: the data-parallel group (default: world). Only its ranks are read;
            no collective is ever issued on it.
        cost_fn: ``pack -> number``; default :data:`~.costs.default_cost_fn`
            (image tokens). Rounded to int.
        exchange_group: dedicated gloo group over ``group``'s ranks. None: one is
            created with ``new_group``, which is collective over the WORLD: only
            safe when every world rank builds its iterator at the same time (a
            framework should pre-create them with :func:`new_exchange_groups`).
        node_ids: the node id of every global rank (index: global rank; what
            :func:`~.groups.gather_node_ids` returns, the same on every rank): moves prefer
            node-mates and the stats count what crosses nodes. None: found here (one
            all-gather) when the exchange group is created here, else unknown (no node
            figures; ``config.ranks_per_node``, when set, places ranks ``r // N`` instead).
        config: a :class:`~.config.BalancerConfig` (sync, overlap, timeout,
            device, enabled, balance_tolerance, shadow, stats_history).
        state_fn: zero-argument callable returning the source's checkpoint state
            (default: ``source.save_state`` when the source has one). Called once
            here and then by whichever thread pulls, right after each global
            batch; :meth:`save_state` returns the state paired with the last
            consumed batch.
        name: what distinguishes this iterator from others on the same exchange group
            (e.g. the model chunk), the same on every rank: the progress board's store keys
            are the group's name plus this, so every rank agrees on them whatever order
            iterators are built in.
        check_fn: ``pack -> None``, called on each pack as it is pulled, before it is
            costed; raising refuses the pack: every rank of the group stops at that global
            batch's agreement, before anything of it moves, this rank with the check's own
            error (which gains where: rank, batch, micro-step, the pack's sample keys) and
            its peers with a :class:`~.errors.PeerFailure` quoting it. For input that must
            never be balanced silently (metadata that contradicts the tensors, a pack longer
            than the sequence).
        first_iteration: the training iteration that consumes global batch 0 (a resumed
            job's next iteration), so that errors name it beside the global batch and
            ``MM_BALANCE_FAULT`` (:mod:`.faults`, a test hook) counts in it. None: errors
            name the global batch only.
        predict_microbatches: with a callable ``num_microbatches`` and
            ``overlap=True``: zero-argument callable giving the counts of the
            global batches in order, ahead of time (Megatron's ramp-up schedule
            run on a private calculator), so the thread can prefetch across
            batches; each prediction is checked against ``num_microbatches()``
            when the batch starts.
        describe: ``pack -> object``, read from every delivered pack while it is still on the
            host (on the exchange thread, before its copy to the device); the delivered pack's
            is :attr:`last_info`. For whatever must not read device tensors (the timing hooks'
            features).
        **settings: the same fields as keywords, a convenience that builds the
            config (``sync="step", overlap=False``); not together with ``config``.
    """

    def __init__(self, source, *, num_microbatches, group=None, cost_fn=None, exchange_group=None,
                 config: BalancerConfig | None = None, state_fn=None, predict_microbatches=None,
                 name: str = "", node_ids=None, check_fn=None, first_iteration: int | None = None,
                 describe=None, frames=None, **settings):
        if not (callable(num_microbatches) or _is_count(num_microbatches)):
            raise ValueError(f"num_microbatches must be a positive int or a callable, got {num_microbatches!r}")
        if predict_microbatches is not None and not (callable(predict_microbatches)
                                                     and callable(num_microbatches)):
            raise ValueError("predict_microbatches must be a callable, given with a callable "
                             "num_microbatches")
        if check_fn is not None and not callable(check_fn):
            raise TypeError(f"check_fn must be callable, got {check_fn!r}")
        if first_iteration is not None and (isinstance(first_iteration, bool)
                                            or not isinstance(first_iteration, int)):
            raise TypeError(f"first_iteration must be an int, got {first_iteration!r}")
        if config is None:
            config = BalancerConfig(**settings)
        elif settings:
            raise TypeError(f"pass either config or settings keywords, not both: {sorted(settings)}")
        self.config = config
        if state_fn is None:
            state_fn = getattr(source, "save_state", None)
            state_fn = state_fn if callable(state_fn) else None
        elif not callable(state_fn):
            raise TypeError(f"state_fn must be callable, got {state_fn!r}")
        self._state_fn = state_fn
        self._state = None                  # the state matching what was consumed so far
        # Read with next() (an object with only __next__ is enough, as for RerunDataIterator).
        self._source = source if hasattr(source, "__next__") else iter(source)
        self.device = None
        self._num_mb = num_microbatches
        self.enabled = bool(config.enabled)
        self.overlap = bool(config.overlap)
        self.timeout = float(config.timeout)
        self.stats: collections.deque = collections.deque(maxlen=int(config.stats_history))
        self._closed = False
        self._error: BaseException | None = None
        self._exhausted: StopIteration | None = None
        self._worker: _Worker | None = None
        self._engine: Engine | None = None
        self._owned_group = None
        self._board = None
        self._gb = -1
        self._G = 0
        self._k = 0
        self._staged = None                 # without the thread: the batch's exchanged items
        self._probe = None                  # MM_BALANCE_PROBE (runtime/probe.py): samples for a soak
        #: ``describe`` of the micro-batch delivered last (None without ``describe``)
        self.last_info = None
        #: images mode (:class:`~.frame_ahead.FrameAhead`): each item's frames go to its relay
        self._frames = frames if config.enabled else None
        self._wait_ms = self._wait_first_ms = 0.0
        if not self.enabled:
            return

        self.device = resolve_device(config.device)
        self._probe = probe.configured(dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
        if state_fn is not None:            # before batch 0; no thread touches the source yet
            self._state = state_fn()
        cost_fn = default_cost_fn if cost_fn is None else cost_fn
        if dist.is_available() and dist.is_initialized():
            ranks = group_ranks(group)
            me = dist.get_rank()
            if me not in ranks:
                raise ValueError(f"rank {me} is not in the data-parallel group {ranks}")
        else:
            if group is not None or exchange_group is not None:
                raise RuntimeError("a group was given but torch.distributed is not initialised")
            ranks, me = [0], 0
        board = None
        if len(ranks) > 1:
            if exchange_group is None:
                exchange_group = exchange_group_for(ranks, self.timeout)
                self._owned_group = exchange_group
                if node_ids is None:        # collective over the world, as new_group just was
                    node_ids = gather_node_ids()
            elif sorted(group_ranks(exchange_group)) != sorted(ranks):
                raise ValueError(f"exchange_group ranks {group_ranks(exchange_group)} differ from the "
                                 f"data-parallel group's {ranks}")
            board = ProgressBoard(board_prefix(exchange_group, ranks, name), ranks)
            board.clear(me)                 # this rank's posts of an earlier iterator of that name
        self._board = board
        self._engine = Engine(self._source, ranks=ranks, rank_index=ranks.index(me),
                              exchange_group=exchange_group, cost_fn=cost_fn,
                              cost_identity=cost_fn_identity(cost_fn), config=config,
                              device=self.device, board=board, state_fn=state_fn,
                              found_nodes=_group_nodes(node_ids, ranks), check_fn=check_fn,
                              first_iteration=first_iteration, describe=describe, frames=self._frames)
        if self.overlap:
            fixed = None if callable(self._num_mb) else int(self._num_mb)
            self._worker = _Worker(self._engine, fixed, predict_microbatches, thread_device(self.device))
            self._worker.thread.start()
        _LIVE.add(self)

    # -- iteration -------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self._closed:
            raise RuntimeError("BalancedDataIterator is closed")
        if not self.enabled:
            return next(self._source)
        if self._error is not None:
            raise BalancerError(f"the balanced iterator failed earlier ({self._batch_name()}): "
                                f"{self._error}", global_batch=self._gb) from self._error
        if self._exhausted is not None:
            raise StopIteration(*self._exhausted.args)
        t0 = time.perf_counter()
        with nvtx_range("mm-balance wait"):
            if self._k == self._G:                   # first micro-step of a new global batch
                self._start_batch()
            item = self._get_item()
        waited = (time.perf_counter() - t0) * 1e3
        self._wait_ms += waited
        if self._k == 0:
            self._wait_first_ms = waited
        if self._k == 0 and self._worker is not None and item.num_microbatches != self._G:
            self._fail(BalancerError(
                f"num_microbatches() is {self._G} at {self._batch_name()} but the exchange thread "
                f"prefetched it with {item.num_microbatches} micro-batches (predict_microbatches "
                f"disagrees with the training loop's schedule)", global_batch=self._gb))
        self._engine.transport.hand_over(item)
        self.last_info = item.info
        if self._frames is not None:
            self._frames.relay.put(item.frames)
        self._k += 1
        if item.last:
            self._finish_batch(item)
        return item.pack

    def _start_batch(self) -> None:
        G = self._num_mb() if callable(self._num_mb) else self._num_mb
        if not _is_count(G):
            raise ValueError(f"num_microbatches returned {G!r}; expected a positive int")
        self._gb += 1
        self._G, self._k, self._wait_ms = int(G), 0, 0.0
        if self._worker is not None:
            self._worker.requested = self._gb
            if self._worker.fixed_G is None and self._worker.predictor is None:
                self._worker.requests.put((self._gb, self._G))
        else:
            try:
                plan = self._engine.start_batch(self._gb, self._G)
                self._staged = collections.deque(self._engine.exchange_batch(plan))
            except BaseException as e:
                self._fail(e)

    def _get_item(self) -> Item:
        if self._worker is None:
            try:
                return self._engine.transport.placed(self._staged.popleft())
            except BaseException as e:
                self._fail(e)
        w = self._worker
        started = time.monotonic()
        while True:
            try:
                got = w.items.get(timeout=_POLL_S)
                break
            except queue.Empty:
                pass
            stalled = time.monotonic() - max(self._engine.heartbeat, started)
            if not w.thread.is_alive():
                self._fail(ExchangeThreadError(f"exchange thread exited without a result at "
                                               f"{self._batch_name()}", global_batch=self._gb))
            if stalled > self.timeout + max(2.0, 0.5 * self.timeout):
                self._fail(ExchangeThreadError(
                    f"exchange thread made no progress for {stalled:.0f}s at {self._batch_name()} "
                    f"while {self._engine.phase} (timeout={self.timeout:.0f}s)", global_batch=self._gb))
        if isinstance(got, _Failure):
            self._fail(got.exc)
        return got

    def _fail(self, exc: BaseException):
        """Record and raise: exhaustion as StopIteration, anything else as the error."""
        if isinstance(exc, SourceExhausted):
            self._exhausted = exc
            if exc.not_delivered:
                log.warning("mm-balance: %s", exc)
            raise StopIteration(*exc.args)
        if isinstance(exc, StopIteration):          # never leak a bare StopIteration from a bug
            exc = RuntimeError(f"unexpected StopIteration at {self._batch_name()}")
        self._error = exc
        raise exc

    def _finish_batch(self, item: Item) -> None:
        self.stats.append(item.batch.stats(consumer_wait_ms=self._wait_ms,
                                           consumer_wait_first_ms=self._wait_first_ms))
        if self._state_fn is not None:
            self._state = item.batch.state_after    # the state before the next global batch
        if self._probe is not None and self._probe.due(self._gb):
            self._probe.sample(self._gb, self.queue_depths(), self.pinned_pool())

    def queue_depths(self) -> dict:
        """What the exchange holds between its thread and the consumer: micro-batches ready
        (at most one), batch requests pending (callable ``num_microbatches``), batch records
        kept (``stats_history``)."""
        w = self._worker
        return {"ready": w.items.qsize() if w is not None else len(self._staged or ()),
                "requests": w.requests.qsize() if w is not None else 0, "stats": len(self.stats)}

    # -- checkpointing ------------------------------------------------------------
    @property
    def savable(self) -> bool:
        """Whether the source has a checkpoint state (``save_state`` or ``state_fn``)."""
        return self._state_fn is not None

    def save_state(self):
        """The source's state that matches exactly the micro-batches consumed so far.

        Call between global batches (where Megatron checkpoints): before the first
        one it is the state before any pull; after global batch ``b`` it is the
        state the source had right after batch ``b`` was pulled, whatever the
        exchange thread has read since; after the source ran out, the state
        before the batch that could not be filled. Restoring it and iterating a
        fresh iterator continues with the first global batch not consumed.
        Inside a global batch there is no such state (this rank's micro-batches
        came from several ranks' sources), so that raises.
        """
        if self._state_fn is None:
            raise TypeError("the data source has no save_state (pass state_fn to BalancedDataIterator)")
        if not self.enabled:
            return self._state_fn()                  # the consumer reads the source directly
        if 0 < self._k < self._G:
            raise BalancerError(
                f"save_state() inside {self._batch_name()}, after micro-step {self._k - 1} of "
                f"0..{self._G - 1}: no source state matches a partly consumed global batch; "
                f"save between global batches", global_batch=self._gb)
        return self._state

    # -- introspection ------------------------------------------------------------
    @property
    def last_stats(self) -> BatchStats | None:
        """The :class:`~.stats.BatchStats` of the last global batch delivered (None before)."""
        return self.stats[-1] if self.stats else None

    def pinned_pool(self):
        """The :class:`~.device.PoolStats` of the pinned host memory this iterator keeps
        (None without CUDA or when disabled)."""
        pool = self._engine.transport.pool if self._engine is not None else None
        return pool.stats() if pool is not None else None

    @property
    def exhaustion(self) -> SourceExhausted | None:
        """Why iteration stopped, once a source could not fill a global batch: the batch and
        the packs each rank had pulled for it, none of them delivered (None before)."""
        return self._exhausted

    @property
    def global_batch(self) -> int:
        """Index of the global batch being delivered (-1 before the first)."""
        return self._gb

    def _batch_name(self) -> str:
        """The current global batch as errors name it (with its iteration when known)."""
        eng = self._engine
        return eng.name_batch(self._gb) if eng is not None else f"global batch {self._gb}"

    def position(self) -> str:
        """Where delivery stands, in words, for a report when the process is stopped from
        outside: the global batch, the micro-steps delivered of it, and what the exchange
        (thread) was doing."""
        if not self.enabled or self._engine is None:
            return "balancing off" if not self.enabled else "closed"
        if self._gb < 0:
            return f"before the first global batch; exchange: {self._engine.phase}"
        return (f"{self._engine.name_batch(self._gb)}, {self._k} of {self._G} micro-steps delivered; "
                f"exchange: {self._engine.phase}")

    # -- shutdown -------------------------------------------------------------------
    def close(self, join_timeout: float | None = None, reason: str = "") -> None:
        """Stop and join the exchange thread, release the source and buffers.

        Safe to call twice. Closing mid-batch leaves peers that still expect this
        rank's packs to fail with a clear error within ``timeout``; the error
        names this rank as closed (and ``reason``, e.g. the exception that made
        a ``with`` block exit)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self._board is not None and self._engine is not None:
            me = self._engine.ranks[self._engine.me]
            self._board.post_error(me, f"closed its iterator at {self._batch_name()}"
                                   + (f" after {reason}" if reason else ""), overwrite=False)
        w, self._worker = self._worker, None
        thread_done = True
        if w is not None:
            w.stop.set()
            w.requests.put(None)
            w.thread.join(self.timeout + 5.0 if join_timeout is None else join_timeout)
            thread_done = not w.thread.is_alive()
            if thread_done:
                _drain(w.items)
            else:
                log.warning("mm-balance: exchange thread still blocked after close(); abandoned "
                            "(it ends when its pending wait times out)")
        if self._owned_group is not None and thread_done:   # never under a thread still using it
            try:
                dist.destroy_process_group(self._owned_group)
            except Exception:
                pass
        self._owned_group = None
        self._engine = None
        self._staged = None
        self._source = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(reason=f"{exc_type.__name__}: {exc}" if exc_type is not None else "")
        return False

    def __del__(self):
        try:
            self.close(join_timeout=1.0)
        except Exception:
            pass


def _group_nodes(node_ids, ranks):
    """The node id of each of ``ranks`` from every global rank's ``node_ids`` (None: unknown)."""
    if node_ids is None:
        return None
    if max(ranks) >= len(node_ids):
        raise ValueError(f"node_ids has {len(node_ids)} entries (one per global rank), the group "
                         f"holds rank {max(ranks)}")
    return tuple(int(node_ids[r]) for r in ranks)


def board_prefix(exchange_group, ranks, name: str = "") -> str:
    """The progress board's store prefix: the exchange group's name (``new_group`` names
    groups in creation order, which is the same on every rank) or, without one, its
    ranks; then the caller's ``name``. Derived only from what every rank agrees on."""
    group = getattr(exchange_group, "group_name", None) or ",".join(map(str, ranks))
    return f"mm_balance/{group}" + (f"/{name}" if name else "")


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


@atexit.register
def _close_all() -> None:
    for it in list(_LIVE):
        try:
            it.close(join_timeout=2.0)
        except Exception:
            pass
