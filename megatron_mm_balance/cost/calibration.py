"""Calibrate the cost model on real kernels: time a vision encoder against image tokens.

A CLIP ViT-L/14-sized encoder (24 layers, hidden 1024, 16 heads, MLP 4096) runs
forward and backward on packs of images of different sizes and counts; medians of
repeated timings (CUDA events on a GPU, ``perf_counter`` on CPU) become records
for :meth:`megatron_mm_balance.cost.model.CostModel.fit`, and the fitted model is
written as a cost file that ``--mm-balance-cost model`` accepts.

The encoder is megatron-core's ``CLIPViTModel`` when megatron-core (and, for its
fused kernels, transformer-engine) is importable and a GPU is present; otherwise
a plain PyTorch encoder of the same shape, attention computed per image with
``scaled_dot_product_attention``. Which one ran is recorded in the results.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

from .model import CostModel


@dataclass(frozen=True)
class EncoderShape:
    layers: int = 24
    hidden: int = 1024
    heads: int = 16
    ffn: int = 4096

    @staticmethod
    def tiny() -> "EncoderShape":
        return EncoderShape(layers=2, hidden=64, heads=4, ffn=256)


def build_torch_encoder(shape: EncoderShape, device, dtype):
    """A pre-norm transformer encoder over patch tokens: the ViT-L/14 body."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(shape.hidden)
            self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
            self.proj = nn.Linear(shape.hidden, shape.hidden)
            self.ln2 = nn.LayerNorm(shape.hidden)
            self.fc1 = nn.Linear(shape.hidden, shape.ffn)
            self.fc2 = nn.Linear(shape.ffn, shape.hidden)

        def forward(self, x):                       # x: [images, tokens, hidden]
            b, t, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, shape.heads, h // shape.heads).unbind(2)
            a = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    model = nn.Sequential(*[Block() for _ in range(shape.layers)])
    return model.to(device=device, dtype=dtype)


def pack_configurations(max_tokens: int = 8192, *, quick: bool = False):
    """(image count, tokens per image) pairs: single large images and many small ones,
    from 0 up to ``max_tokens`` image tokens per pack."""
    sizes = (256, 576, 1024) if not quick else (16, 64)
    out = [(0, 0)]
    for size in sizes:
        n = 1
        while n * size <= max_tokens:
            out.append((n, size))
            n *= 2
    return out


def time_pack(model, images: int, tokens: int, shape: EncoderShape, device, dtype,
              repeats: int, warmup: int) -> tuple[float, float]:
    """Median forward and backward milliseconds for one pack of ``images`` x ``tokens``."""
    import torch

    if images == 0:
        return 0.0, 0.0
    cuda = torch.device(device).type == "cuda"
    x = torch.randn(images, tokens, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    fwd, bwd = [], []
    for it in range(warmup + repeats):
        if cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            y = model(x)
            e1.record()
            y.float().sum().backward()
            e2.record()
            torch.cuda.synchronize()
            f, b = e0.elapsed_time(e1), e1.elapsed_time(e2)
        else:
            t0 = time.perf_counter()
            y = model(x)
            t1 = time.perf_counter()
            y.float().sum().backward()
            t2 = time.perf_counter()
            f, b = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        x.grad = None
        model.zero_grad(set_to_none=True)
        if it >= warmup:
            fwd.append(f)
            bwd.append(b)
    return statistics.median(fwd), statistics.median(bwd)


def calibrate(*, device="cpu", dtype=None, shape: EncoderShape | None = None,
              max_tokens: int = 8192, repeats: int = 5, warmup: int = 2, quick: bool = False,
              log=print) -> dict:
    """Time the encoder over :func:`pack_configurations` and fit the cost model.

    Returns ``{"encoder": ..., "device": ..., "records": [...], "cost_model": {...}}``.
    """
    import torch

    shape = shape or (EncoderShape.tiny() if quick else EncoderShape())
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = build_torch_encoder(shape, device, dtype)
    records = []
    for images, tokens in pack_configurations(max_tokens, quick=quick):
        f, b = time_pack(model, images, tokens, shape, device, dtype, repeats, warmup)
        records.append({"images": [tokens] * images, "forward_ms": f, "backward_ms": b})
        log(f"  {images:>3} x {tokens:>5} image tokens: forward {f:8.3f} ms, backward {b:8.3f} ms")
    fitted = CostModel.fit(records)
    return {
        "encoder": f"torch ViT body {shape}",
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "records": records,
        "cost_model": fitted.to_json(),
    }


def save_results(results: dict, cost_path: str, records_path: str | None = None) -> CostModel:
    model = CostModel(**{k: v for k, v in results["cost_model"].items() if k != "format"})
    model.save(cost_path)
    if records_path:
        with open(records_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return model
