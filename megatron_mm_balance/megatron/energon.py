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
* ``batch`` returns the base's batch extended by two declared fields,
  ``image_tokens`` (one int per pack of the micro-batch) and ``image_token_counts``
  (one per image), the way energon extends a sample or batch type: a dataclass
  subclass with the new fields, built with energon's ``extend`` (a ``dict`` batch
  gets the two keys). ``encode_batch`` then hands them on as tensors in the batch
  dict, which is what the balancer's cost function reads (stock batches only carry
  ``num_tiles``). A batch built without them (elsewhere) is counted from ``num_tiles``.

Energon's stateless contract: energon restores a batch from its restore key
(``restore_sample``; ``can_restore_sample`` is true) only when the batcher and the
batch encoder carry its ``@stateless`` mark, i.e. are pure functions of their
input. The mixin's ``batch``/``encode_batch`` are pure exactly when the base's are,
so it comes in two forms: :class:`BalancedPackingMixin` (unmarked) and
:func:`stateless_balanced_packing_mixin` (the same, with both methods decorated
``@stateless`` in the class body, as energon documents it, for a base whose
batchers are pure). :func:`balanced_task_encoder` picks the form from the base's
own marks; :func:`balanced_example_task_encoder` takes the stateless one, since
examples/multimodal's ``batch`` and ``encode_batch`` are pure but unmarked.

Switched on in Megatron-LM's ``examples/multimodal/train.py`` by
``--mm-balance-task-encoder`` (``patches/0005``: the example's dataloader provider
builds :func:`balanced_example_task_encoder` instead of its ``TaskEncoder()``).

Importing this module imports no energon (the stateless form imports its
decorator when first built), so the mixin works with any base that has
energon's packing hooks.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Dict, List, Sequence

from ..cost.pack import check_tokens_per_tile, flatten_ints as _ints
from ..data.packing import pack_greedy
from ..data.traces import Sample

#: the declared fields the balanced batch carries: per pack, per image
BATCH_FIELDS = ("image_tokens", "image_token_counts")


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

    def batch(self, samples):
        """The base's batch, extended by the declared ``image_tokens`` (per pack) and
        ``image_token_counts`` (per image) fields (see the module docstring)."""
        batch = super().batch(samples)
        per_pack = [sum(self.mm_balance_image_tokens(s)) for s in samples]
        counts = [c for s in samples for c in self.mm_balance_image_tokens(s)]
        return with_image_tokens(batch, image_tokens=per_pack, image_token_counts=counts)

    def encode_batch(self, batch):
        """The base's encode_batch (a dict), with ``image_tokens`` and ``image_token_counts``
        as int64 tensors: the batch's declared fields, or from ``num_tiles`` without them."""
        raw = super().encode_batch(batch)
        if not isinstance(raw, dict):
            raise TypeError(f"BalancedPackingMixin needs encode_batch to return a dict, "
                            f"got {type(raw).__name__}")
        recorded = _recorded(batch)
        if recorded is None:   # batch built elsewhere: one pack, counts from num_tiles
            counts = [n * self.mm_balance_tokens_per_tile() for n in _ints(raw.get("num_tiles"))]
            recorded = {"image_tokens": [sum(counts)], "image_token_counts": counts}
        import torch
        for name in BATCH_FIELDS:
            raw[name] = torch.tensor(_ints(recorded[name], name), dtype=torch.int64)
        return raw


@functools.lru_cache(maxsize=None)
def stateless_balanced_packing_mixin() -> type:
    """:class:`BalancedPackingMixin` with ``batch`` and ``encode_batch`` marked with
    energon's ``@stateless``: for a base whose own batchers are pure (imports energon)."""
    from megatron.energon.task_encoder.base import stateless

    class StatelessBalancedPackingMixin(BalancedPackingMixin):
        """:class:`BalancedPackingMixin` whose batches energon may restore from their keys."""

        @stateless
        def batch(self, samples):
            return super().batch(samples)

        @stateless
        def encode_batch(self, batch):
            return super().encode_batch(batch)

    return _public(StatelessBalancedPackingMixin)


def _public(cls: type) -> type:
    """Make a class built at run time importable from this module by a unique name (pickling)."""
    module = sys.modules[__name__]
    name, n = cls.__name__, 1
    while getattr(module, name, cls) is not cls:      # e.g. two base types both named "Batch"
        n += 1
        name = f"{cls.__name__}_{n}"
    cls.__module__, cls.__qualname__ = __name__, name
    setattr(module, name, cls)
    return cls


_BALANCED_BATCH_TYPES: Dict[type, type] = {}


def balanced_batch_type(batch_type: type) -> type:
    """``Balanced<batch_type>``: the dataclass ``batch_type`` plus the declared fields
    :data:`BATCH_FIELDS` (lists of ints, default None); made once per type."""
    out = _BALANCED_BATCH_TYPES.get(batch_type)
    if out is None:
        params = batch_type.__dataclass_params__
        out = dataclasses.make_dataclass(
            f"Balanced{batch_type.__name__}", [(name, List[int], dataclasses.field(default=None))
                                               for name in BATCH_FIELDS],
            bases=(batch_type,), frozen=params.frozen, eq=params.eq)
        _BALANCED_BATCH_TYPES[batch_type] = _public(out)
    return out


def with_image_tokens(batch, **fields):
    """``batch`` with the :data:`BATCH_FIELDS` set: a dict gets the keys, a dataclass
    becomes its :func:`balanced_batch_type` (energon's ``extend`` when the type has it);
    any other batch has no declared place for them and is returned as it is."""
    if isinstance(batch, dict):
        return {**batch, **fields}
    if not dataclasses.is_dataclass(batch) or isinstance(batch, type):
        return batch
    cls = balanced_batch_type(type(batch)) if not _recorded_type(type(batch)) else type(batch)
    if hasattr(cls, "extend"):
        return cls.extend(batch, **fields)
    values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init}
    return cls(**{**values, **fields})


def _recorded_type(batch_type: type) -> bool:
    return dataclasses.is_dataclass(batch_type) and all(
        name in {f.name for f in dataclasses.fields(batch_type)} for name in BATCH_FIELDS)


def _recorded(batch):
    """The batch's declared fields, or None when it has none (or they are unset)."""
    if isinstance(batch, dict):
        values = {name: batch.get(name) for name in BATCH_FIELDS}
    elif dataclasses.is_dataclass(batch) and _recorded_type(type(batch)):
        values = {name: getattr(batch, name) for name in BATCH_FIELDS}
    else:
        return None
    return None if any(v is None for v in values.values()) else values


def _marked_stateless(fn) -> bool:
    """Whether ``fn`` carries energon's ``@stateless`` mark (energon's ``get_stateless``)."""
    return bool(getattr(fn, "__stateless__", False))


def balanced_task_encoder(base=None):
    """``class Balanced<Base>(mixin, base)``; ``base`` defaults to energon's
    ``DefaultTaskEncoder`` (which must then be installed: ``pip install megatron-energon``).
    The mixin is the stateless one when the base's ``batch`` and ``encode_batch`` both
    carry energon's ``@stateless`` mark, else :class:`BalancedPackingMixin`."""
    if base is None:
        try:
            from megatron.energon import DefaultTaskEncoder as base
        except ImportError as exc:
            raise ImportError("balanced_task_encoder() without a base needs megatron-energon "
                              "(pip install megatron-energon)") from exc
    pure = _marked_stateless(getattr(base, "batch", None)) and _marked_stateless(
        getattr(base, "encode_batch", None))
    mixin = stateless_balanced_packing_mixin() if pure else BalancedPackingMixin
    return type(f"Balanced{base.__name__}", (mixin, base), {})


def balanced_example_task_encoder(base):
    """An instance of ``examples/multimodal``'s ``TaskEncoder`` (``base``) with the mixin,
    its batches restorable by energon: what ``--mm-balance-task-encoder`` builds.

    The example's ``batch`` (pad and stack tensors) and ``encode_batch``
    (``dataclasses.asdict``, which also copies our declared fields) use no randomness
    and keep no state but carry no ``@stateless`` mark, so the balanced class takes the
    stateless mixin.
    """
    cls = type(f"Balanced{base.__name__}", (stateless_balanced_packing_mixin(), base), {})
    return cls()
