"""Time forward + backward of the CPU toy Qwen3-VL vision tower (configs/bridge/qwen3_vl_moe_tiny_cpu.py,
built by Bridge's own provider under the CPU harness, whose packed attention computes each frame on
its own as GPU varlen kernels do) on micro-batches of mixed frame sizes, and print, as one JSON line,
each micro-batch's grids, its measured milliseconds (best of ``--reps``, the batches timed in turn),
the costs predicted by the FLOP-derived model and by the patch count, and whether the
``qwen3-vl-tiny-cpu`` preset of ``mm-balance replay --vision-config`` is this tower.

    PYTHONPATH=REPO:BRIDGE/src:MEGATRON_LM python tests/bridge/toy_tower_timing.py [--reps N] [--all]

``test_toy_tower_ranking.py`` runs it on :data:`BATCHES`; ``--all`` adds :data:`MORE` (the
table of docs/notes/2026-12-02-qwen-vl-costs.md).
"""
from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "configs", "bridge"))

#: micro-batches of 1,536-2,304 patches: one large frame, many small ones, a video, a few
#: medium ones; the patch count ties most of them, the frames' sizes do not
BATCHES = [
    [(1, 48, 48)], [(1, 16, 16)] * 9, [(1, 32, 32)] * 2, [(1, 32, 64)], [(1, 24, 24)] * 4, [(2, 32, 32)],
    [(1, 40, 40)], [(1, 16, 16)] * 6, [(1, 12, 12)] * 16,
]
#: the larger micro-batches of 4,096 patches (one 64 x 64 frame takes seconds on a CPU)
MORE = [[(1, 64, 64)], [(1, 32, 32)] * 4, [(1, 16, 16)] * 16, [(1, 8, 8)] * 64, [(4, 32, 32)]]


def main() -> None:
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 2
    batches = BATCHES + (MORE if "--all" in sys.argv else [])
    from megatron_mm_balance.testing import cpu_bridge
    cpu_bridge.install()
    import torch
    import torch.distributed as dist

    from megatron_mm_balance.bench.runtime import free_port
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)

    import qwen3_vl_moe_tiny_cpu as toy

    from megatron_mm_balance.bridge.model_spec import training_regime
    from megatron_mm_balance.cost.flops import VISION_PRESETS, VisionTower, vision_cost_model
    from megatron_mm_balance.cost.frames import grid_feature_arrays
    provider = toy.model_provider()
    provider.expert_model_parallel_size = 1
    provider.vocab_size = 256
    provider.finalize()
    tower = provider.provide(pre_process=True, post_process=True).vision_model
    vc = provider.vision_config
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2

    def step(grids) -> float:
        grid = torch.tensor(grids, dtype=torch.long)
        pixels = torch.randn(int(grid.prod(-1).sum()), width)
        t0 = time.perf_counter()
        out, deepstack = tower(pixels, grid)
        (out.float().sum() + sum(d.float().sum() for d in deepstack)).backward()
        return (time.perf_counter() - t0) * 1e3

    step(batches[0])                                            # warm-up
    times = [[] for _ in batches]
    for _ in range(reps):                                       # in turn: a slow spell hits every batch
        for i, g in enumerate(batches):
            times[i].append(step(g))
    model = vision_cost_model(vc, training_regime(provider), flops_per_ms=1.0)
    predicted = model.phase_ms(grid_feature_arrays(batches)).vision.tolist()
    patches = [sum(t * h * w for t, h, w in g) for g in batches]
    preset = VisionTower.from_config(VISION_PRESETS["qwen3-vl-tiny-cpu"]) == VisionTower.from_config(vc)
    print(json.dumps({"grids": batches, "measured_ms": [min(t) for t in times], "flops": predicted,
                      "patches": patches, "preset_is_this_tower": preset}))


if __name__ == "__main__":
    main()
