"""A megatron-energon ``TaskEncoder`` mixin: best-fit packing + per-pack image tokens.

Put it first in the bases of the task encoder the training script uses::

    from megatron_mm_balance.megatron.energon import BalancedPackingMixin
    class BalancedTaskEncoder(BalancedPackingMixin, TaskEncoder):   # examples/multimodal
        pass

or ``balanced_task_encoder(TaskEncoder)`` to build that class. It changes two things:

* ``select_samples_to_pack`` packs the energon packing buffer with our
  best-fit-decreasing packer (:func:`megatron_mm_balance.packing.pack_greedy`,
  whole samples, sequence length ``packing_seq_length``) instead of the
  example's ``greedy_knapsack``: fuller sequences, images never split;
* ``batch``/``encode_batch`` record ``image_tokens`` (one int per pack in the
  micro-batch) and ``image_token_counts`` (per image) in the batch dict, which is
  what the balancer's cost function reads (stock batches only carry ``num_tiles``).

The mixin itself imports nothing from energon (it only calls ``super()``), so it
works with any base that has energon's packing hooks; energon is imported only
by :func:`balanced_task_encoder` when it is given no base.
"""
from __future__ import annotations

from typing import List, Sequence

from ..packing import pack_greedy
from ..traces import Sample
from ..runtime.costs import flatten_ints as _ints


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
        return int(getattr(self, "num_image_embeddings_per_tile", 1) or 1)

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
        batch = super().batch(samples)
        per_pack = [sum(self.mm_balance_image_tokens(s)) for s in samples]
        counts = [c for s in samples for c in self.mm_balance_image_tokens(s)]
        try:
            object.__setattr__(batch, "_mm_balance", (per_pack, counts))
        except (AttributeError, TypeError):   # a batch type without a __dict__
            pass
        return batch

    def encode_batch(self, batch):
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
