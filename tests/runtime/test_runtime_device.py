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
