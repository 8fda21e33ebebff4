"""The image exchange on real gloo processes: balanced encoding equals the unbalanced
encoder forward and backward (embeddings, image gradients, encoder gradients)."""
import json
import os
import sys

import pytest

from megatron_mm_balance.testing.ranks import run_rank_script

HERE = os.path.abspath(__file__)


@pytest.mark.parametrize("world", [2, 3])
def test_balanced_encoding_is_exact_forward_and_backward(world):
    results = run_rank_script(HERE, world)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
    moved = {res["moved"] for res in results}
    assert len(moved) == 1 and moved.pop() > 0          # same plan everywhere, images moved
    for res in results:
        assert res["encoded"] != res["local"] or res["rank"] != 0   # rank 0 (heavy) gave some away
        assert res["emb_diff"] <= 1e-12
        assert res["image_grad_diff"] <= 1e-12
        assert res["param_grad_diff"] <= 1e-12


def _rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_mm_balance.runtime.image_exchange import (ImageExchange, ImagePlan,
                                                            gather_image_costs)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(1000 + rank)
        n = [9, 2, 0, 3][rank]                              # rank 0 heavy, rank 2 none
        images = torch.randn(n, 3, 4, generator=g, dtype=torch.float64)
        costs = [100 + 37 * i for i in range(n)]            # integer cost per image

        def encoder():
            torch.manual_seed(7)                            # the same weights on every rank
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5),
                                       torch.nn.Tanh()).double()

        weight = torch.linspace(-1, 1, 5, dtype=torch.float64) * (rank + 1)

        def loss_of(emb):
            return (emb * weight).sum() + (emb ** 2).sum() * 0.1

        def reduced_grads(model):
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)
            return flat

        ref_model = encoder()
        ref_images = images.clone().requires_grad_(True)
        ref_emb = ref_model(ref_images)
        loss_of(ref_emb).backward()
        ref_grads = reduced_grads(ref_model)

        model = encoder()
        imgs = images.clone().requires_grad_(True)
        plan = ImagePlan.from_costs(gather_image_costs(costs))
        ex = ImageExchange(plan)
        emb = ex.to_owners(model(ex.to_encoders(imgs)))
        loss_of(emb).backward()
        grads = reduced_grads(model)
        res = {"rank": rank, "moved": plan.moved(), "local": ex.num_local,
               "encoded": ex.num_encoded,
               "emb_diff": float((emb - ref_emb).abs().max()) if n else 0.0,
               "image_grad_diff": float((imgs.grad - ref_images.grad).abs().max()) if n else 0.0,
               "param_grad_diff": float((grads - ref_grads).abs().max())}
    except BaseException as e:                              # reported, not hidden
        import traceback
        res = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
