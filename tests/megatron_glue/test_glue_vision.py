"""``--mm-balance-vision images`` hooks (megatron_mm_balance/megatron/vision.py) on real gloo
processes, on a LLaVA-shaped toy model: the model skips its encoder when its pack has no
tiles (as Megatron's LLaVAModel does), and its "decoder" holds a collective in forward
and backward (as MoE all-to-alls do). Balanced vs unbalanced: equal losses, equal
data-parallel-summed gradients, same plan on every rank, tiles moved, a tile-less rank
encodes others' tiles without a hang, a micro-step with no tiles anywhere passes, eval
forwards are not balanced, and removing the hooks restores the model."""
from __future__ import annotations

import json
import os
import sys

from megatron_mm_balance.testing.ranks import run_rank_script
import pytest

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

HERE = os.path.abspath(__file__)

#: tiles per rank per micro-step (world 3): rank 0 heavy, rank 1 none on step 0, step 2 empty
TILES = [[5, 0, 1], [2, 3, 0], [0, 0, 0], [1, 6, 2]]


def test_balanced_vision_equals_unbalanced_forward_and_backward():
    results = run_rank_script(HERE, 3)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
    assert len({json.dumps(res["plans"]) for res in results}) == 1     # one plan everywhere
    for res in results:
        assert res["loss_diff"] <= 1e-12, res
        assert res["grad_diff"] <= 1e-12, res
        assert res["tiles_moved"] > 0 and res["microsteps"] == 3       # step 2 had no tiles
        assert res["eval_equal"] and res["restored"]
    assert results[1]["encoded_for_others_only"] >= 1                  # rank 1 had none on step 0
    assert all(after <= before for before, after in zip(results[0]["max_before"], results[0]["max_after"]))
    assert results[0]["max_after"][0] == 2                             # 6 tiles: 2 per rank
    assert results[0]["max_sums"] == [sum(results[0]["max_before"]), sum(results[0]["max_after"])]


def _rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_mm_balance.megatron.vision import BalancedVision

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        vision_group = dist.new_group(list(range(world)))

        class AllReduceSum(torch.autograd.Function):        # a collective both ways, like EP
            @staticmethod
            def forward(ctx, x):
                y = x.clone()
                dist.all_reduce(y)
                return y

            @staticmethod
            def backward(ctx, g):
                g = g.clone()
                dist.all_reduce(g)
                return g

        class Vision(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(12, 8)

            def forward(self, images):                      # per tile: [n, 3, 2, 2] -> [n, 2, 4]
                return torch.tanh(self.proj(images.flatten(1))).view(-1, 2, 4)

        class Text(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embedding = torch.nn.Embedding(10, 4)

        class ToyLLaVA(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(3)                        # the same weights on every rank
                self.vision_model, self.language_model = Vision(), Text()
                self.decoder = torch.nn.Linear(4, 4)

            def forward(self, images, input_ids):
                has_images = images is not None and images.shape[0] > 0
                img = self.vision_model(images).sum(dim=(0, 1)) if has_images else 0
                h = self.language_model.embedding(input_ids) + img
                h = AllReduceSum.apply(self.decoder(h)) / world
                return (h ** 2).mean() * (rank + 1)

        def batch(step):
            g = torch.Generator().manual_seed(100 * step + rank)
            n = TILES[step][rank]
            return torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64), torch.arange(5) % 10

        def train(model):
            losses = []
            for step in range(len(TILES)):
                images, ids = batch(step)
                loss = model(images, ids)
                loss.backward()
                losses.append(float(loss))
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)                           # what data-parallel reduction sums
            return losses, flat

        ref_losses, ref_grads = train(ToyLLaVA().double())
        model = ToyLLaVA().double()
        balanced = BalancedVision(model, vision_group)
        plans = []
        original = balanced._count

        def count(plan, exchange, num_local):
            plans.append([plan.owner.tolist(), plan.encoder.tolist()])
            original(plan, exchange, num_local)

        balanced._count = count
        losses, grads = train(model)
        model.eval()
        with torch.no_grad():
            images, ids = batch(0)
            eval_equal = float(model(images, ids)) == float(ToyLLaVA().double().eval()(images, ids))
        balanced.remove()
        s = balanced.stats
        res = {"plans": plans, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
               "grad_diff": float((grads - ref_grads).abs().max()), "tiles_moved": s.tiles_moved,
               "microsteps": s.microsteps, "encoded_for_others_only": s.encoded_for_others_only,
               "max_before": [int(np.bincount(o, minlength=world).max()) for o, _ in plans],
               "max_after": [int(np.bincount(e, minlength=world).max()) for _, e in plans],
               "max_sums": [s.max_before_sum, s.max_after_sum], "eval_equal": eval_equal,
               "restored": "forward" not in vars(model.vision_model) and not model._forward_pre_hooks}
    except BaseException as e:                              # reported, not hidden
        import traceback
        res = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
