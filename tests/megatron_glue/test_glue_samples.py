"""--mm-balance-record-samples (megatron/samples.py): what a rank consumed, per iteration.

Single process: the record format, the digest, and the balancing-off path of
``wrap_train_data_iterator`` (a pass-through that keeps ``save_state``). The balanced path
is recorded in the real-path resume tests (tests/realpath), across ranks.
"""
import argparse
import json

import pytest
import torch

from megatron_mm_balance.megatron.arguments import add_mm_balance_args
from megatron_mm_balance.megatron.samples import (SampleRecorder, batch_digest, batch_keys,
                                                  read_records)


def item(i, key=True):
    d = {"tokens": torch.arange(i, i + 4), "imgs": torch.full((1, 2), float(i), dtype=torch.bfloat16),
         "num_tiles": torch.tensor([1], dtype=torch.int32)}
    if key:
        d["__key__"] = [f"captions/part_00000.tar/{i:06d},captions/part_00000.tar/{i + 1:06d}"]
    return d


def test_keys_and_digest():
    assert batch_keys(item(3)) == ["captions/part_00000.tar/000003,captions/part_00000.tar/000004"]
    assert batch_keys(item(3, key=False)) is None and batch_keys([1, 2]) is None
    assert batch_digest(item(3)) == batch_digest(item(3))
    changed = item(3)
    changed["imgs"][0, 1] = 7.0                   # same key, other content: another digest
    assert batch_digest(changed) != batch_digest(item(3))
    assert batch_digest(item(3, key=False)) == batch_digest(item(3))      # content only


def test_recorder_writes_one_line_per_micro_batch(tmp_path):
    args = argparse.Namespace(curr_iteration=3, iteration=3)
    from megatron_mm_balance.megatron.config import live_iteration
    rec = SampleRecorder(str(tmp_path), iteration_fn=live_iteration(args), job_start=3, rank=2, dp_rank=1)
    for it in (3, 4):
        args.curr_iteration = it
        for m in range(2):
            rec.record(item(10 * it + m))
    rec.close()
    lines = [json.loads(l) for l in (tmp_path / "samples-rank00002.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["microbatch"]) for r in lines] == [(4, 0), (4, 1), (5, 0), (5, 1)]
    assert {r["rank"] for r in lines} == {2} and {r["dp_rank"] for r in lines} == {1}
    assert {r["job_start"] for r in lines} == {3}
    assert lines[2]["keys"] == batch_keys(item(40)) and lines[2]["digest"] == batch_digest(item(40))
    assert read_records(str(tmp_path)) == lines


class Loader:
    """A loader with energon's save_state, iterable (not an iterator) like EnergonDataloader's base."""

    def __init__(self, n):
        self.items = [item(i) for i in range(n)]
        self.saved = 0

    def __iter__(self):
        return iter(self.items)

    def save_state(self):
        self.saved += 1
        return {"position": self.saved}


def test_balancing_off_records_and_changes_nothing(tmp_path):
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron_mm_balance.megatron.iterator import wrap_train_data_iterator
    args = add_mm_balance_args(argparse.ArgumentParser()).parse_args(
        ["--mm-balance-record-samples", str(tmp_path / "rec")])
    args.curr_iteration, args.iteration = 0, 0
    loader = Loader(4)
    wrapped = wrap_train_data_iterator(RerunDataIterator(loader), args)
    assert isinstance(wrapped, RerunDataIterator)
    got = [next(wrapped) for _ in range(4)]
    assert all(batch_digest(g) == batch_digest(w) for g, w in zip(got, loader.items))
    assert wrapped.iterable.save_state() == {"position": 1}          # Megatron's checkpoint call
    recs = read_records(str(tmp_path / "rec"))
    assert [r["digest"] for r in recs] == [batch_digest(i) for i in loader.items]
    assert wrap_train_data_iterator(None, args) is None
    lst = wrap_train_data_iterator([RerunDataIterator(Loader(1)), None], args)
    assert isinstance(lst, list) and lst[1] is None


def test_off_without_the_flag_is_untouched():
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron_mm_balance.megatron.iterator import wrap_train_data_iterator
    args = add_mm_balance_args(argparse.ArgumentParser()).parse_args([])
    it = RerunDataIterator(Loader(1))
    assert wrap_train_data_iterator(it, args) is it


@pytest.mark.parametrize("argv", [[], ["--mm-balance"]])
def test_flag_defaults_to_off(argv):
    args = add_mm_balance_args(argparse.ArgumentParser()).parse_args(argv)
    assert args.mm_balance_record_samples is None
