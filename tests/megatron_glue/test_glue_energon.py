"""The energon TaskEncoder mixin: best-fit packing and per-pack image tokens in the batch."""
import dataclasses
from typing import List

import pytest
import torch

from megatron_mm_balance.megatron.energon import BalancedPackingMixin, balanced_task_encoder
from megatron_mm_balance.cost.pack import ImageTokenCost
from megatron_mm_balance.data.packing import OverlongSampleError


@dataclasses.dataclass
class Sample:                       # the fields of examples/multimodal's ImageTaskSample we use
    key: str
    num_tiles: List[int]
    total_len: int


class StockEncoder:
    """Duck-typed stand-in for examples/multimodal's TaskEncoder (energon's hooks)."""
    packing_seq_length = 100
    num_image_embeddings_per_tile = 10

    def select_samples_to_pack(self, samples):
        raise AssertionError("the mixin must replace the stock packer")

    def batch(self, samples):
        return Batch(num_tiles=torch.tensor([n for s in samples for n in s.num_tiles] or [0]),
                     keys=[s.key for s in samples])

    def encode_batch(self, batch):
        return {"num_tiles": batch.num_tiles, "keys": batch.keys}


@dataclasses.dataclass
class Batch:
    num_tiles: torch.Tensor
    keys: list


class Encoder(BalancedPackingMixin, StockEncoder):
    pass


def samples():
    # lengths 60, 50, 40, 30, 20, 10 with tiles 3, 0, 2, 1, 0, 1
    spec = [(60, [3]), (50, []), (40, [1, 1]), (30, [1]), (20, []), (10, [1])]
    return [Sample(f"s{i}", tiles, length) for i, (length, tiles) in enumerate(spec)]


def test_best_fit_packs_whole_samples_within_the_sequence():
    enc, ss = Encoder(), samples()
    packs = enc.select_samples_to_pack(ss)
    flat = [s.key for p in packs for s in p]
    assert sorted(flat) == sorted(s.key for s in ss)            # every sample exactly once
    assert all(sum(s.total_len for s in p) <= 100 for p in packs)
    assert len(packs) == 3                                       # 210 tokens: 3 packs is optimal
    assert enc.select_samples_to_pack([]) == []


def test_overlong_sample_is_an_error_naming_it():
    with pytest.raises(OverlongSampleError, match="more than the sequence length 100"):
        Encoder().select_samples_to_pack([Sample("big", [], 101)])


def test_batch_records_image_tokens_per_pack_and_cost_reads_them():
    enc = Encoder()
    # energon's batch() gets the packed samples of one micro-batch: here one pack, tiles 3 + 1.
    pack = Sample("s0+s3", [3, 1], 90)
    batch = enc.batch([pack])
    # Declared fields of the batch type (a subclass of the base's, as energon extends types),
    # not an attribute hidden on the instance.
    assert isinstance(batch, Batch) and type(batch).__name__ == "BalancedBatch"
    assert {f.name for f in dataclasses.fields(batch)} == {"num_tiles", "keys", "image_tokens",
                                                          "image_token_counts"}
    assert (batch.image_tokens, batch.image_token_counts) == ([40], [30, 10])
    assert not [k for k in vars(batch) if k.startswith("_")]
    raw = enc.encode_batch(batch)
    assert raw["image_tokens"].tolist() == [40]
    assert raw["image_token_counts"].tolist() == [30, 10]
    assert ImageTokenCost(10)(raw) == 40
    # Micro-batch size 2: one count per pack.
    raw = enc.encode_batch(enc.batch([pack, Sample("s2", [1, 1], 40)]))
    assert raw["image_tokens"].tolist() == [40, 20] and ImageTokenCost(10)(raw) == 60
    # Without the recorded values (a batch from elsewhere), num_tiles still gives the count.
    raw2 = enc.encode_batch(Batch(num_tiles=torch.tensor([2, 2]), keys=[]))
    assert raw2["image_tokens"].tolist() == [40]


def test_runtime_default_cost_reads_the_recorded_count():
    from megatron_mm_balance.runtime import default_cost_fn
    enc = Encoder()
    raw = enc.encode_batch(enc.batch([samples()[0]]))
    assert default_cost_fn(raw) == 30


def test_needs_packing_seq_length():
    class NoPacking(BalancedPackingMixin, StockEncoder):
        packing_seq_length = None
    with pytest.raises(ValueError, match="--packing-seq-length"):
        NoPacking().select_samples_to_pack(samples())


def test_with_real_energon_default_task_encoder():
    energon = pytest.importorskip("megatron.energon", reason="megatron-energon not installed "
                                  "(pip install megatron-energon)")
    cls = balanced_task_encoder(energon.DefaultTaskEncoder)
    assert issubclass(cls, energon.DefaultTaskEncoder) and issubclass(cls, BalancedPackingMixin)

    class TE(cls):
        packing_seq_length = 100
        num_image_embeddings_per_tile = 10

    packs = TE().select_samples_to_pack(samples())
    assert sorted(s.key for p in packs for s in p) == sorted(s.key for s in samples())


# -- energon's stateless contract --------------------------------------------------------------
def _stateless(fn):
    return bool(getattr(fn, "__stateless__", False))


def test_marks_follow_energons_default_task_encoder():
    energon = pytest.importorskip("megatron.energon", reason="megatron-energon not installed")
    from megatron.energon.task_encoder.base import get_stateless
    assert get_stateless(energon.DefaultTaskEncoder.batch) and get_stateless(energon.DefaultTaskEncoder.encode_batch)
    cls = balanced_task_encoder(energon.DefaultTaskEncoder)
    te = cls()
    assert get_stateless(te.batch) and get_stateless(te.encode_batch)
    assert te._is_overridden(te.batch) and te._is_overridden(te.encode_batch)

    class Sub(cls):                    # a subclass keeps the marks
        packing_seq_length = 100
    assert get_stateless(Sub().batch) and get_stateless(Sub().encode_batch)


def test_unmarked_base_stays_unmarked_unless_declared():
    assert not _stateless(Encoder().batch) and not _stateless(Encoder().encode_batch)
    pytest.importorskip("megatron.energon", reason="megatron-energon not installed")

    from megatron_mm_balance.megatron.energon import stateless_balanced_packing_mixin

    class Declared(stateless_balanced_packing_mixin(), StockEncoder):   # energon's @stateless
        pass
    assert _stateless(Declared().batch) and _stateless(Declared().encode_batch)
    raw = Declared().encode_batch(Declared().batch(samples()[:1]))
    assert raw["image_tokens"].tolist() == [30]

    class Own(BalancedPackingMixin, StockEncoder):   # a class's own batch keeps its own marks
        def batch(self, samples):
            return super().batch(samples)
    assert not _stateless(Own().batch) and Own.batch.__qualname__.endswith("Own.batch")


def test_wrapped_methods_still_record_image_tokens():
    pytest.importorskip("megatron.energon", reason="megatron-energon not installed")
    from megatron_mm_balance.megatron.energon import balanced_example_task_encoder

    te = balanced_example_task_encoder(StockEncoder)
    assert _stateless(te.batch) and _stateless(te.encode_batch)
    assert isinstance(te, StockEncoder) and isinstance(te, BalancedPackingMixin)
    out = te.encode_batch(te.batch(samples()[:3]))
    assert out["image_tokens"].tolist() == [30, 0, 20]
    assert out["image_token_counts"].tolist() == [30, 10, 10]


def test_dict_and_energon_batches_carry_the_fields():
    """A dict batch gets the two keys; an energon Batch is extended with energon's ``extend``
    (the balanced type pickles by name, as energon's worker processes may need)."""
    import pickle
    from megatron_mm_balance.megatron.energon import with_image_tokens
    assert with_image_tokens({"a": 1}, image_tokens=[3], image_token_counts=[3]) == {
        "a": 1, "image_tokens": [3], "image_token_counts": [3]}
    energon = pytest.importorskip("megatron.energon", reason="megatron-energon not installed")

    @dataclasses.dataclass
    class EBatch(energon.Batch):
        num_tiles: list

    b = EBatch(__key__=["k"], __restore_key__=(), __subflavors__=[{}], num_tiles=[2])
    out = with_image_tokens(b, image_tokens=[512], image_token_counts=[512])
    assert isinstance(out, EBatch) and out.num_tiles == [2] and out.__key__ == ["k"]
    assert out.image_tokens == [512]
    assert pickle.loads(pickle.dumps(out)).image_token_counts == [512]


def test_tokens_per_tile_has_no_silent_default():
    class NoTiles(Encoder):
        num_image_embeddings_per_tile = None
    with pytest.raises(ValueError, match="num_image_embeddings_per_tile"):
        NoTiles().mm_balance_tokens_per_tile()

    class Zero(Encoder):
        num_image_embeddings_per_tile = 0
    with pytest.raises(ValueError, match="tokens_per_tile must be an int > 0"):
        Zero().mm_balance_tokens_per_tile()
