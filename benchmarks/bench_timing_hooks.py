"""What the per-pack timing hooks (``--mm-balance-timing-dir``) cost a micro-batch, on CPU.

A LLaVA-shaped model with the parameter count of ``configs/megatron/vision_heavy_cpu.sh``'s
CLIP (8 layers of 16 parameter tensors: the hooks' per-parameter gradient hook is what
scales) but tiny tensors, so that the compute is small and the hooks' own cost shows;
micro-batches with and without the hooks alternate in blocks, ``perf_counter`` around
each forward + backward. Prints the median per micro-batch with and without, and the
difference: the hooks' cost, to compare with the real job's micro-batch (~1 s).

    python benchmarks/bench_timing_hooks.py [--microbatches 400] [--layers 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def build(layers: int):
    import torch
    from torch import nn

    class Block(nn.Module):                 # 16 parameter tensors, like a CLIP layer
        def __init__(self):
            super().__init__()
            self.parts = nn.ModuleList([nn.Linear(8, 8) for _ in range(8)])

        def forward(self, x):
            for p in self.parts:
                x = x + p(x)
            return x

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(32, 8)
            self.body = Block()
            self.head = nn.Linear(8, 32)

        def forward(self, decoder_input=None, labels=None, **_):
            return nn.functional.cross_entropy(self.head(self.body(decoder_input)).transpose(1, 2), labels,
                                               reduction="none")

    class Model(nn.Module):
        img_seq_len = 4

        def __init__(self):
            super().__init__()
            self.vision_model = nn.Sequential(*[Block() for _ in range(layers)])
            self.vision_projection = nn.Linear(8, 8)
            self.language_model = LM()

        def forward(self, images, input_ids, position_ids, attention_mask, labels, loss_mask,
                    num_image_tiles=None, packed_seq_params=None):
            text = self.language_model.embedding(input_ids)
            img = self.vision_projection(self.vision_model(images)).reshape(1, -1, 8)
            lab = torch.cat([torch.zeros(1, img.shape[1], dtype=labels.dtype), labels], dim=1)
            return self.language_model(decoder_input=torch.cat([img, text], 1), labels=lab), loss_mask

    return Model()


def main(argv=None) -> int:
    import torch

    from megatron_mm_balance.megatron.timing import TimingRecorder, install_hooks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", type=int, default=400)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain, hooked = build(a.layers), build(a.layers)
    with tempfile.TemporaryDirectory() as out:
        rec = TimingRecorder(rank=0, out_dir=out)
        install_hooks([hooked], rec)
        images = torch.randn(6, 4, 8)
        ids = torch.randint(0, 32, (1, 16))
        kw = dict(num_image_tiles=torch.tensor([2, 4], dtype=torch.int32),
                  packed_seq_params=SimpleNamespace(cu_seqlens_q=torch.tensor([0, 20, 40], dtype=torch.int32)))
        times = {"without": [], "with": []}
        for block in range(a.microbatches // 20):
            for name, model in (("without", plain), ("with", hooked)) if block % 2 else (
                    ("with", hooked), ("without", plain)):
                for m in range(10):
                    rec.set_iteration(block * 10 + m + 1)
                    t0 = time.perf_counter()
                    loss, _ = model(images, ids, None, None, ids, None, **kw)
                    loss.mean().backward()
                    times[name].append(time.perf_counter() - t0)
        rec.close()
        n = sum(1 for _ in open(rec.path))
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"{len(times['with'])} micro-batches each, {a.layers} vision layers "
          f"({sum(1 for p in hooked.parameters() if p.requires_grad)} parameter tensors); "
          f"{n} records written")
    print(f"median per micro-batch: without hooks {med['without']:.0f} us, with hooks {med['with']:.0f} us, "
          f"hooks {med['with'] - med['without']:+.0f} us per micro-batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
