"""``wrap_train_data_iterator``: the one call the training.py patch makes.

Megatron's contracts, and how the wrapper keeps them:

* Megatron gets back a ``RerunDataIterator`` (rewind/replay for the rerun state
  machine keep working) around a :class:`BalancedTrainIterable`, which yields
  the balanced micro-batches; ``None`` (ranks without data) stays ``None``; a
  list (virtual pipeline, one iterator per model chunk) stays a list.
* Each global batch is exactly ``get_num_microbatches()`` items, read at the
  first micro-batch of every global batch (batch-size ramp-up works).
* The same multiset of micro-batches is consumed per step, so
  ``consumed_train_samples`` is untouched.
* ``train_iterator.iterable.save_state()`` (energon's dataloader checkpoint,
  which ``maybe_save_dataloader_state`` calls) is still there and exact: the
  exchange thread reads ahead into the next global batch, but it calls the
  loader's ``save_state`` itself right after pulling each batch and the
  balancer returns the state paired with the last batch the training loop
  consumed (see :meth:`~megatron_mm_balance.runtime.BalancedDataIterator.save_state`).

Only ranks that read data are wrapped: first/last pipeline stage, tensor rank 0
(see :mod:`.groups`); other ranks' iterators are returned unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .checks import checked_config
from .config import MMBalanceConfig, live_iteration
from .sampler import installed_train_samplers
from .schedule import MicrobatchSchedule


class BalancedTrainIterable:
    """What Megatron's ``RerunDataIterator`` wraps, in either mode: the balanced
    micro-batches, telemetry at the start of each global batch, and ``save_state``.

    ``items``: the micro-batches (the exchange's balancer, or the loader a balanced
    sampler feeds); ``global_batch_of()``: the global batch of the item just
    delivered (0-based); ``stats``: the object whose ``.stats`` records the batches.

    ``save_state()`` returns the loader state that matches the global batches the
    training loop has consumed: the balancer's paired state (captured by the
    exchange thread, the only reader of the loader, right after each pull) when
    it has one, else the loader's own. It exists only when the loader has
    ``save_state``; called inside a global batch it raises (Megatron checkpoints
    between steps).
    """

    def __init__(self, items, source, *, global_batch_of: Callable[[], int], stats, telemetry=None,
                 recorder=None, reporter=None, timing=None, chunk: int = 0):
        self.items = items
        #: the per-pack timing recorder, told each micro-batch's features from its host copy
        #: (:meth:`~.timing.TimingRecorder.expect`), and this iterator's model chunk
        self._timing = timing
        self._chunk = chunk
        self.source = source
        self._global_batch_of = global_batch_of
        self._stats = stats
        self._telemetry = telemetry
        self._recorder = recorder          # --mm-balance-record-samples
        self._reporter = reporter          # a .stops.StopReporter: one line when training stops
        self._batch = -1
        self.delivered = 0
        if reporter is not None:
            reporter.watch(self)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            item = next(self.items)
        except Exception as exc:           # a peer lost, bad input, the data ran out, ...
            if self._reporter is not None:
                self._reporter.error(exc)
            raise
        self.delivered += 1
        gb = self._global_batch_of()
        if gb != self._batch:
            self._batch = gb
            if self._telemetry is not None:
                self._telemetry.on_batch(gb)
        if self._recorder is not None:
            self._recorder.record(item)
        if self._timing is not None:
            balancer = self.balancer
            self._timing.expect(balancer.last_info if balancer is not None else
                                _host_features(self._timing, item), self._chunk)
        return item

    @property
    def save_state(self) -> Callable[[], Any]:
        """The balancer's paired ``save_state`` (absent, as on the loader, if it has none)."""
        if getattr(self.items, "savable", False):
            return self.items.save_state
        fn = getattr(self.source, "save_state", None)
        if not callable(fn):
            raise AttributeError(f"{type(self.source).__name__} has no save_state")
        return fn

    def position(self) -> str:
        """Where delivery stands (for the SIGTERM report of :mod:`.stops`)."""
        if self.balancer is not None:
            return self.balancer.position()
        return f"sampler mode, {self.delivered} micro-batches delivered"

    @property
    def balancer(self):
        """The exchange's ``BalancedDataIterator`` (None in sampler mode)."""
        return None if self.items is self.source else self.items

    @property
    def stats(self):
        return self._stats.stats

    def close(self) -> None:
        if self.balancer is not None:
            self.balancer.close()


def _host_features(timing, item):
    """The timing features of a micro-batch still on the host (None without a reader)."""
    return timing.host_features(item) if timing.host_features is not None else None


class TimingTap:
    """Balancing off, timing on: hands each micro-batch's features, read from the host copy
    the loader gives, to the timing recorder (:meth:`~.timing.TimingRecorder.expect`);
    otherwise a pass-through that keeps ``save_state`` and the rest of the loader."""

    def __init__(self, source, timing, chunk: int = 0):
        self.source = source
        self._it = source if hasattr(source, "__next__") else iter(source)
        self.timing = timing
        self.chunk = chunk

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        self.timing.expect(_host_features(self.timing, item), self.chunk)
        return item

    def __getattr__(self, name):          # save_state and anything else the loader offers
        if name in ("source", "_it", "timing", "chunk"):
            raise AttributeError(name)
        return getattr(self.source, name)


def make_cost_fn(cfg: MMBalanceConfig):
    """The cost function ``--mm-balance-cost`` asks for (see :mod:`megatron_mm_balance.cost.pack`),
    with the config's tokens per tile (the multimodal flags', else the runtime's default).
    Ranks meeting every micro-step (``microstep`` sync) balance the vision and the language
    phase of a calibrated model separately; otherwise only the total counts."""
    from ..cost.pack import ImageTokenCost, ModelCost
    if cfg.cost == "auto":
        raise ValueError("--mm-balance-cost auto has no fixed cost function: each exchange group "
                         "fits its own (megatron.timing.auto_cost_fn)")
    if cfg.cost == "model":
        return ModelCost(cfg.cost_file, cfg.tokens_per_tile, phases=cfg.sync == "microstep")
    return ImageTokenCost(cfg.tokens_per_tile)


def make_pack_check(cfg: MMBalanceConfig, model=None):
    """The pack check every pulled pack passes before it is costed (bad input is refused
    before anything moves, :mod:`megatron_mm_balance.cost.pack_check`): packed samples no
    longer than the language model's sequence length and, for examples/multimodal models,
    image metadata that agrees with the tensors, placeholders counted with the model's own
    ``image_token_index`` (found on the model chunks; not counted without a model)."""
    from ..cost.pack_check import PackCheck
    return PackCheck(max_length=cfg.megatron.decoder_seq_length, image_token_id=_image_token_index(model))


def _image_token_index(model) -> Optional[int]:
    """The image placeholder's token id the model splits images by (LLaVA's
    ``image_token_index``), from the first module of the chunks that has one; None if none."""
    for chunk in (model if isinstance(model, (list, tuple)) else [model]) if model is not None else []:
        for module in getattr(chunk, "modules", lambda: [])():
            index = getattr(module, "image_token_index", None)
            if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
                return index
    return None


def _unwrap(iterator):
    """The loader inside Megatron's ``RerunDataIterator`` (anything else as it is)."""
    from megatron.core.rerun_state_machine import RerunDataIterator
    return iterator.iterable if isinstance(iterator, RerunDataIterator) else iterator


def _schedule_for(cfg: MMBalanceConfig, num_microbatches):
    """What the balancer reads its micro-batch count from, one per chunk.

    A fixed int lets the exchange thread run ahead into the next global batch, so
    that batch's pull, all-gather, solve and first exchange also hide behind
    compute. That stays exact for checkpoints either way: Megatron's own samplers
    resume from ``consumed_train_samples`` (a global batch read ahead but not
    trained on is simply read again), and a loader with ``save_state`` (energon)
    is checkpointed through the balancer's paired state. Under
    ``--rampup-batch-size`` (``--step-batch-size-schedule``), where the count
    changes between batches, the balancer gets a callable read when training
    starts each global batch, and :func:`_predictor_for` lets the thread run
    ahead on predicted counts, each checked against that callable.
    """
    if num_microbatches is None:
        if not cfg.schedule.variable:
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            return int(get_num_microbatches())
        return MicrobatchSchedule(cfg.schedule)
    if callable(num_microbatches):
        return num_microbatches
    return int(num_microbatches)


def _predictor_for(cfg: MMBalanceConfig, num_microbatches):
    """Under batch-size ramp-up (and no explicit count): a :class:`MicrobatchSchedule` with
    ``predict=True``, Megatron's calculator run privately on the samples the global batches
    handed out so far consume (from ``consumed_train_samples`` when the config was built, so
    a resumed run predicts from where it is). The exchange thread prefetches on it; the
    balancer checks each prediction against ``get_num_microbatches()`` when the loop starts
    the batch and fails with both counts named if they differ. None otherwise."""
    if num_microbatches is None and cfg.schedule.variable:
        return MicrobatchSchedule(cfg.schedule, predict=True)
    return None


class Coordinator:
    """How one run balances its train iterators: one object per mode, chosen once.

    :meth:`wrap` takes one model chunk's loader (already out of its
    ``RerunDataIterator``) and its exchange group, and returns what Megatron
    iterates: a ``RerunDataIterator`` around a :class:`BalancedTrainIterable`, which
    reports through :class:`~.telemetry.Telemetry` from the object that records the
    global batches (``.stats``: one :class:`~megatron_mm_balance.runtime.stats.BatchStats`
    per global batch, from the same planner in every mode).
    """

    mode = ""

    def __init__(self, cfg: MMBalanceConfig):
        self.cfg = cfg

    def wrap(self, source, group, chunk: int, recorder=None, node_ids=None, reporter=None, frames=None):
        """``recorder``: the chunk's :class:`~.samples.SampleRecorder` (``--mm-balance-record-samples``);
        ``node_ids``: every global rank's node id (:attr:`~.groups.ExchangeGroups.node_ids`);
        ``reporter``: the rank's :class:`~.stops.StopReporter`; ``frames``: images mode's
        exchange-thread side for this chunk (:class:`~megatron_mm_balance.runtime.frame_ahead.FrameAhead`)."""
        raise NotImplementedError

    def _telemetry(self, stats_source, group, chunk):
        from .telemetry import Telemetry
        return Telemetry.for_config(stats_source, self.cfg, group=group, chunk=chunk)


class ExchangeCoordinator(Coordinator):
    """Exchange (shadow, control) mode: a :class:`~megatron_mm_balance.runtime.BalancedDataIterator`
    per chunk moves packed micro-batches between ranks (shadow: plans, logs, moves nothing;
    control: every rank its own packs, reordered across micro-steps; crossover: the exchange at
    iterations of one parity, shadow at the others)."""

    def __init__(self, cfg: MMBalanceConfig, *, cost_fn=None, num_microbatches=None, timing=None,
                 auto_features=None, check_fn=None):
        super().__init__(cfg)
        self.check_fn = check_fn        # every pulled pack, before it is costed (make_pack_check)
        self.mode = cfg.mode if cfg.mode in ("shadow", "control") else "exchange"
        self.timing = timing            # the per-pack timings (``--mm-balance-cost auto`` fits them)
        self.auto_features = auto_features   # what the auto fit reads (None: the tiles' features)
        if cost_fn is None and cfg.cost != "auto":
            cost_fn = make_cost_fn(cfg)
        self.cost_fn = cost_fn          # None: auto, one per exchange group (it agrees on the group)
        self.num_microbatches = num_microbatches

    def wrap(self, source, group, chunk: int, recorder=None, node_ids=None, reporter=None, frames=None):
        from megatron.core.rerun_state_machine import RerunDataIterator
        from ..runtime import BalancedDataIterator

        state_fn = getattr(source, "save_state", None)     # energon: called by the exchange thread
        cost_fn = self.cost_fn
        if cost_fn is None:
            from .timing import auto_cost_fn
            cost_fn = auto_cost_fn(self.cfg, self.timing, group, features=self.auto_features)
        # On a GPU packs arrive on the device, copied on the exchange's side stream
        # (BalancerConfig.device "auto"); get_batch's own .cuda() finds them there.
        timing = self.timing
        balanced = BalancedDataIterator(source, num_microbatches=_schedule_for(self.cfg, self.num_microbatches),
                                        group=group, exchange_group=group, cost_fn=cost_fn,
                                        config=self.cfg.runtime(),
                                        state_fn=state_fn if callable(state_fn) else None,
                                        predict_microbatches=_predictor_for(self.cfg, self.num_microbatches),
                                        name=f"chunk{chunk}", node_ids=node_ids, check_fn=self.check_fn,
                                        first_iteration=self.cfg.megatron.start_iteration + 1,
                                        describe=timing.host_features if timing is not None else None, frames=frames)
        return RerunDataIterator(BalancedTrainIterable(
            balanced, source, global_batch_of=lambda: balanced.global_batch, stats=balanced,
            telemetry=self._telemetry(balanced, group, chunk), recorder=recorder, reporter=reporter,
            timing=timing, chunk=chunk))


class SamplerCoordinator(Coordinator):
    """Sampler mode: indices were reassigned before loading (:mod:`.sampler`, through the
    same planner); nothing to exchange, only the samplers' statistics to report.

    ``samplers``: the run's balanced train samplers in the order their loaders were built
    (model chunk order); a chunk without one of its own reports the last one's."""

    mode = "sampler"

    def __init__(self, cfg: MMBalanceConfig, samplers):
        super().__init__(cfg)
        if not samplers:
            raise ValueError("sampler mode needs at least one installed balanced sampler")
        self.samplers = list(samplers)

    def wrap(self, source, group, chunk: int, recorder=None, node_ids=None, reporter=None, frames=None):
        from megatron.core.rerun_state_machine import RerunDataIterator
        if frames is not None:
            raise ValueError("images mode needs the exchange: sampler mode has no exchange thread")
        sampler = self.samplers[min(chunk, len(self.samplers) - 1)]
        position = sampler.consumer_position()
        return RerunDataIterator(BalancedTrainIterable(
            source, source, global_batch_of=position.advance, stats=sampler,
            telemetry=self._telemetry(sampler, group, chunk), recorder=recorder, reporter=reporter))


def coordinator_for(cfg: MMBalanceConfig, samplers=(), *, cost_fn=None,
                    num_microbatches=None, timing=None, check_fn=None) -> Coordinator:
    """Sampler mode when :func:`~.sampler.maybe_balanced_sampler` installed balanced
    ``samplers`` for this run (it runs first, when the loaders are built), else the exchange
    (``timing``: the per-pack timings that ``--mm-balance-cost auto`` fits; ``check_fn``: the
    pack check, :func:`make_pack_check`)."""
    if samplers:
        return SamplerCoordinator(cfg, samplers)
    return ExchangeCoordinator(cfg, cost_fn=cost_fn, num_microbatches=num_microbatches, timing=timing,
                               check_fn=check_fn)


def _install_timing(model, cfg: MMBalanceConfig, args):
    """``--mm-balance-timing`` (``-dir``, or ``--mm-balance-cost auto``): the timing hooks on
    ``model``'s chunks, on every rank; None when not asked for or without a model. The
    recorder reads Megatron's live ``args.curr_iteration`` to label each micro-batch."""
    if model is None or not cfg.timing:
        return None
    from .timing import install_timing
    return install_timing(model, out_dir=cfg.timing_dir, interval=cfg.log_interval,
                          iteration_fn=live_iteration(args), files=cfg.timing_files,
                          every=cfg.timing_every)


def _install_vision_balance(model, cfg: MMBalanceConfig, exchange_groups):
    """``--mm-balance-vision images`` (:func:`~.vision.vision_balance_for`): its communicators
    (collective over the world: every rank, here) and, under expert parallelism, its hooks on
    this rank's vision encoder; ``(frame_ahead, chunk, hooks)`` or None."""
    if cfg.vision != "images":
        return None
    from .vision import vision_balance_for
    return vision_balance_for(model, cfg, exchange_groups)


def wrap_train_data_iterator(train_data_iterator, args=None, *, exchange_groups=None,
                             num_microbatches=None, cost_fn=None, layout=None, model=None):
    """Wrap Megatron's train iterator(s) for ``--mm-balance``; a no-op when the flag is off.

    Accepts what ``build_train_valid_test_data_iterators`` returns: a
    ``RerunDataIterator``, a plain iterator, ``None``, or a list of these (virtual
    pipeline, one per model chunk). Returns the same shape.

    ``args`` is read once, by :func:`~.checks.checked_config`; everything below takes the
    config. ``exchange_groups``: the :class:`~.groups.ExchangeGroups` to balance on, one
    group per model chunk; None creates them here with :func:`~.groups.init_exchange_groups`
    (from ``layout``), which is collective over the world: then call this on **every**
    rank at the same point (the training.py patch does). Keyword overrides for harnesses
    not running Megatron's ``pretrain``: ``num_microbatches`` (int or zero-arg callable,
    default :class:`MicrobatchSchedule`), ``cost_fn`` (default :func:`make_cost_fn`),
    ``layout`` (this rank's :class:`~.groups.RankLayout`, or the same as a
    ``{"holds_data", "dp_ranks"}`` dict; default from ``megatron.core.parallel_state``),
    ``model`` (the model chunks, for the per-pack timing hooks of ``--mm-balance-timing`` and
    ``--mm-balance-cost auto``, which are installed here, with ``--mm-balance`` off too).
    """
    if args is None:
        from megatron.training import get_args
        args = get_args()
    cfg = checked_config(args)
    from ..runtime.dist_audit import install_from_env
    audit = install_from_env()          # MM_BALANCE_DIST_AUDIT (a test hook): calls counted by stack
    timing = _install_timing(model, cfg, args)
    if not cfg.enabled:
        if cfg.record_samples or timing is not None:
            return _passed_through(train_data_iterator, cfg, args, timing)
        return train_data_iterator
    agree_on_code("megatron-lm", cfg.timeout)
    is_list = isinstance(train_data_iterator, list)
    iterators = train_data_iterator if is_list else [train_data_iterator]
    if exchange_groups is None:
        from .groups import init_exchange_groups
        exchange_groups = init_exchange_groups(layout, num_chunks=len(iterators), timeout=cfg.timeout)
    elif len(exchange_groups) != len(iterators):
        raise ValueError(f"exchange_groups has {len(exchange_groups)} model chunks, the train "
                         f"iterators {len(iterators)}")
    cfg = with_job_meetings(cfg, exchange_groups)
    coordinator = coordinator_for(cfg, installed_train_samplers(args), cost_fn=cost_fn,
                                  num_microbatches=num_microbatches, timing=timing,
                                  check_fn=make_pack_check(cfg, model))
    vision = _install_vision_balance(model, cfg, exchange_groups)
    from .stops import StopReporter
    reporter = StopReporter(live_iteration(args))
    wrapped = [it if it is None or group is None
               else coordinator.wrap(_unwrap(it), group, chunk, _recorder(cfg, args, chunk),
                                     node_ids=getattr(exchange_groups, "node_ids", None), reporter=reporter,
                                     frames=vision[0] if vision is not None and vision[1] == chunk else None)
               for chunk, (it, group) in enumerate(zip(iterators, exchange_groups))]
    if vision is not None and (vision[1] >= len(iterators) or iterators[vision[1]] is None):
        raise RuntimeError("--mm-balance-vision images: the model chunk with the vision encoder has no train "
                           "iterator on this rank")
    if audit is not None:
        audit.training()
    return wrapped if is_list else wrapped[0]


def with_job_meetings(cfg: MMBalanceConfig, exchange_groups) -> MMBalanceConfig:
    """``cfg`` with the meeting groups read from the job when the exchange groups were made
    (:attr:`~.groups.ExchangeGroups.meetings`: ``auto`` sync follows them), and their one log
    line (:meth:`~.config.MMBalanceConfig.meeting_line`), written by the lowest rank of each
    exchange group."""
    cfg = cfg.with_meetings(getattr(exchange_groups, "meetings", None))
    first = next((g for g in exchange_groups if g is not None), None)
    if first is not None and _lowest_rank_of(first):
        from ..runtime.log_line import emit_line
        emit_line(cfg.meeting_line())
    return cfg


def _lowest_rank_of(group) -> bool:
    import torch.distributed as dist
    return dist.get_rank() == min(dist.get_process_group_ranks(group))


def agree_on_code(product: str, timeout_s: float) -> None:
    """Every rank of a balanced job runs the same hooks and package (:mod:`..patching.digest`):
    compared once here, before anything is exchanged; a rank that differs stops the job with one
    line. Skipped without a process group or with one rank."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    from ..patching.digest import agree_on_code as agree
    agree(product, timeout_s=timeout_s)


def _recorder(cfg: MMBalanceConfig, args, chunk: int):
    """This rank's :class:`~.samples.SampleRecorder` when ``--mm-balance-record-samples`` is set
    (it reads Megatron's live ``args.curr_iteration`` at each micro-batch)."""
    if not cfg.record_samples:
        return None
    from .samples import SampleRecorder
    return SampleRecorder(cfg.record_samples, iteration_fn=live_iteration(args),
                          job_start=cfg.megatron.start_iteration, chunk=chunk)


def tap_timing(train_data_iterator, timing):
    """Balancing off, timing on (Bridge's glue): each iterator's loader behind a
    :class:`TimingTap` in a ``RerunDataIterator``; unchanged when ``timing`` is None."""
    from megatron.core.rerun_state_machine import RerunDataIterator
    if timing is None:
        return train_data_iterator
    is_list = isinstance(train_data_iterator, list)
    iterators = train_data_iterator if is_list else [train_data_iterator]
    wrapped = [None if it is None else RerunDataIterator(TimingTap(_unwrap(it), timing, chunk))
               for chunk, it in enumerate(iterators)]
    return wrapped if is_list else wrapped[0]


def _passed_through(train_data_iterator, cfg: MMBalanceConfig, args, timing=None):
    """Balancing off, recording or timing on: each iterator's loader behind pass-throughs that
    record its micro-batches (``--mm-balance-record-samples``) and hand their host features to
    the timing hooks (:class:`TimingTap`), still in a ``RerunDataIterator`` (no collectives,
    nothing else changes)."""
    from megatron.core.rerun_state_machine import RerunDataIterator
    from .samples import RecordingIterable
    is_list = isinstance(train_data_iterator, list)
    iterators = train_data_iterator if is_list else [train_data_iterator]
    wrapped = []
    for chunk, it in enumerate(iterators):
        if it is None:
            wrapped.append(None)
            continue
        inner = _unwrap(it)
        if timing is not None:
            inner = TimingTap(inner, timing, chunk)
        if cfg.record_samples:
            inner = RecordingIterable(inner, _recorder(cfg, args, chunk))
        wrapped.append(RerunDataIterator(inner))
    return wrapped if is_list else wrapped[0]


def balancers(train_data_iterator) -> list:
    """The ``BalancedDataIterator`` objects inside a wrapped iterator (or list); for stats."""
    its = train_data_iterator if isinstance(train_data_iterator, list) else [train_data_iterator]
    out = []
    for it in its:
        inner = getattr(it, "iterable", None)
        if isinstance(inner, BalancedTrainIterable) and inner.balancer is not None:
            out.append(inner.balancer)
    return out
