"""The CPU harness itself: its stand-ins, its refusals and its launcher's hard timeout.

Budget: ~25 s on 2 cores (three launches of 2 processes).
"""
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_mm_balance.testing import cpu_megatron  # noqa: E402
from megatron_mm_balance.testing.cpu_megatron import LaunchError, launch  # noqa: E402

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath


def _patched_world(rank, world):
    # Runs in a launched process, where install() is active.
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert torch.zeros(1, device=0).device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.cuda.current_device() == "cpu"
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    cpu_megatron.initialize(tensor_model_parallel_size=1)
    x = torch.full((1,), float(rank + 1), device=torch.cuda.current_device())
    dist.all_reduce(x, group=ps.get_data_parallel_group())
    return {"tp": ps.get_tensor_model_parallel_world_size(), "dp_sum": float(x),
            "dp": ps.get_data_parallel_world_size()}


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)


def _hang(rank, world):
    time.sleep(600)


def test_stand_ins_and_parallel_state():
    out = launch(_patched_world, 2, timeout=120)
    assert [o["tp"] for o in out] == [1, 1]
    assert [o["dp"] for o in out] == [2, 2]
    assert [o["dp_sum"] for o in out] == [3.0, 3.0]


def test_rank_error_is_reported_and_processes_end():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="(?s)rank 1 failed.*rank one is broken"):
        launch(_fail_on_rank_one, 2, timeout=120)
    assert time.monotonic() - t0 < 60, "the healthy rank was waited for instead of killed"


def test_hang_is_killed_at_timeout():
    with pytest.raises(LaunchError, match="timeout"):
        launch(_hang, 2, timeout=8)


def test_refuses_what_cpu_cannot_run():
    from types import SimpleNamespace
    with pytest.raises(ValueError, match="sequence_parallel"):
        cpu_megatron.check_config(SimpleNamespace(sequence_parallel=True, num_moe_experts=None))
    with pytest.raises(ValueError, match="allgather"):
        cpu_megatron.check_config(SimpleNamespace(sequence_parallel=False, num_moe_experts=4,
                                                  moe_token_dispatcher_type="alltoall"))
    cpu_megatron.check_config(SimpleNamespace(sequence_parallel=False, num_moe_experts=4,
                                              moe_token_dispatcher_type="allgather"))


def test_the_config_sizes_the_cpu_vision_encoder(monkeypatch):
    """MM_BALANCE_CPU_VIT=LAYERS,HIDDEN,HEADS,FFN sizes the CLIP the harness builds
    (configs/megatron/vision_heavy_cpu.sh exports one); unset: the tiny default; bad: one line."""
    from megatron_mm_balance.testing.cpu_pretrain import TINY_VIT, VIT_ENV, vit_size
    monkeypatch.delenv(VIT_ENV, raising=False)
    assert vit_size() == TINY_VIT
    assert vit_size("8,512,8,2048") == dict(num_layers=8, hidden_size=512, num_attention_heads=8,
                                            num_query_groups=8, kv_channels=64, ffn_hidden_size=2048)
    monkeypatch.setenv(VIT_ENV, "6, 384, 6, 1536")
    assert vit_size()["hidden_size"] == 384
    for bad in ("6,384", "6,384,5,1536", "a,b,c,d", "0,64,4,128"):
        with pytest.raises(SystemExit, match=VIT_ENV):
            vit_size(bad)
    config = open(__file__.replace("tests/megatron/test_cpu_harness.py",
                                   "configs/megatron/vision_heavy_cpu.sh")).read()
    assert "export MM_BALANCE_CPU_VIT=${MM_BALANCE_CPU_VIT:-8,512,8,2048}" in config
