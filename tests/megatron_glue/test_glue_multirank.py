"""The wrapper under real gloo processes: groups on all ranks, None and list pass-through,
virtual-pipeline chunks reaching identical placements, Megatron's TP-rank-0 layout.

Each launch has a hard timeout (``launch`` kills every process it started).
About 25 s on 2 cores.
"""
import argparse

import pytest

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 not installed")

from megatron_mm_balance.testing.cpu_megatron import launch  # noqa: E402

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

G, STEPS = 4, 3


def _args(**kw):
    from megatron_mm_balance.megatron.arguments import add_mm_balance_args
    args = add_mm_balance_args(argparse.ArgumentParser()).parse_args(
        ["--mm-balance", "--mm-balance-timeout", "60", "--mm-balance-log-interval", "1"])
    args.__dict__.update(micro_batch_size=1, calculate_per_token_loss=False, expert_model_parallel_size=2,
                         num_experts=None, tensorboard_dir=None, **kw)
    return args


class Loader:
    """Rank r's packs: rank 0's are image-heavy, so balancing must move some."""

    def __init__(self, rank):
        self.rank, self.n = rank, 0

    def __next__(self):
        import torch
        k = self.n
        self.n += 1
        heavy = 5000 if self.rank == 0 else 10
        return {"image_tokens": torch.tensor([heavy + k]), "id": torch.tensor([self.rank * 1000 + k])}

    def save_state(self):
        return {"read": self.n}


def _consume(it):
    steps = []
    for _ in range(STEPS):
        steps.append([int(next(it)["id"]) for _ in range(G)])
    return steps


def explicit_layout_worker(rank, world):
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron_mm_balance.megatron.groups import init_exchange_groups
    from megatron_mm_balance.megatron.iterator import balancers, wrap_train_data_iterator

    holds = rank in (0, 1)
    layout = {"holds_data": holds, "dp_ranks": [0, 1] if holds else [rank]}
    loaders = [Loader(rank), Loader(rank)] if holds else [None, None]
    its = [RerunDataIterator(l) if l is not None else None for l in loaders]
    groups = init_exchange_groups(layout, num_chunks=2, timeout=60)      # passed on explicitly
    out = wrap_train_data_iterator(its, _args(), exchange_groups=groups, num_microbatches=G)
    assert isinstance(out, list) and len(out) == 2
    sampler_run = sampler_mode_phase(rank, layout)
    if not holds:
        return {"none": out == [None, None], "groups": [list(g) for g in groups.rank_lists],
                "sampler": sampler_run}
    assert all(isinstance(o, RerunDataIterator) for o in out)
    chunks = [_consume(o) for o in out]
    bals = balancers(out)
    import time
    deadline = time.monotonic() + 20           # the exchange thread reads ahead at once
    while loaders[0].n <= STEPS * G and time.monotonic() < deadline:
        time.sleep(0.01)
    res = {"chunks": chunks, "state": out[0].iterable.save_state(), "sampler": sampler_run,
           "loader_read": loaders[0].n, "prefetched": [s.prefetched for s in bals[0].stats],
           "moved": sum(s.packs_moved for s in bals[0].stats),
           "steps_logged": len(bals[0].stats), "groups": [list(g) for g in groups.rank_lists]}
    for b in bals:
        b.close()
    return res


class TokensDataset:
    """A map-style dataset that knows each sample's image tokens without loading it."""

    def __len__(self):
        return 400

    def __getitem__(self, idx):
        return idx

    def mm_balance_image_tokens(self, idx):
        return 4096 if idx % 7 == 0 else 16


def sampler_mode_phase(rank, layout):
    """Sampler mode through the glue: Megatron's sampler replaced, iterator not exchanged."""
    import io
    import contextlib
    import torch
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron_mm_balance.megatron import sampler as sm
    from megatron_mm_balance.megatron.iterator import balancers, wrap_train_data_iterator
    from test_glue_sampler import MegatronPretrainingSampler

    holds = layout["holds_data"]
    it = None
    args = _args(rampup_batch_size=None)
    if holds:
        ms = MegatronPretrainingSampler(400, 0, 1, rank, 2)
        bs = sm.maybe_balanced_sampler(ms, TokensDataset(), args)
        bs.num_microbatches = G            # no Megatron calculator in this test
        loader = torch.utils.data.DataLoader(TokensDataset(), batch_sampler=bs)
        it = RerunDataIterator(iter(loader))
    out = wrap_train_data_iterator(it, args, layout=layout)
    if not holds:
        return out is None
    assert balancers(out) == [] and sm.installed_train_samplers(args) == [bs]
    got, log = [], io.StringIO()
    with contextlib.redirect_stdout(log):
        for step in range(STEPS):
            got.append([int(next(out)[0]) for _ in range(G)])
    return {"steps": got, "log": log.getvalue(), "moved": sum(s.packs_moved for s in bs.stats)}


def test_explicit_layout_lists_none_and_identical_chunk_placements():
    r0, r1, r2 = launch(explicit_layout_worker, 3, timeout=180)
    assert r2["none"] and r0["groups"] == r1["groups"] == r2["groups"] == [[0, 1]]
    for r in (r0, r1):
        assert r["chunks"][0] == r["chunks"][1]          # chunks agree: same costs, same solver
        assert all(len(step) == G for step in r["chunks"][0])
        # The thread read ahead into the next global batch; the state is the consumed one.
        assert r["loader_read"] > STEPS * G and all(r["prefetched"][1:]), r["prefetched"]
        assert r["state"] == {"read": STEPS * G}
        assert r["steps_logged"] == STEPS
    for s in range(STEPS):
        got = sorted(r0["chunks"][0][s] + r1["chunks"][0][s])
        want = sorted([k for k in range(s * G, (s + 1) * G)] + [1000 + k for k in range(s * G, (s + 1) * G)])
        assert got == want                                # the same packs, each exactly once
    assert r0["moved"] > 0
    # Sampler mode: same samples per global batch as Megatron's sampler, balanced, reported.
    assert r2["sampler"] is True
    s0, s1 = r0["sampler"], r1["sampler"]
    for s in range(STEPS):
        assert sorted(s0["steps"][s] + s1["steps"][s]) == list(range(s * G * 2, (s + 1) * G * 2))
    assert s0["moved"] > 0
    assert "[mm-balance] iteration 1" in s0["log"] and "imbalance_before" in s0["log"]
    assert s1["log"] == ""                               # one report per group


def megatron_layout_worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron_mm_balance.megatron.groups import init_exchange_groups
    from megatron_mm_balance.megatron.iterator import BalancedTrainIterable, balancers, wrap_train_data_iterator
    from megatron_mm_balance.testing.cpu_megatron import initialize

    initialize(tensor_model_parallel_size=2)
    groups = init_exchange_groups(timeout=60)           # the layout from parallel_state
    loader = Loader(rank)
    it = wrap_train_data_iterator(RerunDataIterator(loader), _args(), exchange_groups=groups,
                                  num_microbatches=G)
    tp = ps.get_tensor_model_parallel_rank()
    wrapped = isinstance(it.iterable, BalancedTrainIterable)
    steps = _consume(it) if tp == 0 else None
    for b in balancers(it):
        b.close()
    return {"tp": tp, "wrapped": wrapped, "steps": steps, "groups": [list(g) for g in groups.rank_lists]}


def test_megatron_layout_balances_tensor_rank_zero_only():
    res = launch(megatron_layout_worker, 4, timeout=180)
    assert all(r["groups"] == [[0, 2]] for r in res)
    assert [r["wrapped"] for r in res] == [r["tp"] == 0 for r in res] == [True, False, True, False]
    r0, r2 = res[0]["steps"], res[2]["steps"]
    for s in range(STEPS):
        assert sorted(r0[s] + r2[s]) == sorted(list(range(s * G, (s + 1) * G)) +
                                               [2000 + k for k in range(s * G, (s + 1) * G)])


RAMP_STEPS = 8


def rampup_worker(rank, world, consumed0):
    """Megatron's ramp-up driven as its training loop does (update_num_microbatches with the
    consumed samples, then get_num_microbatches() micro-batches), through the glue's default
    schedule: the thread prefetches on its private prediction, the loop's count is checked."""
    import time
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron_mm_balance.megatron.iterator import balancers, wrap_train_data_iterator

    from test_glue_units import RAMP_BASE, ramp_args

    var = ramp_args(nmc.init_num_microbatches_calculator)
    nmc.init_num_microbatches_calculator(rank, **RAMP_BASE, **var)
    args = _args(**var, global_batch_size=16, data_parallel_size=2, consumed_train_samples=consumed0)
    loader = Loader(rank)
    out = wrap_train_data_iterator(RerunDataIterator(loader), args,
                                   layout={"holds_data": True, "dp_ranks": [0, 1]})
    [bal] = balancers(out)
    consumed, steps, counts = consumed0, [], []
    for _ in range(RAMP_STEPS):
        nmc.update_num_microbatches(consumed, True)
        G = nmc.get_num_microbatches()
        counts.append(G)
        steps.append([int(next(out)["id"]) for _ in range(G)])
        consumed += G * 1 * 2
    deadline = time.monotonic() + 20
    while loader.n <= sum(counts) and time.monotonic() < deadline:
        time.sleep(0.01)
    res = {"steps": steps, "counts": counts, "state": out.iterable.save_state(), "loader_read": loader.n,
           "prefetched": [s.prefetched for s in bal.stats],
           "moved": sum(s.packs_moved for s in bal.stats)}
    bal.close()
    return res


@pytest.mark.parametrize("consumed0", [0, 12])
def test_rampup_prefetches_on_the_predicted_schedule(consumed0):
    """Fresh (0 samples consumed) and resumed mid-ramp (12): every global batch has the
    training loop's count, holds each rank's next packs exactly once, was prefetched, and
    save_state is the consumed position although the loader was read ahead."""
    r0, r1 = launch(rampup_worker, 2, (consumed0,), timeout=180)
    counts = r0["counts"]
    assert r1["counts"] == counts and len(set(counts)) > 1, counts
    start = 0
    for s, G in enumerate(counts):
        got = sorted(r0["steps"][s] + r1["steps"][s])
        assert got == sorted(list(range(start, start + G)) + [1000 + k for k in range(start, start + G)])
        start += G
    for r in (r0, r1):
        assert all(r["prefetched"][1:]), r["prefetched"]
        assert r["loader_read"] > sum(counts) and r["state"] == {"read": sum(counts)}
    assert r0["moved"] > 0
