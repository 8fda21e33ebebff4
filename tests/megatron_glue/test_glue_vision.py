"""``--mm-balance-vision images`` (megatron_mm_balance/megatron/vision.py over the runtime's
images mode) on 4 real gloo processes, two expert-parallel step groups of 2 ([0, 1], [2, 3]), on
a LLaVA-shaped toy model: the model skips its encoder when its pack has no tiles (as Megatron's
LLaVAModel does, its ``imgs`` then the ``[1, 1]`` placeholder), and its "decoder" holds a
collective over the step group in forward and backward (as MoE all-to-alls do). Packs come
through the balanced iterator, once with the tiles balanced and once without (the same pack
placement): equal losses, equal data-parallel-summed gradients, tiles moved inside the groups
only, a tile-less rank encodes others' tiles without a hang, eval forwards are not balanced,
and removing the hooks restores the model. Without expert parallelism one line says nothing
is balanced."""
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
WORLD = 4
STEP_GROUPS = ((0, 1), (2, 3))
G = 3
#: tiles per rank per micro-step: rank 0 heavy, rank 1 none on step 0, no tile at all on step 2
TILES = [[5, 0, 0], [0, 3, 0], [2, 0, 0], [1, 6, 0]]


def test_balanced_vision_equals_unbalanced_forward_and_backward():
    results = run_rank_script(HERE, WORLD)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
    for res in results:
        assert res["loss_diff"] <= 1e-12, res
        assert res["grad_diff"] <= 1e-12, res
        assert res["eval_equal"] and res["restored"]
    moved = sum(r["tiles_moved"] for r in results if r["rank"] in (0, 2))
    assert moved > 0
    assert any(r["encoded_for_others_only"] for r in results)          # a tile-less rank encoded
    for res in results:                                                # never raised, within the group
        assert all(a <= b for b, a in res["max"]), res["max"]


def test_without_expert_parallelism_one_line_and_nothing_installed(capsys):
    from types import SimpleNamespace

    from megatron_mm_balance.megatron.vision import NOTHING_TO_BALANCE, vision_balance_for
    cfg = SimpleNamespace(vision="images", megatron=SimpleNamespace(expert_model_parallel_size=1))
    assert vision_balance_for(object(), cfg, None, rank=0) is None
    assert NOTHING_TO_BALANCE in capsys.readouterr().out


def _rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_mm_balance.megatron.vision import install_vision_balance
    from megatron_mm_balance.runtime.iterator import BalancedDataIterator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        vision_group = dist.new_group(list(range(world)))
        exchange = dist.new_group(list(range(world)), backend="gloo")
        ep = [dist.new_group(list(g)) for g in STEP_GROUPS][rank // 2]

        class AllReduceSum(torch.autograd.Function):        # a collective both ways, like EP
            @staticmethod
            def forward(ctx, x):
                y = x.clone()
                dist.all_reduce(y, group=ep)
                return y

            @staticmethod
            def backward(ctx, g):
                g = g.clone()
                dist.all_reduce(g, group=ep)
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

            def forward(self, images, input_ids, weight):
                has_images = images is not None and images.shape[0] > 0
                img = (self.vision_model(images) * weight[: images.shape[0]]).sum(dim=(0, 1)) if has_images else 0
                h = self.language_model.embedding(input_ids) + img
                h = AllReduceSum.apply(self.decoder(h)) / 2
                return (h ** 2).mean()

        def pack(gb, k):
            g = torch.Generator().manual_seed(100 * gb + 10 * k + rank)
            n = TILES[rank][k] if gb == 0 else int(torch.randint(0, 4, (), generator=g))
            imgs = torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64) if n else torch.zeros(1, 1)
            return {"imgs": imgs, "ids": torch.arange(5) % 10, "weight": torch.rand(8, 1, 1, generator=g,
                                                                                     dtype=torch.float64)}

        def train(model, frames):
            source = iter([pack(gb, k) for gb in range(2) for k in range(G)])
            it = BalancedDataIterator(source, num_microbatches=G, exchange_group=exchange, timeout=30,
                                      cost_fn=lambda p: 0 if p["imgs"].dim() < 4 else p["imgs"].shape[0],
                                      frames=frames)
            losses = []
            with it:
                for _ in range(2 * G):
                    p = next(it)
                    images = None if p["imgs"].dim() < 4 else p["imgs"]
                    loss = model(images, p["ids"], p["weight"])
                    loss.backward()
                    losses.append(float(loss))
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)                           # what data-parallel reduction sums
            return losses, flat

        ref_losses, ref_grads = train(ToyLLaVA().double(), None)
        model = ToyLLaVA().double()
        ahead, chunk, balanced = install_vision_balance(model, STEP_GROUPS, vision_group, timeout=30)
        seen = []
        report = balanced.report

        def count(frames):
            seen.append(frames)
            report(frames)
        balanced.steps.report = count
        losses, grads = train(model, ahead)
        model.eval()
        with torch.no_grad():
            p = pack(0, 0)
            images = None if p["imgs"].dim() < 4 else p["imgs"]
            eval_equal = float(model(images, p["ids"], p["weight"])) == \
                float(ToyLLaVA().double().eval()(images, p["ids"], p["weight"]))
        balanced.remove()
        figures = [f.figures for f in seen if f.figures is not None]
        res = {"rank": rank, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
               "grad_diff": float((grads - ref_grads).abs().max()),
               "tiles_moved": sum(f.frames_moved for f in figures),
               "encoded_for_others_only": sum(1 for f in seen if f.received is not None and f.local_rows == 0),
               "max": [[f.patches_max_before, f.patches_max_after] for f in figures], "chunk": chunk,
               "eval_equal": eval_equal,
               "restored": "forward" not in vars(model.vision_model) and not model._forward_pre_hooks}
    except BaseException as e:                              # reported, not hidden
        import traceback
        res = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
