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
* ``train_iterator.iterable.save_state()`` (energon's dataloader checkpoint) is
  still there; the balancer reads a global batch from the loader only when the
  training loop starts it, so between steps the loader state is the consumed one.

Only ranks that read data are wrapped: first/last pipeline stage, tensor rank 0
(see :mod:`.groups`); other ranks' iterators are returned unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .arguments import log_interval, resolve_sync


def variable_batch_size(args) -> bool:
    """Whether Megatron's micro-batch count changes during training: ``--rampup-batch-size``
    (releases up to core_v0.17.1) or ``--step-batch-size-schedule`` (its replacement from
    core_v0.18.2). Read by attribute, so either release's args work."""
    return bool(getattr(args, "rampup_batch_size", None)
                or getattr(args, "step_batch_size_schedule", None))


def private_microbatch_calculator(args):
    """A private copy of Megatron's micro-batch calculator (rank 1: it does not log) and the
    data-parallel size it counts in, built the way this Megatron's ``global_vars`` builds
    its own. Branches on the builder's parameters, not on a version: up to core_v0.17.1 it
    takes ``rampup_batch_size``; from core_v0.18.2 ``step_batch_size_schedule`` and
    ``seq_length`` (and core_v0.19.0 counts data-parallel replicas times
    ``gtp_weight_remat_size``)."""
    import inspect

    from megatron.core.num_microbatches_calculator import _build_num_microbatches_calculator as build
    params = inspect.signature(build).parameters
    dp = int(args.data_parallel_size) * int(getattr(args, "gtp_weight_remat_size", None) or 1)
    kwargs = dict(rank=1, global_batch_size=args.global_batch_size,
                  micro_batch_size=args.micro_batch_size, data_parallel_size=dp,
                  decrease_batch_size_if_needed=getattr(args, "decrease_batch_size_if_needed", False))
    if "rampup_batch_size" in params:
        kwargs["rampup_batch_size"] = getattr(args, "rampup_batch_size", None)
    if "step_batch_size_schedule" in params:
        kwargs["step_batch_size_schedule"] = getattr(args, "step_batch_size_schedule", None)
        kwargs["seq_length"] = getattr(args, "seq_length", None)
    return build(**kwargs), dp


class MicrobatchSchedule:
    """Zero-arg callable: the number of micro-batches of the next global batch.

    The balanced iterator reads it at the first ``next()`` of every global batch,
    after Megatron's training loop has called ``update_num_microbatches`` for that
    step, so by default it simply returns ``get_num_microbatches()``.

    Readers that run ahead of the training loop (the sampler mode's batch
    sampler, prefetched by the DataLoader) pass ``predict=True``: under
    ``--rampup-batch-size`` (``--step-batch-size-schedule`` from core_v0.18.2) it then
    runs a private copy of Megatron's calculator
    on the samples consumed by the global batches it has already handed out.
    """

    def __init__(self, args=None, *, predict: bool = False,
                 consumed_samples: Optional[int] = None):
        self._calc = None
        self._consumed = 0
        if predict and args is not None and variable_batch_size(args):
            self._calc, dp = private_microbatch_calculator(args)
            self._consumed = int(consumed_samples if consumed_samples is not None
                                 else getattr(args, "consumed_train_samples", 0) or 0)
            self._samples_per_mb = args.micro_batch_size * dp

    def __call__(self) -> int:
        if self._calc is None:
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            return int(get_num_microbatches())
        self._calc.update(self._consumed, False)
        n = int(self._calc.get())
        self._consumed += n * self._samples_per_mb
        return n


class BalancedTrainIterable:
    """What Megatron's ``RerunDataIterator`` wraps: balanced micro-batches plus ``save_state``.

    ``save_state()`` is the loader's own: the balancer pulls a global batch from
    the loader only when the training loop asks for its first micro-batch, so
    between steps (where Megatron checkpoints) the loader has read exactly the
    micro-batches consumed so far on this rank.
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
        """The loader's ``save_state`` (absent, as on the loader, if it has none)."""
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


def flatten_ints(value) -> list:
    """A scalar, tensor or nested list/tuple of counts as a flat list of ints (None: [])."""
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(flatten_ints(v))
        return out
    return [int(value)]


def image_counts(batch, tokens_per_tile: Optional[int] = None) -> list:
    """Per-image token counts of a micro-batch (``image_tokens``, else ``num_tiles``)."""
    if not isinstance(batch, dict):
        raise TypeError(f"mm-balance: micro-batch is a {type(batch).__name__}, expected a dict")
    if "image_token_counts" in batch:
        return flatten_ints(batch["image_token_counts"])
    if "image_tokens" in batch:
        return flatten_ints(batch["image_tokens"])
    if "num_tiles" in batch:
        tiles = flatten_ints(batch["num_tiles"])
        return [t * (tokens_per_tile or 1) for t in tiles]
    raise KeyError("mm-balance: micro-batch has neither 'image_tokens' nor 'num_tiles'; record "
                   "them in the task encoder (megatron_mm_balance.megatron.energon."
                   "BalancedPackingMixin) or pass a cost_fn")


class ImageTokensCost:
    """``--mm-balance-cost image-tokens``: a micro-batch's image tokens.

    Reads ``image_token_counts`` or ``image_tokens`` (our task encoder), else
    ``num_tiles`` x embeddings per tile (stock examples/multimodal batches; the
    embeddings per tile follow from ``--img-h/--img-w/--patch-dim/...``). A
    micro-batch with none of these keys (text only) costs 0, as in the runtime's
    default. Sums over every pack of the micro-batch, so it also serves
    ``--micro-batch-size`` > 1.
    """

    def __init__(self, tokens_per_tile: Optional[int] = None):
        self.tokens_per_tile = tokens_per_tile

    @property
    def identity(self) -> str:
        return f"megatron_mm_balance.megatron.image_tokens(tokens_per_tile={self.tokens_per_tile})"

    def __call__(self, batch) -> int:
        if not isinstance(batch, dict) or not any(k in batch for k in _IMAGE_KEYS):
            return 0
        return int(sum(image_counts(batch, self.tokens_per_tile)))


class ModelCost:
    """``--mm-balance-cost model``: a calibrated :class:`~megatron_mm_balance.cost.CostModel`
    on per-image tokens and per-sample lengths (from ``cu_lengths``)."""

    def __init__(self, path: str, tokens_per_tile: Optional[int] = None):
        from ..cost import load_cost_file
        self.model = load_cost_file(path)
        self.tokens_per_tile = tokens_per_tile

    @property
    def identity(self) -> str:
        return f"megatron_mm_balance.megatron.model_cost({self.model.to_json()}, {self.tokens_per_tile})"

    def __call__(self, batch) -> int:
        from ..cost import PackFeatures
        if not isinstance(batch, dict):
            return 0
        images = ()
        if any(k in batch for k in _IMAGE_KEYS):
            images = tuple(image_counts(batch, self.tokens_per_tile))
        cu = flatten_ints(batch.get("cu_lengths"))
        lengths = tuple(b - a for a, b in zip(cu, cu[1:]) if b > a)
        return self.model.cost(PackFeatures(images, lengths))


_IMAGE_KEYS = ("image_token_counts", "image_tokens", "num_tiles")


def make_cost_fn(args=None):
    """The cost function ``--mm-balance-cost`` asks for."""
    tpt = _tokens_per_tile(args)
    if getattr(args, "mm_balance_cost", "image-tokens") == "model":
        return ModelCost(args.mm_balance_cost_file, tpt)
    return ImageTokensCost(tpt)


class _Constant:
    """A fixed micro-batch count as a zero-arg callable (see ``wrap_train_data_iterator``)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self) -> int:
        return self.n


class _NextOnly:
    """Makes an object with only ``__next__`` (enough for ``RerunDataIterator``) iterable."""

    def __init__(self, obj):
        self.obj = obj

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.obj)


def _loader(iterator):
    from megatron.core.rerun_state_machine import RerunDataIterator
    return iterator.iterable if isinstance(iterator, RerunDataIterator) else iterator


def _schedule_for(iterator, args, num_microbatches):
    """What the balancer reads its micro-batch count from, one per chunk.

    A fixed int lets the exchange thread run ahead into the next global batch, so
    that batch's all-gather, solve and first exchange also hide behind compute.
    That is exact when the loader's position is not checkpointed through the
    iterator: Megatron's own samplers resume from ``consumed_train_samples``, and a
    global batch read ahead but not trained on is simply read again. A loader with
    ``save_state`` (energon) is checkpointed through the iterator, and under
    ``--rampup-batch-size`` the count changes between batches; in both cases the
    balancer gets a callable and starts each global batch only when training does.
    """
    if num_microbatches is None:
        fixed = not variable_batch_size(args)
        if fixed and not callable(getattr(_loader(iterator), "save_state", None)):
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            return int(get_num_microbatches())
        return MicrobatchSchedule(args)
    if callable(num_microbatches):
        return num_microbatches
    if callable(getattr(_loader(iterator), "save_state", None)):
        return _Constant(int(num_microbatches))
    return int(num_microbatches)


def _wrap_one(iterator, group, args, *, num_microbatches, cost_fn, chunk: int):
    from megatron.core.rerun_state_machine import RerunDataIterator
    from ..runtime import BalancedDataIterator
    from .telemetry import Telemetry

    source = iterator.iterable if isinstance(iterator, RerunDataIterator) else iterator
    if not hasattr(source, "__next__"):
        source = iter(source)
    reader = source if hasattr(source, "__iter__") else _NextOnly(source)
    balanced = BalancedDataIterator(
        reader,
        num_microbatches=num_microbatches,
        group=group,
        exchange_group=group,
        cost_fn=cost_fn,
        sync=resolve_sync(args),
        overlap=bool(getattr(args, "mm_balance_overlap", True)),
        timeout=float(getattr(args, "mm_balance_timeout", 300.0)),
        device=None,   # packs stay where the loader put them; get_batch moves them
        balance_tolerance=getattr(args, "mm_balance_tolerance", None),
    )
    telemetry = Telemetry(balanced, args, interval=log_interval(args), group=group, chunk=chunk)
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


def _with_sampler_telemetry(iterator, group, args, chunk):
    from megatron.core.rerun_state_machine import RerunDataIterator
    from .sampler import current_train_sampler
    from .telemetry import Telemetry

    if iterator is None or group is None:
        return iterator
    source = iterator.iterable if isinstance(iterator, RerunDataIterator) else iterator
    telemetry = Telemetry(current_train_sampler(), args, interval=log_interval(args), group=group,
                          chunk=chunk)
    return RerunDataIterator(_Reporting(source, telemetry))


def wrap_train_data_iterator(train_data_iterator, args=None, *, num_microbatches=None,
                             cost_fn=None, layout=None):
    """Wrap Megatron's train iterator(s) for ``--mm-balance``; a no-op when the flag is off.

    Call on **every** rank at the same point (it creates the exchange groups,
    collectively over the world). Accepts what ``build_train_valid_test_data_iterators``
    returns: a ``RerunDataIterator``, a plain iterator, ``None``, or a list of
    these (virtual pipeline). Returns the same shape.

    Keyword overrides (for harnesses not running Megatron's ``pretrain``):
    ``num_microbatches`` (int or zero-arg callable, default :class:`MicrobatchSchedule`),
    ``cost_fn`` (default :func:`make_cost_fn`), ``layout`` (this rank's
    ``{"holds_data", "dp_ranks"}``, default from ``megatron.core.parallel_state``).
    """
    if args is None:
        from megatron.training import get_args
        args = get_args()
    if not getattr(args, "mm_balance", False):
        return train_data_iterator
    from .checks import check_args
    from .groups import init_exchange_groups
    from .sampler import train_sampler_installed

    check_args(args)
    is_list = isinstance(train_data_iterator, list)
    iterators = train_data_iterator if is_list else [train_data_iterator]
    groups = init_exchange_groups(layout, num_chunks=len(iterators),
                                  timeout=float(getattr(args, "mm_balance_timeout", 300.0)))
    if train_sampler_installed():
        # Sampler mode: indices were reassigned before loading; nothing to exchange,
        # only the sampler's statistics to report.
        wrapped = [_with_sampler_telemetry(it, g, args, chunk)
                   for chunk, (it, g) in enumerate(zip(iterators, groups))]
        return wrapped if is_list else wrapped[0]
    if cost_fn is None:
        cost_fn = make_cost_fn(args)
    wrapped = []
    for chunk, (it, group) in enumerate(zip(iterators, groups)):
        if it is None or group is None:
            wrapped.append(it)
        else:
            schedule = _schedule_for(it, args, num_microbatches)
            wrapped.append(_wrap_one(it, group, args, num_microbatches=schedule,
                                     cost_fn=cost_fn, chunk=chunk))
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
