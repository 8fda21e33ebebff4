"""Bad inputs to ``mm_balance.vision=images`` fail on every rank of the vision group with one
line naming the rank, instead of hanging the others (3 gloo processes, a toy model of the
shape the hooks expect; no Bridge needed, seconds)."""
import json
import os
import sys

from megatron_mm_balance.testing.ranks import run_rank_script
import pytest

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

HERE = os.path.abspath(__file__)


def test_bad_pixel_rows_fail_on_every_rank_in_one_line():
    results = run_rank_script(HERE, 3, timeout=120)
    for r, res in enumerate(results):
        assert "unexpected" not in res, f"rank {r}: {res}"
        assert res["error"] == ("ValueError: mm_balance.vision=images: rank 1 of the vision group: its pixel "
                                "rows are not the patches of its grids (sum of t*h*w)"), res
        assert res["then"] == "no frame anywhere: None"     # the group still works afterwards


def _toy_model():
    import types

    import torch

    class Tower(torch.nn.Module):
        spatial_merge_size = 2

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 4)

        def forward(self, hidden_states, grid_thw, inference_params=None, extra_block_kwargs=None):
            merged = self.proj(hidden_states.reshape(-1, 4, 8).mean(1))
            return merged, [merged * 2]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_model = Tower()
            self.language_model = torch.nn.Module()
            self.language_model.embedding = torch.nn.Embedding(10, 4)
            self.config = types.SimpleNamespace(hidden_size=4)
            self.vision_transformer_config = types.SimpleNamespace(deepstack_visual_indexes=[0])

    return Model()


def _rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_mm_balance.bridge.vision import BalancedFrames
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    hooks = BalancedFrames(_toy_model(), None, frame_cost=lambda p: p * p)
    grid = torch.tensor([[1, 2, 4]])                        # 8 patch rows
    rows = 7 if rank == 1 else 8                            # rank 1: one row short
    res = {}
    try:
        hooks.exchange(torch.randn(rows, 8), grid)
        res["unexpected"] = "no error"
    except ValueError as e:
        res["error"] = f"{type(e).__name__}: {e}"
    except BaseException as e:                              # reported, not hidden
        res["unexpected"] = f"{type(e).__name__}: {e}"
    res["then"] = f"no frame anywhere: {hooks.exchange(None, None)}"
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
