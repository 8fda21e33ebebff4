"""How many micro-batches the next global batch has: :class:`MicrobatchSchedule`.

Shared by both balancing modes (the exchange reads it when a global batch
starts, the sampler ahead of the training loop), so it sits in neither. It reads
Megatron's global-batch arguments from the config's typed
:class:`~.config.BatchSchedule`, never from ``args``.
"""
from __future__ import annotations

from typing import Optional

from .config import BatchSchedule


def private_microbatch_calculator(schedule: BatchSchedule):
    """A private copy of Megatron's micro-batch calculator (rank 1: it does not log) and the
    data-parallel size it counts in, built the way this Megatron's ``global_vars`` builds
    its own. Branches on the builder's parameters, not on a version: up to core_v0.17.1 it
    takes ``rampup_batch_size``; from core_v0.18.2 ``step_batch_size_schedule`` and
    ``seq_length`` (and core_v0.19.0 counts data-parallel replicas times
    ``gtp_weight_remat_size``)."""
    import inspect

    from megatron.core.num_microbatches_calculator import _build_num_microbatches_calculator as build
    params = inspect.signature(build).parameters
    dp = int(schedule.data_parallel_size) * int(schedule.gtp_weight_remat_size or 1)
    kwargs = dict(rank=1, global_batch_size=schedule.global_batch_size,
                  micro_batch_size=schedule.micro_batch_size, data_parallel_size=dp,
                  decrease_batch_size_if_needed=schedule.decrease_batch_size_if_needed)
    if "rampup_batch_size" in params:
        rampup = schedule.rampup_batch_size
        kwargs["rampup_batch_size"] = None if rampup is None else list(rampup)
    if "step_batch_size_schedule" in params:
        kwargs["step_batch_size_schedule"] = schedule.step_batch_size_schedule
        kwargs["seq_length"] = schedule.seq_length
    return build(**kwargs), dp


class MicrobatchSchedule:
    """Zero-arg callable: the number of micro-batches of the next global batch.

    The balanced iterator reads it at the first ``next()`` of every global batch,
    after Megatron's training loop has called ``update_num_microbatches`` for that
    step, so by default it simply returns ``get_num_microbatches()``.

    Readers that run ahead of the training loop (the sampler mode's batch
    sampler, prefetched by the DataLoader; the exchange thread under ramp-up)
    pass ``predict=True``: under ``--rampup-batch-size``
    (``--step-batch-size-schedule`` from core_v0.18.2) it then runs a private copy of
    Megatron's calculator on the samples consumed by the global batches it has
    already handed out, starting from ``consumed_samples`` (default: the schedule's
    ``consumed_train_samples``, the run's position when the config was built).
    """

    def __init__(self, schedule: Optional[BatchSchedule] = None, *, predict: bool = False,
                 consumed_samples: Optional[int] = None):
        self._calc = None
        self._consumed = 0
        if predict and schedule is not None and schedule.variable:
            self._calc, dp = private_microbatch_calculator(schedule)
            self._consumed = int(consumed_samples if consumed_samples is not None
                                 else schedule.consumed_train_samples)
            self._samples_per_mb = schedule.micro_batch_size * dp

    def __call__(self) -> int:
        if self._calc is None:
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            return int(get_num_microbatches())
        self._calc.update(self._consumed, False)
        n = int(self._calc.get())
        self._consumed += n * self._samples_per_mb
        return n
