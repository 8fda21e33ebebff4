"""The benchmark's GPU-node host side on Megatron-LM's harness (``MM_BALANCE_CPU_PREDRAW``):
the train loader's micro-batches are drawn when ``pretrain()`` has built its iterators, under
whatever wraps them later, the same batches in the same order."""
from __future__ import annotations

import types

import pytest

from megatron_mm_balance.testing import cpu_pretrain
from megatron_mm_balance.testing.host_side import PREDRAW_ENV, PredrawnBatches


class _Rerun:
    """What Megatron's ``RerunDataIterator`` keeps of the loader: its iterator in ``iterable``."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __next__(self):
        return next(self.iterable)


def _job(train, drawn):
    def loader():
        for i in range(100):
            drawn.append(i)
            yield {"i": i}
    built = _Rerun(loader()) if train == "one" else [_Rerun(loader()), None]
    mtrain = types.SimpleNamespace(build_train_valid_test_data_iterators=lambda *a, **k: (built, None, None))
    args = types.SimpleNamespace(train_iters=3, global_batch_size=8, micro_batch_size=1, data_parallel_size=2,
                                 dataloader_save="/ckpt/dataloader")
    return mtrain, args


@pytest.mark.parametrize("train", ["one", "per-chunk"])
def test_predraw_draws_the_jobs_micro_batches_when_the_iterators_are_built(monkeypatch, capsys, train):
    monkeypatch.setenv(PREDRAW_ENV, "all")
    monkeypatch.delenv("MM_BALANCE_CPU_HEAP_MB", raising=False)
    drawn = []
    mtrain, args = _job(train, drawn)
    cpu_pretrain._host_side_at_setup(mtrain, get_args=lambda: args)
    assert drawn == []                                           # nothing before pretrain() builds them
    out, _, _ = mtrain.build_train_valid_test_data_iterators()
    it = out if train == "one" else out[0]
    assert isinstance(it.iterable, PredrawnBatches)
    assert drawn == list(range(12))                               # 3 iterations x 8 / (1 x 2) on this rank
    assert [next(it)["i"] for _ in range(13)] == list(range(13))  # the same batches in order, then on
    assert "drew 12 micro-batches before the first iteration" in capsys.readouterr().out
    assert args.dataloader_save is None                           # no data position saved from it


def test_predraw_unset_changes_nothing_and_needs_train_iters(monkeypatch):
    monkeypatch.delenv(PREDRAW_ENV, raising=False)
    drawn = []
    mtrain, args = _job("one", drawn)
    original = mtrain.build_train_valid_test_data_iterators
    cpu_pretrain._host_side_at_setup(mtrain, get_args=lambda: args)
    assert mtrain.build_train_valid_test_data_iterators is original
    assert args.dataloader_save == "/ckpt/dataloader"
    monkeypatch.setenv(PREDRAW_ENV, "all")
    args.train_iters = None
    cpu_pretrain._host_side_at_setup(mtrain, get_args=lambda: args)
    with pytest.raises(ValueError, match="needs --train-iters"):
        mtrain.build_train_valid_test_data_iterators()
