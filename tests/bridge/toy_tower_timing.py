"""Time forward + backward of the CPU toy Qwen3-VL vision tower (configs/bridge/qwen3_vl_moe_tiny_cpu.py,
built by Bridge's own provider under the CPU harness) on micro-batches of mixed frame sizes, and
print, as one JSON line, each micro-batch's grids, its measured milliseconds (best of REPS) and the
costs predicted by the FLOP-derived model and by the patch count.

The CPU harness's packed attention (``cpu_pretrain._packed_attention``) is one dense masked
attention over the whole pack: exact, but quadratic in the pack's total patches, which no GPU
kernel is. Timed with it, a 4,096-patch micro-batch takes the same time as one frame or as 64
frames. ``--attention per-frame`` (the default) computes each frame's attention on its own, as
FlashAttention's variable-length kernels do; ``--attention harness`` keeps the harness's.

    PYTHONPATH=REPO:BRIDGE/src:MEGATRON_LM python tests/bridge/toy_tower_timing.py [--attention per-frame|harness]
"""
from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "configs", "bridge"))

#: equal patch totals split into few large or many small frames, a video, and other totals
BATCHES = [
    [(1, 64, 64)], [(1, 32, 32)] * 4, [(1, 16, 16)] * 16, [(1, 8, 8)] * 64, [(4, 32, 32)],
    [(1, 48, 48)], [(1, 16, 16)] * 9, [(1, 32, 64)], [(1, 8, 8)] * 32, [(1, 24, 24), (1, 32, 32)],
    [(2, 40, 40)], [(1, 16, 32)] * 6,
]
REPS = 3


def install_per_frame_attention() -> None:
    """Packed (THD) attention computed segment by segment (each frame of the pack alone)."""
    import torch
    from megatron.core.transformer import dot_product_attention as dpa
    harness_forward = dpa.DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return harness_forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None)
        cu = packed_seq_params.cu_seqlens_q.to(torch.long).tolist()
        outs = []
        for a, b in zip(cu, cu[1:]):
            q, k, v = (x[a:b].float().transpose(0, 1) for x in (query, key, value))      # [h, p, d]
            probs = torch.softmax(torch.matmul(q, k.transpose(1, 2)) * self.softmax_scale, dim=-1)
            outs.append(torch.matmul(probs, v).to(query.dtype).transpose(0, 1))
        return torch.cat(outs).reshape(query.shape[0], 1, -1)

    dpa.DotProductAttention.forward = forward


def main() -> None:
    from megatron_mm_balance.testing import cpu_bridge
    cpu_bridge.install()
    if "--attention" not in sys.argv or sys.argv[sys.argv.index("--attention") + 1] == "per-frame":
        install_per_frame_attention()
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

    from megatron_mm_balance.bridge.iterator import training_regime
    from megatron_mm_balance.cost.flops import vision_cost_model
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

    step(BATCHES[0])                                            # warm-up
    measured = [min(step(g) for _ in range(REPS)) for g in BATCHES]
    model = vision_cost_model(vc, training_regime(provider), flops_per_ms=1.0)
    predicted = model.phase_ms(grid_feature_arrays(BATCHES)).vision.tolist()
    patches = [sum(t * h * w for t, h, w in g) for g in BATCHES]
    print(json.dumps({"grids": BATCHES, "measured_ms": measured, "flops": predicted, "patches": patches}))


if __name__ == "__main__":
    main()
