"""Packed pools: a trace packed once, kept as per-pack numpy features.

Simulating DP=4096 x GA=32 x 50 global batches needs 6.5M packs, far more than
a trace yields and far more than Python can pack per run. So each strategy packs
a representative trace *once* (cached per trace, sequence length, budget and
buffer), and the simulated global batches draw their packs from that pool by
seeded resampling (:func:`draw_indices`). The packer is the project's own
(:func:`megatron_mm_balance.data.packing.pack_greedy`); nothing is re-packed here.

Per-pack features are flat arrays, with ragged per-image sizes and per-sample
lengths in CSR form (``*_offsets`` into ``*_sizes``), so the cost of a pack is a
vectorised expression over the pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..data.packing import pack_greedy
from ..data.traces import Sample

DRAW_MODES = ("iid", "contiguous")


@dataclass(frozen=True)
class PackPool:
    seq_len: int
    budget: int | None
    efficiency: float            # the packer's efficiency over the whole trace
    samples: int
    dropped: int
    tokens: np.ndarray           # [P] real tokens
    image_tokens: np.ndarray     # [P] sum of image tokens
    image_sq: np.ndarray         # [P] sum over images of n_i^2
    num_images: np.ndarray       # [P]
    sample_len_sq: np.ndarray    # [P] sum over samples of len_j^2
    image_offsets: np.ndarray    # [P+1] into image_sizes
    image_sizes: np.ndarray      # per-image token counts, pack-major
    sample_offsets: np.ndarray   # [P+1] into sample_lengths
    sample_lengths: np.ndarray   # per-sample token counts, pack-major

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def text_tokens(self) -> np.ndarray:
        return self.tokens - self.image_tokens


def pool_from_packs(packs, samples: Sequence[Sample], *, seq_len: int, budget=None,
                    efficiency=None, n_samples=None, dropped=0) -> PackPool:
    """Features of ``packs`` (``Pack`` objects whose ``samples`` index ``samples``)."""
    if not packs:
        raise ValueError("packing produced no packs (every sample longer than the sequence?)")
    n_img = np.fromiter((len(p.images) for p in packs), dtype=np.int64, count=len(packs))
    n_smp = np.fromiter((len(p.samples) for p in packs), dtype=np.int64, count=len(packs))
    img_sizes = np.fromiter((n for p in packs for n in p.images), dtype=np.int64,
                            count=int(n_img.sum()))
    smp_len = np.fromiter((samples[i].tokens for p in packs for i in p.samples),
                          dtype=np.int64, count=int(n_smp.sum()))
    img_off = np.concatenate([[0], np.cumsum(n_img)])
    smp_off = np.concatenate([[0], np.cumsum(n_smp)])

    def seg_sum(values, off):
        c = np.concatenate([[0], np.cumsum(values)])
        return c[off[1:]] - c[off[:-1]]

    tokens = np.fromiter((p.tokens for p in packs), dtype=np.int64, count=len(packs))
    if efficiency is None:
        efficiency = float(tokens.sum() / (len(packs) * seq_len))
    return PackPool(
        seq_len=seq_len, budget=budget, efficiency=float(efficiency),
        samples=int(n_samples if n_samples is not None else n_smp.sum()), dropped=int(dropped),
        tokens=tokens,
        image_tokens=seg_sum(img_sizes, img_off),
        image_sq=seg_sum(img_sizes * img_sizes, img_off),
        num_images=n_img,
        sample_len_sq=seg_sum(smp_len * smp_len, smp_off),
        image_offsets=img_off, image_sizes=img_sizes,
        sample_offsets=smp_off, sample_lengths=smp_len,
    )


_CACHE: dict[tuple, PackPool] = {}


def build_pool(samples: Sequence[Sample], seq_len: int, *, budget: int | None = None,
               buffer_size: int = 1024, cache_key=None) -> PackPool:
    """Pack ``samples`` (1D greedy, or 2D with an image ``budget``) into a pool.

    With ``cache_key`` (anything hashable naming the trace) the pool is reused by
    later calls in this process with the same trace, length, budget and buffer.
    """
    key = None if cache_key is None else (cache_key, seq_len, budget, buffer_size)
    if key is not None and key in _CACHE:
        return _CACHE[key]
    res = pack_greedy(samples, seq_len, buffer_size=buffer_size, image_budget=budget)
    pool = pool_from_packs(res.packs, samples, seq_len=seq_len, budget=budget,
                           efficiency=res.efficiency, n_samples=res.samples,
                           dropped=len(res.dropped))
    if key is not None:
        _CACHE[key] = pool
    return pool


def pool_stats(pool: PackPool) -> dict:
    """Packing efficiency and the spread of image tokens per pack (what balancing faces)."""
    img = pool.image_tokens.astype(np.float64)
    mean = float(img.mean())
    return {
        "packs": len(pool), "samples": pool.samples, "dropped": pool.dropped,
        "efficiency": pool.efficiency, "image_tokens_mean": mean,
        "image_tokens_cv": float(img.std() / mean) if mean else 0.0,
        "image_tokens_p99": float(np.percentile(img, 99)),
        "image_tokens_max": float(img.max()),
    }


def draw_indices(pool_size: int, batches: int, dp: int, ga: int, *, seed: int = 0,
                 mode: str = "iid") -> np.ndarray:
    """Pool indices ``[batches, dp, ga]`` for the simulated global batches.

    ``iid``: every pack drawn independently (uniform, with replacement).
    ``contiguous``: each rank reads ``ga`` consecutive packs of the pool from a
    random start (wrapping), like a rank reading its shard contiguously.
    The draw depends only on (seed, pool size, shape), so every strategy that
    shares a pool sees exactly the same packs.
    """
    if mode not in DRAW_MODES:
        raise ValueError(f"draw mode must be one of {DRAW_MODES}, got {mode!r}")
    rng = np.random.default_rng([seed, dp, ga])
    if mode == "iid":
        return rng.integers(0, pool_size, size=(batches, dp, ga), dtype=np.int64)
    start = rng.integers(0, pool_size, size=(batches, dp, 1), dtype=np.int64)
    return (start + np.arange(ga, dtype=np.int64)) % pool_size
