"""Sampler mode: balance by reassigning sample indices before anything is loaded.

Megatron's ``MegatronPretrainingSampler`` (``--dataloader-type single``) hands
data-parallel rank r, at micro-step m of a global batch starting at sample s,
the micro-batch ``s + (m*D + r)*mbs ... + mbs``: every rank can compute every
rank's indices. When the dataset can also say what an index costs without
loading it — ``dataset.mm_balance_image_tokens(idx) -> int``, e.g. from an index
of pre-packed sequences — every rank computes the same cost matrix, runs the
same deterministic solver and simply yields the micro-batch the placement
gives it. No tensor crosses the network, nothing waits on another rank, and
checkpoint/resume stays ``consumed_samples`` as before (each global batch
covers the same samples).

It applies when all of these hold (``--mm-balance-mode auto`` checks them and
otherwise falls back to the tensor exchange; ``--mm-balance-mode sampler``
makes a failed check an error; ``exchange`` and ``shadow`` never use it):

* ``--dataloader-type single`` (Megatron's own batch sampler; energon and other
  ``external`` loaders pack on the fly, so only the exchange can help them);
* the train dataset defines ``mm_balance_image_tokens(idx)``;
* the dataset is the train split (validation keeps Megatron's sampler; a
  dataset without ``split``/``index_split`` counts as train for the first loader
  built, which is the train loader in ``build_train_valid_test_data_loaders``).

Whole micro-batches move, as in the exchange, so the loss is unchanged.

The sampler installed for the train loader is recorded on Megatron's ``args``
(``args.mm_balance_train_sampler``, as Megatron records its own run state there),
which is how ``wrap_train_data_iterator``, called later with the same ``args``,
knows that this run balances in sampler mode.
"""
from __future__ import annotations

import collections
from typing import Callable, Optional, Union

from .checks import MMBalanceConfigError
from .config import MMBalanceConfig
from .schedule import MicrobatchSchedule


def installed_train_sampler(args):
    """The balanced train sampler :func:`maybe_balanced_sampler` installed for ``args`` (or None)."""
    return getattr(args, "mm_balance_train_sampler", None)


def train_sampler_installed(args) -> bool:
    """True once :func:`maybe_balanced_sampler` put a balanced sampler on the train loader."""
    return installed_train_sampler(args) is not None


class BalancedPretrainingSampler:
    """``MegatronPretrainingSampler`` with balanced micro-batch placement per global batch.

    ``num_microbatches`` is an int or a zero-arg callable evaluated once per
    global batch (Megatron's calculator; ramp-up aware). The last partial global
    batch is dropped, as Megatron's sampler drops its last partial micro-step.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int,
                 cost_of_index: Callable[[int], int],
                 num_microbatches: Union[int, Callable[[], int]], *, sync: str = "step",
                 balance_tolerance: Optional[float] = None, stats_history: int = 1024):
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"no samples left to consume: {consumed_samples}, {total_samples}")
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError("micro_batch_size and data_parallel_size must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.cost_of_index = cost_of_index
        self.num_microbatches = num_microbatches
        self.sync = sync
        self.balance_tolerance = balance_tolerance
        self.stats = collections.deque(maxlen=stats_history)

    def __len__(self):
        return self.total_samples

    def _g(self) -> int:
        g = self.num_microbatches() if callable(self.num_microbatches) else self.num_microbatches
        g = int(g)
        if g < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {g}")
        return g

    def _micro_batch(self, start: int, rank: int, step: int) -> list:
        first = start + (step * self.data_parallel_size + rank) * self.micro_batch_size
        return list(range(first, first + self.micro_batch_size))

    def __iter__(self):
        import numpy as np
        from ..solver.placement import PlanStats, solve_placement

        D, mbs = self.data_parallel_size, self.micro_batch_size
        start = self.consumed_samples
        gb = -1
        while True:
            gb += 1
            G = self._g()
            if start + G * D * mbs > self.total_samples:
                return
            costs = np.zeros((D, G), dtype=np.int64)
            for r in range(D):
                for m in range(G):
                    costs[r, m] = sum(int(self.cost_of_index(i)) for i in self._micro_batch(start, r, m))
            kw = {} if self.balance_tolerance is None else {"balance_tolerance": self.balance_tolerance}
            placement = solve_placement(costs, sync=self.sync, **kw)
            plan = PlanStats.of(costs, placement)
            stats = {**plan.metrics(), **plan.record(), "global_batch": gb, "num_microbatches": G}
            del stats["moved"]                   # the record's packs_moved, as in the runtime
            self.stats.append(stats)
            me = self.data_parallel_rank
            for m in range(G):
                yield self._micro_batch(start, int(placement.src_rank[me, m]),
                                        int(placement.src_index[me, m]))
            start += G * D * mbs


def sampler_applies(batch_sampler, dataset) -> Optional[str]:
    """None when sampler mode applies to this loader, else the reason it does not."""
    if type(batch_sampler).__name__ != "MegatronPretrainingSampler":
        return (f"the batch sampler is {type(batch_sampler).__name__}, not Megatron's "
                "MegatronPretrainingSampler (--dataloader-type single)")
    if not callable(getattr(dataset, "mm_balance_image_tokens", None)):
        return f"the dataset {type(dataset).__name__} has no mm_balance_image_tokens(idx)"
    split = getattr(dataset, "split", getattr(dataset, "index_split", None))
    if split is not None and getattr(split, "name", str(split)) != "train":
        return f"the dataset is the {getattr(split, 'name', split)} split"
    return None


def maybe_balanced_sampler(batch_sampler, dataset, args=None):
    """Replace Megatron's batch sampler of the train loader when sampler mode applies.

    Called by the ``data_samplers.py`` patch after the batch sampler is built.
    Returns ``batch_sampler`` unchanged when ``--mm-balance`` is off, the mode is
    ``exchange`` or ``shadow``, or (mode ``auto``) :func:`sampler_applies` says no.
    """
    if args is None:
        from megatron.training import get_args
        args = get_args()
    if not getattr(args, "mm_balance", False):
        return batch_sampler
    cfg = MMBalanceConfig.from_args(args)      # checked by Megatron's validate_args (patch)
    if cfg.mode in ("exchange", "shadow") or cfg.cost != "image-tokens":
        return batch_sampler           # the sampler can only balance the dataset's image tokens
    split = getattr(dataset, "split", getattr(dataset, "index_split", None))
    if split is not None and getattr(split, "name", str(split)) != "train":
        return batch_sampler
    if split is None and train_sampler_installed(args):
        # No split attribute: Megatron builds the train loader first; later ones are eval.
        return batch_sampler
    reason = sampler_applies(batch_sampler, dataset)
    if reason is not None:
        if cfg.mode == "sampler":
            raise MMBalanceConfigError(f"--mm-balance-mode sampler does not apply: {reason}")
        return batch_sampler
    sampler = BalancedPretrainingSampler(
        total_samples=batch_sampler.total_samples,
        consumed_samples=batch_sampler.consumed_samples,
        micro_batch_size=batch_sampler.micro_batch_size,
        data_parallel_rank=batch_sampler.data_parallel_rank,
        data_parallel_size=batch_sampler.micro_batch_times_data_parallel_size // batch_sampler.micro_batch_size,
        cost_of_index=dataset.mm_balance_image_tokens,
        num_microbatches=MicrobatchSchedule(args, predict=True,
                                            consumed_samples=batch_sampler.consumed_samples),
        sync=cfg.sync,
        balance_tolerance=cfg.tolerance,
    )
    args.mm_balance_train_sampler = sampler
    return sampler
