"""A megatron-energon ``TaskEncoder`` mixin: best-fit packing + per-pack image tokens.

Put it first in the bases of the task encoder the training script uses::

    from megatron_mm_balance.megatron.energon import BalancedPackingMixin
    class BalancedTaskEncoder(BalancedPackingMixin, TaskEncoder):   # examples/multimodal
        pass

or ``balanced_task_encoder(TaskEncoder)`` to build that class. It changes two things:

* ``select_samples_to_pack`` packs the energon packing buffer with our
  best-fit-decreasing packer (:func:`megatron_mm_balance.data.packing.pack_greedy`,
  whole samples, sequence length ``packing_seq_length``) instead of the
  example's ``greedy_knapsack``: fuller sequences, images never split;
* ``batch``/``encode_batch`` record ``image_tokens`` (one int per pack in the
  micro-batch) and ``image_token_counts`` (per image) in the batch dict, which is
  what the balancer's cost function reads (stock batches only carry ``num_tiles``).

Energon's stateless contract: energon restores a batch from its restore key
(``restore_sample``; ``can_restore_sample`` is true) only when the batcher and the
batch encoder carry its ``@stateless`` mark, i.e. are pure functions of their
input. The mixin's ``batch``/``encode_batch`` are pure apart from ``super()``, so
each class built on the mixin gets them marked exactly when the base's are (or
as ``mm_balance_batch_stateless`` declares, for a base whose pure batcher lacks
the mark, such as examples/multimodal's: :func:`balanced_example_task_encoder`).
The marks are energon's own decorator, applied when the class is created.

Switched on in Megatron-LM's ``examples/multimodal/train.py`` by
``--mm-balance-task-encoder`` (``patches/0005``: the example's dataloader provider
builds :func:`balanced_example_task_encoder` instead of its ``TaskEncoder()``).

The mixin imports energon only to mark methods when a class is built on it (and
not at all when energon is absent: nothing reads the marks then), so it works
with any base that has energon's packing hooks.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from ..data.packing import pack_greedy
from ..data.traces import Sample
from ..cost.pack import check_tokens_per_tile, flatten_ints as _ints


class BalancedPackingMixin:
    """Best-fit packing and per-pack image-token bookkeeping for an energon task encoder.

    Hooks a subclass may override: :meth:`mm_balance_seq_length`,
    :meth:`mm_balance_sample_length`, :meth:`mm_balance_image_tokens`.
    """

    #: energon's packing buffer is what ``select_samples_to_pack`` receives; the
    #: best-fit buffer spans all of it unless this caps it.
    mm_balance_buffer_size = None

    # -- hooks ---------------------------------------------------------------------
    def mm_balance_tokens_per_tile(self) -> int:
        """Image embeddings per tile: examples/multimodal's ``num_image_embeddings_per_tile``.

        There is no silent default: a task encoder without that attribute overrides this hook."""
        per = getattr(self, "num_image_embeddings_per_tile", None)
        if per is None:
            raise ValueError(f"BalancedPackingMixin: {type(self).__name__} has no "
                             "num_image_embeddings_per_tile; override mm_balance_tokens_per_tile()")
        return check_tokens_per_tile(per)

    def mm_balance_seq_length(self) -> int:
        seq = getattr(self, "packing_seq_length", None)
        if not seq:
            raise ValueError("BalancedPackingMixin needs packing: set --packing-seq-length "
                             "(task encoder attribute packing_seq_length)")
        return int(seq)

    def mm_balance_sample_length(self, sample) -> int:
        """Sequence tokens of a sample, text and image embeddings (examples/multimodal: total_len)."""
        return int(sample.total_len)

    def mm_balance_image_tokens(self, sample) -> List[int]:
        """Image tokens of each image of a sample: tiles x embeddings per tile."""
        per = self.mm_balance_tokens_per_tile()
        return [n * per for n in _ints(getattr(sample, "num_tiles", None))]

    # -- energon packing hooks -------------------------------------------------------
    def select_samples_to_pack(self, samples: Sequence) -> List[List]:
        """Best-fit-decreasing over the buffer; a sample longer than a sequence is an error."""
        samples = list(samples)
        if not samples:
            return []
        seq = self.mm_balance_seq_length()
        trace = [Sample(self.mm_balance_sample_length(s), tuple(self.mm_balance_image_tokens(s)))
                 for s in samples]
        result = pack_greedy(trace, seq, buffer_size=self.mm_balance_buffer_size or len(trace),
                             on_overlong="error")
        return [[samples[i] for i in pack.samples] for pack in result.packs]

    #: Whether ``batch``/``encode_batch`` get energon's ``@stateless`` mark: ``None``
    #: follows the base's marks, ``True``/``False`` declare it for the base.
    mm_balance_batch_stateless: Optional[bool] = None

    def __init_subclass__(cls, **kwargs):
        """Give ``cls`` its own ``batch``/``encode_batch``, marked stateless as the base's are."""
        super().__init_subclass__(**kwargs)
        for name, impl in (("batch", BalancedPackingMixin._mm_balance_batch),
                           ("encode_batch", BalancedPackingMixin._mm_balance_encode_batch)):
            if name in cls.__dict__ and not getattr(cls.__dict__[name], "_mm_balance_wrapper", False):
                continue   # the class defines its own: its marks are its own business
            base_fn = _after_mixin(cls, name)
            declared = cls.mm_balance_batch_stateless
            stateless = bool(getattr(base_fn, "__stateless__", False)) if declared is None else declared
            setattr(cls, name, _method(impl, name, stateless, base_fn))

    def _mm_balance_batch(self, samples):
        """The base's batch, plus the image tokens of each pack (``mm_balance_image_tokens``)."""
        batch = super().batch(samples)
        per_pack = [sum(self.mm_balance_image_tokens(s)) for s in samples]
        counts = [c for s in samples for c in self.mm_balance_image_tokens(s)]
        try:
            object.__setattr__(batch, "_mm_balance", (per_pack, counts))
        except (AttributeError, TypeError):   # a batch type without a __dict__
            pass
        return batch

    def _mm_balance_encode_batch(self, batch):
        """The base's encode_batch (a dict), plus ``image_tokens`` and ``image_token_counts``."""
        raw = super().encode_batch(batch)
        if not isinstance(raw, dict):
            raise TypeError(f"BalancedPackingMixin needs encode_batch to return a dict, "
                            f"got {type(raw).__name__}")
        recorded = getattr(batch, "_mm_balance", None)
        if recorded is None:   # batch built elsewhere: one pack, counts from num_tiles
            counts = [n * self.mm_balance_tokens_per_tile() for n in _ints(raw.get("num_tiles"))]
            recorded = ([sum(counts)], counts)
        raw.pop("_mm_balance", None)
        import torch
        raw["image_tokens"] = torch.tensor(recorded[0], dtype=torch.int64)
        raw["image_token_counts"] = torch.tensor(recorded[1], dtype=torch.int64)
        return raw

    batch = _mm_balance_batch
    encode_batch = _mm_balance_encode_batch


def _after_mixin(cls, name: str):
    """The ``name`` attribute of the first class after the mixin in ``cls``'s MRO that defines it."""
    mro = cls.__mro__
    for klass in mro[mro.index(BalancedPackingMixin) + 1:]:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def _method(impl: Callable, name: str, stateless: bool, base_fn) -> Callable:
    def method(self, arg):
        return impl(self, arg)
    method.__name__ = name
    method.__qualname__ = f"BalancedPackingMixin.{name}"
    method.__doc__ = impl.__doc__
    method._mm_balance_wrapper = True
    tolerance = getattr(base_fn, "__failure_tolerance__", None)
    if stateless:
        try:
            from megatron.energon.task_encoder.base import stateless as energon_stateless
        except ImportError:   # no energon: nothing reads the mark
            return method
        method = energon_stateless(method, failure_tolerance=tolerance)
    elif tolerance is not None:
        method.__failure_tolerance__ = tolerance
    return method


def balanced_task_encoder(base=None):
    """``class Balanced<Base>(BalancedPackingMixin, base)``; ``base`` defaults to energon's
    ``DefaultTaskEncoder`` (which must then be installed: ``pip install megatron-energon``)."""
    if base is None:
        try:
            from megatron.energon import DefaultTaskEncoder as base
        except ImportError as exc:
            raise ImportError("balanced_task_encoder() without a base needs megatron-energon "
                              "(pip install megatron-energon)") from exc
    return type(f"Balanced{base.__name__}", (BalancedPackingMixin, base), {})


def balanced_example_task_encoder(base):
    """An instance of ``examples/multimodal``'s ``TaskEncoder`` (``base``) with the mixin,
    its batches restorable by energon: what ``--mm-balance-task-encoder`` builds.

    The example's ``batch`` (pad and stack tensors) and ``encode_batch``
    (``dataclasses.asdict``) use no randomness and keep no state but carry no
    ``@stateless`` mark, so the balanced class declares them stateless.
    """
    cls = type(f"Balanced{base.__name__}", (BalancedPackingMixin, base), {"mm_balance_batch_stateless": True})
    return cls()
