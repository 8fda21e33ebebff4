"""Sampler mode: same samples per global batch as Megatron's sampler, balanced, no exchange."""
import argparse
import collections

import numpy as np
import pytest

from megatron_mm_balance.megatron import sampler as sampler_mod
from megatron_mm_balance.megatron.sampler import (
    BalancedPretrainingSampler, maybe_balanced_sampler, sampler_applies)
from megatron_mm_balance.runtime.config import BalancerConfig
from megatron_mm_balance.solver.placement import microstep_objective

D, MBS, G = 4, 1, 6


def costs_of(n, seed=0):
    rng = np.random.default_rng(seed)
    # Heavy-tailed image tokens: most packs light, a few very heavy (the straggler case).
    return [int(x) for x in rng.choice([0, 64, 256, 2048, 8192], size=n, p=[.3, .3, .2, .15, .05])]


def megatron_batches(total, consumed, mbs, rank, dp):
    """Megatron's MegatronPretrainingSampler, written out (the same arithmetic)."""
    batch = []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp:
            yield batch[rank * mbs:(rank + 1) * mbs]
            batch = []


def run_all_ranks(total, costs, consumed=0, mbs=MBS, sync="microstep", g=G):
    out = []
    for r in range(D):
        s = BalancedPretrainingSampler(total, consumed, mbs, r, D, costs.__getitem__, g,
                                       config=BalancerConfig(sync=sync))
        out.append((list(s), s))
    return out


@pytest.mark.parametrize("sync", ["microstep", "step"])
@pytest.mark.parametrize("mbs", [1, 2])
def test_same_samples_per_global_batch_and_better_balance(sync, mbs):
    total = 10 * G * D * mbs + 3           # a partial global batch at the end is dropped
    costs = costs_of(total, seed=mbs)
    runs = run_all_ranks(total, costs, mbs=mbs, sync=sync)
    ref = [list(megatron_batches(total, 0, mbs, r, D)) for r in range(D)]
    n_steps = len(runs[0][0]) // G
    assert n_steps == 10 and all(len(out) == n_steps * G for out, _ in runs)
    moved = 0
    for step in range(n_steps):
        sl = slice(step * G, (step + 1) * G)
        got = sorted(i for out, _ in runs for mb in out[sl] for i in mb)
        want = sorted(i for rb in ref for mb in rb[sl] for i in mb)
        assert got == want                                   # same samples, none twice
        for out, _ in runs:                                  # micro-batches stay whole
            assert all(mb == list(range(mb[0], mb[0] + mbs)) and mb[0] % mbs == 0 for mb in out[sl])
        before = np.array([[sum(costs[i] for i in rb[m]) for m in range(step * G, (step + 1) * G)] for rb in ref])
        after = np.array([[sum(costs[i] for i in mb) for mb in out[sl]] for out, _ in runs])
        if sync == "microstep":
            assert microstep_objective(after) <= microstep_objective(before)
        else:
            assert after.sum(axis=1).max() <= before.sum(axis=1).max()
        moved += int((after != before).any())
    assert moved > 0
    stats = runs[0][1].stats
    assert len(stats) == n_steps and [s.global_batch for s in stats] == list(range(n_steps))
    assert sum(s.packs_moved for s in stats) > 0


def test_resume_from_consumed_samples_continues_the_same_stream():
    total = 8 * G * D
    costs = costs_of(total, seed=3)
    full = run_all_ranks(total, costs)
    resumed = run_all_ranks(total, costs, consumed=3 * G * D)
    for (f, _), (r, _) in zip(full, resumed):
        assert r == f[3 * G:]


def test_callable_microbatches_per_global_batch():
    counts = collections.deque([2, 4, 6, 6, 6])
    s = BalancedPretrainingSampler(1000, 0, 1, 0, D, lambda i: i % 7, lambda: counts.popleft(),
                                   config=BalancerConfig(sync="step"))
    out = []
    for mb in s:
        out.append(mb)
        if len(out) == 2 + 4 + 6:
            break
    assert len(s.stats) == 3
    # Global batches cover [0, 8), [8, 24), [24, 48).
    assert {i for mb in out[:2] for i in mb} <= set(range(8))
    assert {i for mb in out[2:6] for i in mb} <= set(range(8, 24))


def test_bad_arguments():
    with pytest.raises(ValueError, match="no samples left"):
        BalancedPretrainingSampler(10, 10, 1, 0, 2, int, 2)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        BalancedPretrainingSampler(10, 0, 1, 2, 2, int, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        list(BalancedPretrainingSampler(10, 0, 1, 0, 2, int, 0))


# -- when it applies -----------------------------------------------------------------------
class MegatronPretrainingSampler:   # same class name and fields as Megatron's
    def __init__(self, total, consumed, mbs, rank, dp):
        self.total_samples, self.consumed_samples, self.micro_batch_size = total, consumed, mbs
        self.data_parallel_rank, self.micro_batch_times_data_parallel_size = rank, mbs * dp


class Split:
    def __init__(self, name):
        self.name = name


class Dataset:
    def __init__(self, split="train", costs=None):
        self.index_split = Split(split)
        self.costs = costs or [1] * 100

    def mm_balance_image_tokens(self, idx):
        return self.costs[idx]


def args(mode="auto", on=True):
    return argparse.Namespace(mm_balance=on, mm_balance_mode=mode, mm_balance_sync="auto",
                              expert_model_parallel_size=1, mm_balance_tolerance=None,
                              rampup_batch_size=None)


def test_sampler_applies_reasons():
    ok = MegatronPretrainingSampler(100, 0, 1, 0, 2)
    assert sampler_applies(ok, Dataset()) is None
    assert "no mm_balance_image_tokens" in sampler_applies(ok, object())
    assert "MegatronPretrainingSampler" in sampler_applies(object(), Dataset())
    assert "valid split" in sampler_applies(ok, Dataset("valid"))


def test_maybe_balanced_sampler_installs_only_for_train(monkeypatch):
    from megatron.core import num_microbatches_calculator as nmc
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, 8, 1, 2)
    try:
        ms = MegatronPretrainingSampler(100, 0, 1, 1, 2)
        run = args()                          # the run's args: where the installed sampler is recorded
        assert maybe_balanced_sampler(ms, Dataset("valid"), run) is ms
        assert maybe_balanced_sampler(ms, Dataset(), args(on=False)) is ms
        assert maybe_balanced_sampler(ms, Dataset(), args(mode="exchange")) is ms
        assert maybe_balanced_sampler(ms, Dataset(), args(mode="shadow")) is ms
        assert maybe_balanced_sampler(ms, object(), run) is ms            # auto: falls back
        assert sampler_mod.installed_train_samplers(run) == []
        with pytest.raises(ValueError, match="--mm-balance-mode sampler does not apply"):
            maybe_balanced_sampler(ms, object(), args(mode="sampler"))
        bs = maybe_balanced_sampler(ms, Dataset(costs=list(range(100))), run)
        assert isinstance(bs, BalancedPretrainingSampler)
        assert sampler_mod.installed_train_samplers(run) == [bs]        # recorded for this run only
        assert not hasattr(run, "mm_balance_train_sampler")
        assert sampler_mod.installed_train_samplers(args()) == []
        assert bs.data_parallel_rank == 1 and bs.data_parallel_size == 2
        first = list(bs)[:4]
        assert all(len(mb) == 1 for mb in first)
    finally:
        nmc.destroy_num_microbatches_calculator()
