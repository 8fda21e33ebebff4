"""How many micro-batches the next global batch has: :class:`MicrobatchSchedule`.

Shared by both balancing modes (the exchange reads it when a global batch
starts, the sampler ahead of the training loop), so it sits in neither.
"""
from __future__ import annotations

from typing import Optional


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
