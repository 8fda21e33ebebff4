"""Which CUDA device and stream each thread of the exchange uses, checked on a CPU with a
fake CUDA (:mod:`megatron_mm_balance.testing.fake_cuda`) on real gloo ranks."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "rt_harness", os.path.join(os.path.dirname(__file__), "rt_harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def test_exchange_thread_runs_on_its_ranks_device():
    """4 ranks, rank r on device r: the exchange thread's first CUDA call selects device r (a
    new thread starts on device 0), and every pull from the source happens there."""
    world = 4
    res = harness.launch(world, "thread_device", hard_timeout=120)
    for rank, x in enumerate(res):
        assert "first_call" in x, f"rank {rank}: {x.get('error') or x}\n{x.get('log', '')}"
        assert x["first_call"] == ["set_device", rank], x
        assert x["set_device"] == [rank, rank], x            # the training thread's, then the exchange's
        assert x["pull_threads"] == ["mm-balance-exchange"] and x["pull_devices"] == [rank], x
    assert sum(x["moved"] for x in res) > 0                  # packs crossed ranks on the way
    # delivery to the (fake) device, same ranks: every pack arrives intact, on the device
    names = {"mm-balance pull", "mm-balance all-gather", "mm-balance solve", "mm-balance exchange",
             "mm-balance copy to device", "mm-balance wait"}
    for rank, x in enumerate(res):
        assert x["delivered_ok"] and x["delivered_types"] == ["FakeDeviceTensor"], rank
        # copies: on the exchange thread, on the rank's device, on the side stream only
        assert x["copies"] and all(t == "mm-balance-exchange" and d == rank and s.startswith("side")
                                   for _, t, d, s in x["copies"]), x["copies"][:4]
        # staged through the pool (received packs, unpinned local ones) and straight from the
        # loader's pinned tensors (the odd draws)
        assert {"to_device", "copy_async"} <= {c for c, _, _, _ in x["copies"]}
        # the consumer, per delivered pack: its stream waits on the pack's event, the allocator
        # learns of the use on that stream, and nothing is copied on the training thread
        for calls in x["protocol"]:
            kinds = [c for c, _ in calls if not c.startswith("range_")]
            assert kinds.count("wait_event") == 1 and "record_stream" in kinds, calls
            assert set(kinds) == {"wait_event", "record_stream"}, calls
            assert all(s == f"default:{rank}" for c, s in calls if c in ("wait_event", "record_stream"))
        for thread, seq in x["ranges"].items():               # NVTX ranges open and close
            pushed = [n for n in seq if n is not None]
            assert len(pushed) == seq.count(None) and set(pushed) <= names, (thread, seq[:8])
        assert {n for seq in x["ranges"].values() for n in seq if n} == names
        mid, end = x["pools"]                                 # the pinned pool: reused, not grown
        assert mid["bytes"] == end["bytes"] and mid["buffers"] == end["buffers"], x["pools"]
        assert end["overflows"] == 0 and end["reused"] > end["takes"] // 2, end
    assert sum(x["cuda_moved"] for x in res) > 0
    # the descriptor check: the last rank is short, every rank stops with its one-line error
    for x in res:
        err = x["mesh_error"]
        assert err and "\n" not in err and f"rank {world - 1}: not enough file descriptors" in err, err
        assert "ulimit -n" in err and f"(this one of {world} ranks) need" in err, err


# -- the pinned pool on its own (a fake CUDA's "pinned" memory; events we complete by hand) --

class _Event:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done

    def record(self, stream=None):
        self.stream = stream


def _pool(cap):
    from megatron_mm_balance.runtime.device import PinnedPool
    from megatron_mm_balance.testing.fake_cuda import FakeCuda
    api = FakeCuda()
    api.new_event = _Event
    return PinnedPool(cap, api), api


def test_pool_reuses_a_buffer_once_its_copy_is_done():
    import gc
    pool, api = _pool(1 << 20)
    a = pool.take(1000)
    ptr, event = a.data_ptr(), _Event()
    pool.release_after(a, event)
    del a
    gc.collect()
    b = pool.take(900)                       # the copy is still in flight: a new buffer
    assert b.data_ptr() != ptr and pool.stats().buffers == 2
    event.done = True
    c = pool.take(1000)                      # done: the first buffer again
    assert c.data_ptr() == ptr and pool.stats().reused == 1 and api.pinned_allocations == 2


def test_pool_host_delivery_waits_for_the_views_and_the_consumer_fence():
    import gc
    pool, _ = _pool(1 << 20)
    a = pool.take(4096)
    ptr = a.data_ptr()
    view = a[64:128].view(__import__("torch").int32)        # what a delivered pack holds
    del a
    gc.collect()
    pool.fence("compute stream")             # a view is alive: nothing to fence
    assert pool.take(4096).data_ptr() != ptr
    del view
    gc.collect()
    assert pool.take(4096).data_ptr() != ptr                # gone, but not fenced yet
    pool.fence("compute stream")             # the consumer's next delivery: fenced ...
    fence = [s.fence for s in pool._slabs if s.tensor.data_ptr() == ptr][0]
    assert fence.stream == "compute stream" and pool.take(4096).data_ptr() != ptr
    fence.done = True                        # ... and reusable once that completes
    assert pool.take(4096).data_ptr() == ptr


def test_pool_never_grows_past_its_cap():
    pool, _ = _pool(1 << 18)                 # 256 KiB: four 64 KiB buffers
    held = [pool.take(60_000) for _ in range(4)]
    spill = pool.take(60_000)                # full: pageable memory, counted
    st = pool.stats()
    assert st.bytes == 1 << 18 and st.buffers == 4 and st.overflows == 1 and spill.numel() == 60_000
    assert pool.take(1 << 19).numel() == 1 << 19 and pool.stats().overflows == 2   # bigger than the cap
    del held



def test_descriptor_budget_names_the_need_at_dp_1024():
    from megatron_mm_balance.runtime.mesh import descriptor_budget
    b = descriptor_budget(1024, 1, open_now=100, limits=(1024, 4096))
    assert (b.sockets, b.needed, b.fits) == (1024, 1380, False)     # 1,023 peers + a listener
    assert "`ulimit -n 1380`" in b.error(7) and b.error(7).startswith("mm-balance: rank 7: ")
    assert descriptor_budget(1024, 2, open_now=100, limits=(4096, 4096)).needed == 2404   # two chunks
    assert descriptor_budget(1, 1, open_now=10, limits=(64, 64)).sockets == 0            # no peers


def test_lazy_gloo_sets_the_switch_only_around_the_groups(monkeypatch):
    import os
    from megatron_mm_balance.runtime import mesh
    monkeypatch.delenv(mesh.LAZY_ENV, raising=False)
    with mesh.lazy_gloo() as lazy:
        assert lazy == mesh.gloo_lazy_init_supported() and os.environ.get(mesh.LAZY_ENV) == ("1" if lazy else None)
    assert mesh.LAZY_ENV not in os.environ
    monkeypatch.setenv(mesh.LAZY_ENV, "0")                        # the user's choice wins
    with mesh.lazy_gloo() as lazy:
        assert lazy is False and os.environ[mesh.LAZY_ENV] == "0"
