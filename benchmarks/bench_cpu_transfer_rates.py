"""The CPU figures behind ``mm_balance.vision=images``'s nominal transfer rates on CPU.

Two numbers turn a moved frame's bytes into frame cost (``bridge/vision.py``,
``NOMINAL_RATES["cpu"]``): the link's GB/s (here gloo point to point between two
processes on this machine) and the tower's achieved TFLOP/s (here one fp32 transformer
layer of the native benchmark's tower width, forward and backward, one thread, at three
frame sizes). Prints both, and what a pack placement's swap costs on this host: two ranks
each sending the other a pack of fp32 pixel rows through the exchange's own transport
(``runtime/transport.PackTransport``: send, receive, finish), as two node-mates swap packs at a
micro-step. Run on a quiet machine:

    python benchmarks/bench_cpu_transfer_rates.py
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

from megatron_mm_balance.bench.runtime import free_port


def tower_gflops(hidden: int = 48, ffn: int = 256, heads: int = 3, sizes=(256, 1024, 4096)) -> None:
    """One pre-norm-free layer (QKV, attention over the frame, output, two-matrix MLP)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    qkv, out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
    fc1, fc2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    for p in sizes:
        x = torch.randn(p, hidden, requires_grad=True)

        def layer(x):
            q, k, v = (t.transpose(0, 1) for t in qkv(x).view(p, 3, heads, hidden // heads).unbind(1))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(p, hidden)
            x = x + out(a)
            return x + fc2(torch.nn.functional.gelu(fc1(x)))

        for _ in range(2):
            layer(x).sum().backward()
        n, t0 = 5, time.perf_counter()
        for _ in range(n):
            layer(x).sum().backward()
        seconds = (time.perf_counter() - t0) / n
        flops = 3 * 4 * hidden * p * (p + 2 * hidden + ffn)        # forward and backward
        print(f"tower layer, frame of {p:5d} patches: {seconds * 1e3:8.2f} ms  {flops / seconds / 1e9:6.1f} GFLOP/s")


def _link_rank(rank: int, port: int, sizes) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for mb in sizes:
        t = torch.zeros(mb * 2 ** 20 // 4)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        seconds = (time.perf_counter() - t0) / 10
        if rank == 0:
            print(f"gloo point to point, {mb:3d} MB: {mb * 2 ** 20 / seconds / 1e9:6.2f} GB/s", flush=True)
    dist.destroy_process_group()


def _on_two_ranks(target, *args) -> None:
    """``target(rank, port, *args)`` in two spawned processes that meet over gloo at ``port``;
    a process still running after 120 s is killed."""
    port = free_port()
    procs = [mp.get_context("spawn").Process(target=target, args=(r, port, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()


def link_gbps(sizes=(1, 8, 64)) -> None:
    _on_two_ranks(_link_rank, sizes)


def _swap_rank(rank: int, port: int, patches: int, repeats: int) -> None:
    import statistics

    import torch.distributed as dist

    from megatron_mm_balance.runtime.transport import PackTransport
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    transport = PackTransport(dist.group.WORLD, [0, 1], rank, timeout=60)
    pack = {"pixel_values": torch.randn(patches, 1536), "input_ids": torch.arange(1024),
            "image_grid_thw": torch.tensor([[1, 2, patches // 2]])}
    times = []
    for step in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        sent = transport.send(pack, 1 - rank, 0, step)
        transport.receive(1 - rank, 0, step)
        transport.finish(sent, 0, step)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        ms = sorted(t * 1e3 for t in times[2:])
        mb = pack["pixel_values"].numel() * 4 / 1e6
        print(f"pack swap, {patches} fp32 patches ({mb:.1f} MB each way): median {statistics.median(ms):.1f} ms "
              f"[{ms[0]:.1f}-{ms[-1]:.1f}] over {repeats}", flush=True)
    dist.destroy_process_group()


def pack_swap(patches: int = 3000, repeats: int = 10) -> None:
    _on_two_ranks(_swap_rank, patches, repeats)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tower_gflops()
    link_gbps()
    pack_swap()
