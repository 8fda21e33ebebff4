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

The balanced sampler of a run is recorded in :data:`INSTALLED`, a registry keyed
by the run's argument namespace (the object both patched hooks are handed:
``build_pretraining_data_loader`` and ``pretrain``), never on ``args`` itself;
``wrap_train_data_iterator`` looks it up there to pick the sampler coordinator.

The placement is the planner's (:func:`~megatron_mm_balance.runtime.planner.plan_batch`,
the one every mode uses, flat: nothing travels between ranks here), and each
global batch's statistics are a :class:`~megatron_mm_balance.runtime.stats.BatchStats`.
Sampler mode honours only ``--mm-balance-cost image-tokens`` (the dataset reports
image tokens by index): ``--mm-balance-mode sampler`` with another cost is refused
at start-up (:mod:`.checks`), and ``auto`` then uses the exchange.
"""
from __future__ import annotations

import collections
import time
import weakref
from typing import Callable, List, Optional, Union

from ..runtime.config import BalancerConfig
from .checks import checked_config
from .config import GROUPS_CROSSOVER_MODES, MEASURING_MODES, MMBalanceConfig, MMBalanceConfigError
from .schedule import MicrobatchSchedule


class InstalledSamplers:
    """The balanced train samplers installed per run, keyed by the run's ``args`` object
    (by identity, held weakly: an ``argparse.Namespace`` is not hashable), in the order
    their loaders were built: one per model chunk under virtual pipeline when every
    chunk's train split is balanced."""

    def __init__(self):
        self._by_run: dict = {}             # id(args) -> (weak reference to args, samplers)

    def add(self, run, sampler) -> None:
        key = id(run)
        entry = self._by_run.get(key)
        if entry is None or entry[0]() is not run:
            entry = (weakref.ref(run, lambda _, key=key: self._by_run.pop(key, None)), [])
            self._by_run[key] = entry
        entry[1].append(sampler)

    def of(self, run) -> List["BalancedPretrainingSampler"]:
        entry = self._by_run.get(id(run))
        return list(entry[1]) if entry is not None and entry[0]() is run else []


#: the registry :func:`maybe_balanced_sampler` records into and the wrapper reads
INSTALLED = InstalledSamplers()


def installed_train_samplers(args) -> list:
    """The balanced train samplers :func:`maybe_balanced_sampler` installed for ``args``."""
    return INSTALLED.of(args)


class BalancedPretrainingSampler:
    """``MegatronPretrainingSampler`` with balanced micro-batch placement per global batch.

    ``num_microbatches`` is an int or a zero-arg callable evaluated once per
    global batch (Megatron's calculator; ramp-up aware). ``config``: the planner's
    settings (``sync``, ``balance_tolerance``, ``stats_history``). The last partial
    global batch is dropped, as Megatron's sampler drops its last partial micro-step.
    ``.stats`` holds one :class:`~megatron_mm_balance.runtime.stats.BatchStats` per
    global batch planned (the DataLoader reads ahead, so possibly a few more than
    were trained on).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int,
                 cost_of_index: Callable[[int], int],
                 num_microbatches: Union[int, Callable[[], int]], *,
                 config: Optional[BalancerConfig] = None):
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
        self.config = BalancerConfig() if config is None else config
        self.stats = collections.deque(maxlen=self.config.stats_history)
        self._planned = 0                 # global batches planned so far, over every pass

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
        from ..runtime.planner import plan_batch
        from ..runtime.stats import BatchStats

        D, mbs = self.data_parallel_size, self.micro_batch_size
        start = self.consumed_samples
        me = self.data_parallel_rank
        while True:
            G = self._g()
            if start + G * D * mbs > self.total_samples:
                return
            costs = np.zeros((D, G), dtype=np.int64)
            for r in range(D):
                for m in range(G):
                    costs[r, m] = sum(int(self.cost_of_index(i)) for i in self._micro_batch(start, r, m))
            t0 = time.perf_counter()
            placement, plan = plan_batch(costs, self.config)      # flat: no tensor travels
            solver_ms = (time.perf_counter() - t0) * 1e3
            self.stats.append(BatchStats(
                global_batch=self._planned, num_microbatches=G, plan=plan, mode="sampler",
                solver_ms=solver_ms,
                my_costs=tuple(int(x) for x in placement.apply(costs)[me])))
            self._planned += 1
            for m in range(G):
                yield self._micro_batch(start, int(placement.src_rank[me, m]),
                                        int(placement.src_index[me, m]))
            start += G * D * mbs

    def num_microbatches_of(self, global_batch: int) -> int:
        """G of a planned global batch (the consumer's, which the sampler has passed)."""
        for s in reversed(self.stats):
            if s.global_batch == global_batch:
                return s.num_microbatches
        raise RuntimeError(f"global batch {global_batch} was not planned by this sampler "
                           f"(planned: {self._planned}, kept: {len(self.stats)})")

    def consumer_position(self) -> "ConsumerPosition":
        return ConsumerPosition(self)


class ConsumerPosition:
    """Where the training loop is in the sampler's global batches: :meth:`advance` per
    delivered micro-batch returns its global batch (0-based)."""

    def __init__(self, sampler: BalancedPretrainingSampler):
        self.sampler = sampler
        self.global_batch, self._k, self._G = -1, 0, 0

    def advance(self) -> int:
        if self._k == self._G:
            self.global_batch += 1
            self._k, self._G = 0, self.sampler.num_microbatches_of(self.global_batch)
        self._k += 1
        return self.global_batch


def sampler_applies(batch_sampler, dataset, cfg: Optional[MMBalanceConfig] = None) -> Optional[str]:
    """None when sampler mode applies to this loader (and ``cfg``'s cost), else the reason
    it does not."""
    if cfg is not None and cfg.cost != "image-tokens":
        return (f"--mm-balance-cost {cfg.cost}: the dataset reports only image tokens by index "
                "(mm_balance_image_tokens)")
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
    ``exchange``, ``shadow`` or ``control``, or (mode ``auto``) :func:`sampler_applies` says no.
    """
    if args is None:
        from megatron.training import get_args
        args = get_args()
    cfg = checked_config(args)
    if not cfg.enabled or cfg.mode in ("exchange",) + MEASURING_MODES + GROUPS_CROSSOVER_MODES \
            or cfg.cost != "image-tokens":
        return batch_sampler           # the sampler can only balance the dataset's image tokens
    split = getattr(dataset, "split", getattr(dataset, "index_split", None))
    if split is not None and getattr(split, "name", str(split)) != "train":
        return batch_sampler
    if split is None and INSTALLED.of(args):
        # No split attribute: Megatron builds the train loader first; later ones are eval.
        return batch_sampler
    reason = sampler_applies(batch_sampler, dataset, cfg)
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
        num_microbatches=MicrobatchSchedule(cfg.schedule, predict=True,
                                            consumed_samples=batch_sampler.consumed_samples),
        config=cfg.runtime(),
    )
    INSTALLED.add(args, sampler)
    return sampler
