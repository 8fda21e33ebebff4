"""Single-process behaviour: pass-through, world size 1, cost keys, wire format,
argument checks, background-thread errors, close()."""
import collections
import threading

import pytest
import torch

from megatron_mm_balance import BalancedDataIterator
from megatron_mm_balance.runtime import BalancerError, ImageTokenCost, default_cost_fn, wire


def _packs(n):
    return [{"image_tokens": torch.tensor(i % 5), "x": torch.arange(i + 1), "s": f"p{i}"} for i in range(n)]


def _exchange_threads():
    return sum(t.name == "mm-balance-exchange" for t in threading.enumerate())


def test_disabled_is_pass_through_without_threads():
    items = _packs(7)
    before = _exchange_threads()
    it = BalancedDataIterator(iter(items), num_microbatches=3, enabled=False)
    assert _exchange_threads() == before
    got = list(it)
    assert len(got) == 7 and all(a is b for a, b in zip(got, items))
    assert it.last_stats is None
    it.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_world_one_delivers_in_order_and_stops_at_boundary(overlap):
    items = _packs(8)
    with BalancedDataIterator(iter(items), num_microbatches=3, overlap=overlap) as it:
        got = list(it)
        assert [g["s"] for g in got] == [f"p{i}" for i in range(6)]
        assert it.exhaustion.global_batch == 2 and it.exhaustion.not_delivered == 2
        assert it.last_stats.global_batch == 1 and len(it.stats) == 2
        assert it.stats[0].num_microbatches == 3 and it.stats[0].packs_moved == 0
    assert _exchange_threads() == 0


def test_device_cpu_copies_and_rejects_unknown():
    items = _packs(2)
    with BalancedDataIterator(iter(items), num_microbatches=2, device="cpu") as it:
        got = list(it)
    assert torch.equal(got[1]["x"], items[1]["x"])
    with pytest.raises(ValueError, match="device"):
        BalancedDataIterator(iter(items), num_microbatches=2, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            BalancedDataIterator(iter(items), num_microbatches=2, device="cuda")


def test_background_thread_error_surfaces_on_next():
    def src():
        yield {"image_tokens": 1}
        yield {"image_tokens": 1}
        raise ValueError("broken shard")
    it = BalancedDataIterator(src(), num_microbatches=2, overlap=True)
    next(it), next(it)
    with pytest.raises(ValueError, match="broken shard"):
        next(it)
    with pytest.raises(BalancerError, match="failed earlier"):
        next(it)
    it.close()
    it.close()                                   # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        next(it)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_microbatches"):
        BalancedDataIterator(iter([]), num_microbatches=0)
    with pytest.raises(ValueError, match="sync"):
        BalancedDataIterator(iter([]), num_microbatches=1, sync="never")
    it = BalancedDataIterator(iter(_packs(3)), num_microbatches=lambda: -1)
    with pytest.raises(ValueError, match="num_microbatches returned -1"):
        next(it)
    it.close()
    it = BalancedDataIterator(iter(_packs(3)), num_microbatches=1, cost_fn=lambda p: float("nan"))
    with pytest.raises(ValueError, match="finite"):
        next(it)
    it.close()


def test_abandoned_iterator_joins_its_thread():
    it = BalancedDataIterator(iter(_packs(10)), num_microbatches=2)
    next(it)
    del it
    import gc
    gc.collect()
    assert _exchange_threads() == 0


def test_default_cost_keys():
    c = ImageTokenCost(tokens_per_tile=10)
    assert c({"image_tokens": 7, "num_image_tokens": 99}) == 7
    assert c({"image_tokens": torch.tensor([5])}) == 5
    assert c({"num_image_tokens": torch.tensor(3)}) == 3
    assert c({"num_tiles": torch.tensor([2, 3])}) == 50
    assert c({"num_tiles": 4}) == 40
    assert c({"imgs": torch.zeros(6, 3, 2, 2)}) == 60
    assert c({"tokens": torch.zeros(9)}) == 0 and c("not a dict") == 0
    assert default_cost_fn({"num_tiles": 1}) == 256
    assert c({"image_tokens": torch.tensor([3, 4])}) == 7      # micro-batch of two packs: summed
    with pytest.raises(ValueError, match="image_tokens"):
        c({"image_tokens": "seven"})
    with pytest.raises(ValueError, match="tokens_per_tile"):
        ImageTokenCost(tokens_per_tile=0)


NT = collections.namedtuple("NT", "a b")      # module level: the header pickles the class by name


def test_wire_round_trip_is_bit_identical():
    pack = {"bf": torch.randn(3, 5).to(torch.bfloat16), "t": torch.randn(4, 6).t(),
            "empty": torch.zeros(0, 7), "scalar": torch.tensor(2.5, dtype=torch.float64),
            "bool": torch.tensor([True, False]), "c": torch.tensor([1 + 2j]),
            "nest": [NT(torch.arange(3), "x"), (None, 3, {"k": torch.ones(2, dtype=torch.int8)})],
            "od": collections.OrderedDict(z=1), "str": "hello"}
    header, data = wire.encode(pack)
    out = wire.decode(header, lambda ref: data)
    sp = wire.split(pack)                                   # the send path: header + byte views
    assert wire.read_header(torch.frombuffer(bytearray(sp.header), dtype=torch.uint8)) == header
    assert sp.data_nbytes == data.numel()
    assert sp.parts[0].data_ptr() == pack["bf"].data_ptr()   # contiguous tensors: no copy
    assert out["str"] == "hello" and out["od"] == collections.OrderedDict(z=1)
    assert isinstance(out["nest"][0], NT) and out["nest"][0].b == "x"
    assert out["nest"][1][:2] == (None, 3)
    for a, b in [(out["bf"], pack["bf"]), (out["t"], pack["t"]), (out["empty"], pack["empty"]),
                 (out["scalar"], pack["scalar"]), (out["bool"], pack["bool"]), (out["c"], pack["c"]),
                 (out["nest"][0].a, pack["nest"][0].a), (out["nest"][1][2]["k"], pack["nest"][1][2]["k"])]:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                           b.contiguous().reshape(-1).view(torch.uint8) if b.numel() else b)


def _transport(device=None):
    from megatron_mm_balance.runtime.transport import PackTransport
    return PackTransport(None, [0], 0, timeout=1.0, device=device)


def test_cuda_tagged_tensors_use_the_mover_and_keep_host_tensors():
    """The device branch of the transport, with a stand-in for the CUDA side stream."""
    import dataclasses

    class FakeMover:
        def to_device(self, buf):
            return buf.clone(), "event"

    eng = _transport()
    eng.cuda_mover = FakeMover()
    pack = {"on_gpu": torch.arange(6.0), "on_cpu": torch.ones(3, dtype=torch.int8), "k": "v"}
    header, data = wire.encode(pack)
    header["on_gpu"] = dataclasses.replace(header["on_gpu"], device_type="cuda")
    item = eng.place(header, data)
    assert item.event == "event" and len(item.buffers) == 1
    assert item.pack["on_gpu"].data_ptr() == item.buffers[0].data_ptr()     # on the "device" buffer
    assert item.pack["on_cpu"].untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    assert torch.equal(item.pack["on_gpu"], pack["on_gpu"]) and item.pack["k"] == "v"


def test_cuda_tensors_without_cuda_is_a_clear_error():
    import dataclasses
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    eng = _transport()
    header, data = wire.encode({"x": torch.zeros(2)})
    header["x"] = dataclasses.replace(header["x"], device_type="cuda")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        eng.place(header, data)
