"""How many micro-batches the next global batch has: :class:`MicrobatchSchedule`.

Shared by both balancing modes (the exchange reads it when a global batch
starts, the sampler ahead of the training loop), so it sits in neither.
"""
from __future__ import annotations

from typing import Optional


class MicrobatchSchedule:
    """Zero-arg callable: the number of micro-batches of the next global batch.

    The balanced iterator reads it at the first ``next()`` of every global batch,
    after Megatron's training loop has called ``update_num_microbatches`` for that
    step, so by default it simply returns ``get_num_microbatches()``.

    Readers that run ahead of the training loop (the sampler mode's batch
    sampler, prefetched by the DataLoader) pass ``predict=True``: under
    ``--rampup-batch-size`` it then runs a private copy of Megatron's calculator
    on the samples consumed by the global batches it has already handed out.
    """

    def __init__(self, args=None, *, predict: bool = False,
                 consumed_samples: Optional[int] = None):
        self._calc = None
        self._consumed = 0
        if predict and args is not None and getattr(args, "rampup_batch_size", None):
            from megatron.core.num_microbatches_calculator import _build_num_microbatches_calculator
            self._calc = _build_num_microbatches_calculator(
                rank=1,  # not 0: keep the copy from logging
                rampup_batch_size=args.rampup_batch_size,
                global_batch_size=args.global_batch_size,
                micro_batch_size=args.micro_batch_size,
                data_parallel_size=args.data_parallel_size,
                decrease_batch_size_if_needed=getattr(args, "decrease_batch_size_if_needed", False),
            )
            self._consumed = int(consumed_samples if consumed_samples is not None
                                 else getattr(args, "consumed_train_samples", 0) or 0)
            self._samples_per_mb = args.micro_batch_size * args.data_parallel_size

    def __call__(self) -> int:
        if self._calc is None:
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            return int(get_num_microbatches())
        self._calc.update(self._consumed, False)
        n = int(self._calc.get())
        self._consumed += n * self._samples_per_mb
        return n
