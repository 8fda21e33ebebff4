"""Bad inputs to ``mm_balance.vision=images`` fail on every rank of the exchange group with one
line naming the rank, instead of hanging the others (3 gloo processes; the glue's frame reader on
packs whose pixel rows and grids are given as the tower would receive them, Bridge's own
``reorganize_inputs`` left out: no Bridge needed, seconds). Rank 1's pack holds one pixel row
fewer than its grid's patches: the exchange thread's read of the batch's frames refuses it at
the batch's meeting, rank 1 raises its own error and its peers name it with its message."""
import json
import os
import sys

from megatron_mm_balance.testing.ranks import run_rank_script
import pytest

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

HERE = os.path.abspath(__file__)
MESSAGE = "pixel rows (7) are not its frames' patches (8, each a multiple of 4)"


def test_bad_pixel_rows_fail_on_every_rank_in_one_line():
    results = run_rank_script(HERE, 3, timeout=120)
    for r, res in enumerate(results):
        assert "unexpected" not in res and "error" in res, f"rank {r}: {res}"
        assert "\n" not in res["error"] and MESSAGE in res["error"], res
    assert results[1]["error"].startswith("ValueError: mm_balance.vision=images: a pack's"), results[1]
    for r in (0, 2):
        assert results[r]["error"].startswith("PeerFailure: images mode: rank 1: reading its packs' units raised"), \
            results[r]


def _rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    import datetime
    import types

    import torch
    import torch.distributed as dist

    from megatron_mm_balance.bridge.vision import FrameReader
    from megatron_mm_balance.runtime.frame_ahead import FrameAhead
    from megatron_mm_balance.runtime.iterator import BalancedDataIterator

    class Reader(FrameReader):
        def _tower_input(self, pack):                       # what the tower would receive
            return pack["pixels"], pack["grid"]

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model = types.SimpleNamespace(image_token_id=1, video_token_id=2, square_merge_size=4)
    rows = 7 if rank == 1 else 8                            # rank 1: one row short of 1 x 2 x 4
    pack = {"pixels": torch.randn(rows, 8), "grid": torch.tensor([[1, 2, 4]])}
    ahead = FrameAhead(Reader(model, lambda p: p * p), [list(range(world))])
    res = {}
    try:
        with BalancedDataIterator(iter([pack]), num_microbatches=1, cost_fn=lambda p: 1, timeout=30,
                                  frames=ahead) as it:
            next(it)
        res["unexpected"] = "no error"
    except (ValueError, RuntimeError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
    except BaseException as e:                              # reported, not hidden
        res["unexpected"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
