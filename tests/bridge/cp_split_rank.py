"""One rank of the context-parallel vision test (``python cp_split_rank.py RANK WORLD PORT OUTDIR``).

Runs in the Bridge environment with Megatron-Bridge and its Megatron-LM on ``PYTHONPATH``
and the CPU harness installed. The toy Qwen3-VL vision tower of
``configs/bridge/qwen3_vl_moe_tiny_cpu.py`` (fp32, built by Bridge's own provider, the
same weights on both ranks) encodes native-resolution-like micro-batches (small and
large images and a video) on a context-parallel group of the 2 gloo ranks, through
Bridge's own steps of ``Qwen3VLModel.forward`` under ``vision_dp_when_cp`` (model.py,
the block after ``reorganize_inputs``): ``qwen3vl_cp_split`` (Bridge's, or what
``install_cp_split`` put in its place in Bridge's model module), ``get_vision_cp_data``, ``collapse_thw``, the tower,
``ensure_requires_grad_for_cp_collective`` and ``AllGatherVisionEmbeddings`` for the
embeddings and each deepstack feature. The language model is not run: megatron-core's
context-parallel attention needs transformer-engine.

Per micro-step and split it records the gathered outputs, the gradients of a fixed
linear loss of them w.r.t. the pixels and the tower's parameters (summed over the
context-parallel ranks, as the data-parallel gradient reduction over DP x CP does),
and this rank's vision phase time: the tower's forward plus its backward (the autograd
graph is cut at the gather, so the time holds no communication or waiting; the values
are those of one joint backward). The comparison is repeated with the tower in fp64
(untimed), to tell rounding from a real difference. Each rank writes its JSON.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

RANK, WORLD, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
REPEATS = int(os.environ.get("CP_SPLIT_REPEATS", "3"))

#: Micro-batches of (t, h, w) grids in patches (16 px; every side even: 2 x 2 merge), drawn
#: from make-dataset's Qwen-VL shapes (light 1x1..2x2 merge units, heavy 6x6..8x8) and
#: larger native-resolution frames, with one video per micro-step.
MICRO_BATCHES = (
    ((1, 32, 32), (1, 24, 32), (1, 4, 4), (1, 2, 4), (1, 4, 2), (4, 8, 8)),
    ((1, 2, 2), (1, 4, 4), (1, 2, 4), (6, 8, 12), (1, 32, 24), (1, 16, 16)),
    ((2, 16, 16), (1, 4, 4), (1, 2, 2), (1, 4, 4), (1, 2, 2), (1, 40, 24)),
    ((1, 16, 16), (1, 16, 12), (1, 12, 16), (1, 16, 16), (4, 4, 4)),
)


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    from megatron_mm_balance.testing import cpu_bridge
    cpu_bridge.install()
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    ps.initialize_model_parallel()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cp_group = dist.new_group(list(range(WORLD)), backend="gloo")

    import types

    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import utils as qutils
    from megatron_mm_balance.bridge.config import MMBalanceBridgeConfig
    from megatron_mm_balance.bridge.cp_split import frame_cost_for, install_cp_split
    from megatron_mm_balance.bridge.model_spec import ModelSpec

    provider = _provider()
    tower = provider.provide(pre_process=True, post_process=True).vision_model
    lm_hidden = provider.hidden_size
    for p in tower.parameters():                       # the same weights on every rank
        dist.broadcast(p.data, src=0)
    # the glue's own installation into Bridge's loaded model module, as under CP=2
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as qmodel
    count_split = qmodel.qwen3vl_cp_split
    cfg = types.SimpleNamespace(mm_balance=MMBalanceBridgeConfig(enabled=True), model=types.SimpleNamespace(
        context_parallel_size=2, vision_dp_when_cp=True, vision_config=provider.vision_config))
    assert count_split is qutils.qwen3vl_cp_split and install_cp_split(cfg.mm_balance, ModelSpec.read(cfg.model))
    splits = {"count": count_split, "cost": qmodel.qwen3vl_cp_split}
    frame_cost = frame_cost_for(ModelSpec.read(provider))
    merge = provider.vision_config.spatial_merge_size ** 2
    in_dim = 3 * provider.vision_config.temporal_patch_size * provider.vision_config.patch_size ** 2

    rows, diffs = _compare(tower, splits, frame_cost, merge, in_dim, lm_hidden, cp_group, qutils,
                           torch.float32, REPEATS)
    tower.double()                                        # the same comparison in fp64: rounding only
    _, diffs64 = _compare(tower, splits, frame_cost, merge, in_dim, lm_hidden, cp_group, qutils,
                          torch.float64, 1)
    json.dump(dict(rank=RANK, rows=rows, diffs=diffs, diffs64=diffs64),
              open(os.path.join(OUT, f"rank{RANK}.json"), "w"))


def _compare(tower, splits, frame_cost, merge, in_dim, lm_hidden, cp_group, qutils, dtype, repeats):
    """Per micro-step: each split's per-rank vision times (table rows) and the count/cost differences."""
    import torch
    import torch.distributed as dist
    rows, diffs = [], {}
    for step, grids in enumerate(MICRO_BATCHES):
        grid = torch.tensor(grids, dtype=torch.long)
        gen = torch.Generator().manual_seed(100 + step)
        pixels = torch.randn(int(grid.prod(dim=1).sum()), in_dim, generator=gen).to(dtype)
        results = {}
        for name, split in splits.items():
            runs = [_vision_step(tower, split, pixels, grid, merge, lm_hidden, cp_group, qutils,
                                 gen_seed=7 + step)
                    for _ in range(repeats)]
            results[name] = runs[0]
            times = torch.tensor([statistics.median(r["seconds"] for r in runs)], dtype=torch.float64)
            gathered = [torch.zeros_like(times) for _ in range(WORLD)]
            dist.all_gather(gathered, times, group=cp_group)
            per_rank = [float(t) for t in gathered]
            costs = _rank_costs(runs[0]["counts"], grids, frame_cost)
            rows.append(dict(step=step, split=name, counts=runs[0]["counts"], seconds=per_rank,
                             measured=max(per_rank) / statistics.mean(per_rank),
                             predicted=max(costs) / statistics.mean(costs)))
            for r in runs[1:]:                            # repeats give the same values
                assert all(torch.equal(a, b) for a, b in zip(r["values"], runs[0]["values"]))
        a, b = results["count"]["values"], results["cost"]["values"]
        diffs[step] = dict(
            bit_equal=[bool(torch.equal(x, y)) for x, y in zip(a, b)],
            max_rel=[float((x - y).abs().max() / x.abs().max().clamp_min(1e-30)) if x.numel() else 0.0
                     for x, y in zip(a, b)],
            names=results["count"]["names"])
    return rows, diffs


def _provider():
    import importlib.util

    import torch
    spec = importlib.util.spec_from_file_location(
        "tiny_cfg", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "bridge",
                                 "qwen3_vl_moe_tiny_cpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    provider = mod.model_provider()
    provider.expert_model_parallel_size = 1
    provider.bf16, provider.params_dtype = False, torch.float32
    provider.vision_dp_when_cp = True
    provider.vocab_size = 256                          # the language model is built, not run
    provider.finalize()
    return provider


def _rank_costs(counts, grids, frame_cost):
    from megatron_mm_balance.solver.cp_split import frame_costs, range_costs
    return range_costs(frame_costs(grids, frame_cost), counts)


def _vision_step(tower, split, pixels, grid, merge, lm_hidden, cp_group, qutils, *, gen_seed):
    """Bridge's vision block under ``vision_dp_when_cp``, a fixed linear loss, and gradients."""
    import torch
    import torch.distributed as dist
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    tower.zero_grad(set_to_none=True)
    data, grid_thw, cp_img_num, padded = split(cp_size, pixels, grid)
    data, grid_thw, seqlens = qutils.get_vision_cp_data(data, grid_thw, merge, cp_img_num, padded,
                                                        cp_rank, cp_size)
    grid_thw = qutils.collapse_thw(grid_thw)
    local_pixels = data.detach().clone().requires_grad_(True)
    t0 = time.perf_counter()
    if local_pixels.shape[0] > 0:
        embeds, deepstack = tower(hidden_states=local_pixels, grid_thw=grid_thw)
    else:                                                 # Bridge's empty-rank placeholders
        embeds = torch.zeros((0, lm_hidden), dtype=pixels.dtype)
        deepstack = [torch.zeros((0, lm_hidden), dtype=pixels.dtype) for _ in tower.deepstack_visual_indexes]
    forward_s = time.perf_counter() - t0
    outs_local = [embeds, *deepstack]
    cut = [o.detach().requires_grad_(True) for o in outs_local]
    qutils.ensure_requires_grad_for_cp_collective(cut)
    gathered = [qutils.AllGatherVisionEmbeddings.apply(o, seqlens, cp_group) for o in cut]
    gen = torch.Generator().manual_seed(gen_seed)
    weights = [torch.randn(g.shape, generator=gen).to(g.dtype) for g in gathered]
    loss = sum((g * w).sum() for g, w in zip(gathered, weights))
    loss.backward()                                       # Bridge's backward: all-reduce, slice
    t0 = time.perf_counter()
    live = [(o, c.grad) for o, c in zip(outs_local, cut) if o.requires_grad and o.grad_fn is not None]
    if live:
        torch.autograd.backward([o for o, _ in live], [g for _, g in live])
    backward_s = time.perf_counter() - t0
    pixel_grad = local_pixels.grad if local_pixels.grad is not None else torch.zeros_like(local_pixels)
    full_pixel_grad = [torch.zeros((int(s.sum()) * merge, pixels.shape[1]), dtype=pixels.dtype) for s in seqlens]
    dist.all_gather(full_pixel_grad, pixel_grad.detach(), group=cp_group)   # uneven: harness stand-in
    names, values = ["embeddings"] + [f"deepstack{i}" for i in range(len(deepstack))], \
        [g.detach().clone() for g in gathered]
    names.append("pixel_grad")
    values.append(torch.cat(full_pixel_grad))
    for n, p in tower.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=cp_group)                # the DP x CP gradient reduction's sum
        names.append(f"grad:{n}")
        values.append(g)
    return dict(counts=list(cp_img_num), seconds=forward_s + backward_s, names=names, values=values)


if __name__ == "__main__":
    main()
