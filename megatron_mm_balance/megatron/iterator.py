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
from .config import MMBalanceConfig
from .sampler import installed_train_sampler
from .schedule import MicrobatchSchedule, variable_batch_size


class BalancedTrainIterable:
    """What Megatron's ``RerunDataIterator`` wraps: balanced micro-batches plus ``save_state``.

    ``save_state()`` returns the loader state that matches the global batches the
    training loop has consumed: the balancer's paired state (captured by the
    exchange thread, the only reader of the loader, right after each pull), not
    the loader's current position, which may be a global batch ahead. It exists
    only when the loader has ``save_state``; called inside a global batch it
    raises (Megatron checkpoints between steps).
    """

    def __init__(self, balanced, source, telemetry=None):
        self.balancer = balanced
        self.source = source
        self._telemetry = telemetry
        self.delivered = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.balancer)
        self.delivered += 1
        if self._telemetry is not None:
            self._telemetry.on_item()
        return item

    @property
    def save_state(self) -> Callable[[], Any]:
        """The balancer's paired ``save_state`` (absent, as on the loader, if it has none)."""
        if getattr(self.balancer, "savable", False):
            return self.balancer.save_state
        fn = getattr(self.source, "save_state", None)
        if not callable(fn):
            raise AttributeError(f"{type(self.source).__name__} has no save_state")
        return fn

    @property
    def stats(self):
        return self.balancer.stats

    def close(self) -> None:
        self.balancer.close()


def _tokens_per_tile(args) -> Optional[int]:
    """Image embeddings per tile for examples/multimodal arguments (None if not a VLM run)."""
    if args is None or getattr(args, "img_h", None) is None:
        return None
    from megatron.core.models.vision.clip_vit_model import get_num_image_embeddings
    return int(get_num_image_embeddings(
        args.img_h, args.img_w, args.patch_dim, args.vision_model_type,
        args.disable_vision_class_token, 1, getattr(args, "pixel_shuffle", False),
        getattr(args, "use_tile_tags", False), getattr(args, "max_num_tiles", 1),
        getattr(args, "tokenizer_prompt_format", None)))


def make_cost_fn(args=None):
    """The cost function ``--mm-balance-cost`` asks for (see :mod:`..runtime.costs`).

    Tokens per tile follow the multimodal flags; without them (not an
    examples/multimodal run) the runtime's default applies.
    """
    from ..cost.pack import DEFAULT_TOKENS_PER_TILE, ImageTokenCost, ModelCost
    tpt = _tokens_per_tile(args)
    tpt = DEFAULT_TOKENS_PER_TILE if tpt is None else tpt
    if getattr(args, "mm_balance_cost", "image-tokens") == "model":
        # Ranks meeting every micro-step (expert parallel) balance the vision and the
        # language phase separately; otherwise only the total counts.
        from .config import resolve_sync
        return ModelCost(args.mm_balance_cost_file, tpt,
                         phases=resolve_sync(args) == "microstep")
    return ImageTokenCost(tpt)


class _NextOnly:
    """Makes an object with only ``__next__`` (enough for ``RerunDataIterator``) iterable."""

    def __init__(self, obj):
        self.obj = obj

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.obj)


def _unwrap(iterator):
    """The loader inside Megatron's ``RerunDataIterator`` (anything else as it is)."""
    from megatron.core.rerun_state_machine import RerunDataIterator
    return iterator.iterable if isinstance(iterator, RerunDataIterator) else iterator


def _schedule_for(args, num_microbatches):
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
        if not variable_batch_size(args):
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            return int(get_num_microbatches())
        return MicrobatchSchedule(args)
    if callable(num_microbatches):
        return num_microbatches
    return int(num_microbatches)


def _predictor_for(args, num_microbatches):
    """Under batch-size ramp-up (and no explicit count): a :class:`MicrobatchSchedule` with
    ``predict=True``, Megatron's calculator run privately on the samples the global batches
    handed out so far consume (from ``consumed_train_samples`` at wrap time, so a resumed
    run predicts from where it is). The exchange thread prefetches on it; the balancer
    checks each prediction against ``get_num_microbatches()`` when the loop starts the
    batch and fails with both counts named if they differ. None otherwise."""
    if num_microbatches is None and variable_batch_size(args):
        return MicrobatchSchedule(args, predict=True)
    return None


class Coordinator:
    """How one run balances its train iterators: one object per mode, chosen once.

    :meth:`wrap` takes one model chunk's loader (already out of its
    ``RerunDataIterator``) and its exchange group, and returns what Megatron
    iterates. Both implementations report through :class:`~.telemetry.Telemetry`
    from an object with ``.stats`` (one record per global batch).
    """

    mode = ""

    def __init__(self, cfg: MMBalanceConfig, args):
        self.cfg = cfg
        self.args = args

    def wrap(self, source, group, chunk: int):
        raise NotImplementedError

    def _telemetry(self, stats_source, group, chunk):
        from .telemetry import Telemetry
        return Telemetry(stats_source, self.args, interval=self.cfg.log_interval, group=group,
                         chunk=chunk)


class ExchangeCoordinator(Coordinator):
    """Exchange (and shadow) mode: a :class:`~megatron_mm_balance.runtime.BalancedDataIterator`
    per chunk moves packed micro-batches between ranks (shadow: solves, logs, moves nothing)."""

    def __init__(self, cfg, args, *, cost_fn=None, num_microbatches=None, timing=None):
        super().__init__(cfg, args)
        self.mode = cfg.mode if cfg.mode == "shadow" else "exchange"
        self.timing = timing            # the per-pack timings (``--mm-balance-cost auto`` fits them)
        if cost_fn is None and cfg.cost != "auto":
            cost_fn = make_cost_fn(args)
        self.cost_fn = cost_fn          # None: auto, one per exchange group (it agrees on the group)
        self.num_microbatches = num_microbatches

    def wrap(self, source, group, chunk: int):
        from megatron.core.rerun_state_machine import RerunDataIterator
        from ..runtime import BalancedDataIterator

        schedule = _schedule_for(self.args, self.num_microbatches)
        state_fn = getattr(source, "save_state", None)     # energon: called by the exchange thread
        if not hasattr(source, "__next__"):
            source = iter(source)
        reader = source if hasattr(source, "__iter__") else _NextOnly(source)
        cost_fn = self.cost_fn
        if cost_fn is None:
            from ..cost.pack import DEFAULT_TOKENS_PER_TILE
            from .timing import auto_cost_fn
            tpt = _tokens_per_tile(self.args)
            cost_fn = auto_cost_fn(self.cfg, self.args, self.timing, group,
                                   DEFAULT_TOKENS_PER_TILE if tpt is None else tpt)
        # Packs stay where the loader put them (device None); get_batch moves them.
        balanced = BalancedDataIterator(reader, num_microbatches=schedule, group=group,
                                        exchange_group=group, cost_fn=cost_fn,
                                        config=self.cfg.runtime(),
                                        state_fn=state_fn if callable(state_fn) else None,
                                        predict_microbatches=_predictor_for(self.args,
                                                                            self.num_microbatches))
        telemetry = self._telemetry(balanced, group, chunk)
        return RerunDataIterator(BalancedTrainIterable(balanced, source, telemetry))


class _Reporting:
    """Pass-through iterable that drives telemetry (sampler mode); keeps ``save_state``."""

    def __init__(self, source, telemetry):
        self.source = source
        self._telemetry = telemetry

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.source)
        self._telemetry.on_item()
        return item

    def __getattr__(self, name):          # save_state and anything else the loader offers
        return getattr(self.source, name)


class SamplerCoordinator(Coordinator):
    """Sampler mode: indices were reassigned before loading (:mod:`.sampler`); nothing to
    exchange, only the sampler's statistics to report."""

    mode = "sampler"

    def __init__(self, cfg, args, sampler):
        super().__init__(cfg, args)
        self.sampler = sampler

    def wrap(self, source, group, chunk: int):
        from megatron.core.rerun_state_machine import RerunDataIterator
        return RerunDataIterator(_Reporting(source, self._telemetry(self.sampler, group, chunk)))


def coordinator_for(cfg: MMBalanceConfig, args, *, cost_fn=None, num_microbatches=None,
                    timing=None) -> Coordinator:
    """Sampler mode when :func:`~.sampler.maybe_balanced_sampler` installed a sampler for
    ``args`` (it runs first, when the loaders are built), else the exchange."""
    sampler = installed_train_sampler(args)
    if sampler is not None:
        return SamplerCoordinator(cfg, args, sampler)
    return ExchangeCoordinator(cfg, args, cost_fn=cost_fn, num_microbatches=num_microbatches,
                               timing=timing)


def _install_timing(model, args):
    """``--mm-balance-timing`` (``-dir``, or ``--mm-balance-cost auto``): the timing hooks on
    ``model``'s chunks, on every rank; None when not asked for or without a model."""
    from .config import log_interval, wants_timing
    if model is None or not wants_timing(args):
        return None
    from .timing import install_timing
    return install_timing(model, out_dir=getattr(args, "mm_balance_timing_dir", None),
                          interval=log_interval(args), args=args)


def wrap_train_data_iterator(train_data_iterator, args=None, *, num_microbatches=None,
                             cost_fn=None, layout=None, model=None):
    """Wrap Megatron's train iterator(s) for ``--mm-balance``; a no-op when the flag is off.

    Call on **every** rank at the same point (it creates the exchange groups,
    collectively over the world). Accepts what ``build_train_valid_test_data_iterators``
    returns: a ``RerunDataIterator``, a plain iterator, ``None``, or a list of
    these (virtual pipeline). Returns the same shape.

    Keyword overrides (for harnesses not running Megatron's ``pretrain``):
    ``num_microbatches`` (int or zero-arg callable, default :class:`MicrobatchSchedule`),
    ``cost_fn`` (default :func:`make_cost_fn`), ``layout`` (this rank's
    :class:`~.groups.RankLayout`, or the same as a ``{"holds_data", "dp_ranks"}`` dict;
    default from ``megatron.core.parallel_state``), ``model`` (the model chunks, for the
    per-pack timing hooks of ``--mm-balance-timing`` and ``--mm-balance-cost auto``, which
    are installed here, with ``--mm-balance`` off too).
    """
    if args is None:
        from megatron.training import get_args
        args = get_args()
    timing = _install_timing(model, args)
    if not getattr(args, "mm_balance", False):
        return train_data_iterator
    from .groups import init_exchange_groups

    cfg = checked_config(args)
    is_list = isinstance(train_data_iterator, list)
    iterators = train_data_iterator if is_list else [train_data_iterator]
    groups = init_exchange_groups(layout, num_chunks=len(iterators), timeout=cfg.timeout)
    coordinator = coordinator_for(cfg, args, cost_fn=cost_fn, num_microbatches=num_microbatches,
                                  timing=timing)
    wrapped = [it if it is None or group is None else coordinator.wrap(_unwrap(it), group, chunk)
               for chunk, (it, group) in enumerate(zip(iterators, groups))]
    return wrapped if is_list else wrapped[0]


def balancers(train_data_iterator) -> list:
    """The ``BalancedDataIterator`` objects inside a wrapped iterator (or list); for stats."""
    its = train_data_iterator if isinstance(train_data_iterator, list) else [train_data_iterator]
    out = []
    for it in its:
        inner = getattr(it, "iterable", None)
        if isinstance(inner, BalancedTrainIterable):
            out.append(inner.balancer)
    return out
