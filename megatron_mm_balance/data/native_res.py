"""Native-resolution samples: Qwen-VL patch grids per sample, from a seeded numpy Generator.

A Qwen2/2.5/3-VL vision tower sees each image or video at its own size, a ``t x h x w``
grid of patches (``h``, ``w`` multiples of the spatial merge, 2); it attends inside each
temporal patch (*frame*) only, so the units whose cost matters are frames of ``h*w``
patches (:mod:`megatron_mm_balance.cost.frames`). One function draws the grids of a
sample mix for every user: the simulator's ``native-res`` mixture (every frame one
"image" of ``h*w / merge^2`` tokens, :func:`native_res_trace`), and the Bridge data set
of ``mm-balance make-dataset --mix native-res`` can draw its grids from it too.

Sample kinds and their default shares (:data:`DEFAULT_SHARES`):

* ``text`` (35%): text only, lognormal length (median 700 tokens, sigma 1.0);
* ``image`` (35%): one image, area lognormal (median 1,024 patches, sigma 0.9) clipped
  to [64, 8,192] patches (a 128 px square to about 1,450 px square at 16 px patches),
  aspect ratio lognormal (sigma 0.4, within 1:4 and 4:1), a short prompt and answer
  (median 120 tokens);
* ``document`` (15%): 2 + Poisson(1.5) images of median 640 patches (sigma 0.8,
  [64, 4,096]), median 600 text tokens: a multi-image web or OCR document;
* ``video`` (15%): 2-32 temporal patches (4-64 sampled frames, two per temporal patch)
  of median 300 patches per frame (sigma 0.5, [64, 1,536]): many small frames.

Every sample fits ``max_tokens`` language tokens (text plus ``t*h*w / merge^2`` image
tokens): a document drops trailing images, a video trailing temporal patches. Pure
numpy; the draws happen in a fixed order, so the result is a function of the
Generator's state alone (byte-reproducible data sets).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("text", "image", "document", "video")
DEFAULT_SHARES = {"text": 0.35, "image": 0.35, "document": 0.15, "video": 0.15}
#: Qwen-VL's spatial merge: ``merge x merge`` patches become one language token.
MERGE = 2
MIN_PATCHES = 64                 # an 8 x 8 patch frame
MAX_IMAGE_PATCHES = 8192
MAX_DOC_IMAGE_PATCHES = 4096
MAX_VIDEO_FRAME_PATCHES = 1536
MAX_TEMPORAL = 32
MAX_SIDE = 256                   # patches along one side
MAX_TOKENS = 8192


@dataclass(frozen=True)
class NativeResSample:
    """One sample: its kind, the ``(t, h, w)`` patch grid of each image or video (in the
    sample's order) and its text tokens."""

    kind: str
    grids: tuple
    text_tokens: int

    @property
    def frames(self) -> tuple:
        """Patches of every frame (temporal patch), in order."""
        return tuple(h * w for t, h, w in self.grids for _ in range(t))

    @property
    def frame_tokens(self) -> tuple:
        """Language tokens of every frame (``h*w / merge^2``)."""
        return tuple(p // (MERGE * MERGE) for p in self.frames)

    @property
    def image_tokens(self) -> int:
        return sum(t * h * w for t, h, w in self.grids) // (MERGE * MERGE)

    @property
    def tokens(self) -> int:
        return self.text_tokens + self.image_tokens


def _lognormal(rng, n, median, sigma, lo, hi):
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=n)), lo, hi).astype(np.int64)


def _grids(rng, n, median, sigma, hi):
    """``n`` frame shapes ``(h, w)`` in patches: lognormal area within [MIN_PATCHES, hi],
    lognormal aspect ratio, both sides even (whole merge units) and at least 8."""
    area = rng.lognormal(np.log(median), sigma, size=n).clip(MIN_PATCHES, hi)
    aspect = np.exp(rng.normal(0.0, 0.4, size=n)).clip(0.25, 4.0)
    h = np.clip(2 * np.rint(np.sqrt(area * aspect) / 2), 8, MAX_SIDE).astype(np.int64)
    w = np.clip(2 * np.rint(area / h / 2), 8, MAX_SIDE).astype(np.int64)
    while True:                  # rounding may overshoot the cap by a row: trim the longer side
        over = h * w > hi
        if not over.any():
            return h, w
        longer = over & (h >= w)
        h = np.where(longer, h - 2, h)
        w = np.where(over & ~longer, w - 2, w)


def _fit(grids, text, max_tokens):
    """Drop trailing grids (a video: trailing temporal patches) until the sample fits."""
    room = max_tokens - text
    out = []
    for t, h, w in grids:
        per_t = h * w // (MERGE * MERGE)
        t = min(t, room // per_t)
        if t <= 0:
            break
        out.append((int(t), int(h), int(w)))
        room -= t * per_t
    return tuple(out)


def draw_native_res(rng: np.random.Generator, n: int, *, shares: dict | None = None,
                    max_tokens: int = MAX_TOKENS) -> list[NativeResSample]:
    """``n`` native-resolution samples drawn from ``rng`` (see the module docstring).

    ``shares``: ``{kind: share}`` over :data:`KINDS` (default :data:`DEFAULT_SHARES`);
    ``max_tokens``: the most language tokens one sample may hold (the sequence length)."""
    shares = dict(DEFAULT_SHARES if shares is None else shares)
    unknown = sorted(set(shares) - set(KINDS))
    if unknown or not shares or any(not v >= 0 for v in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError(f"native-res shares must be non-negative weights over {KINDS}, got {shares!r}")
    if int(n) < 0:
        raise ValueError(f"native-res: n must be >= 0, got {n}")
    if max_tokens < 1024:
        raise ValueError(f"native-res: max_tokens must be >= 1024, got {max_tokens}")
    n = int(n)
    p = np.array([shares.get(k, 0.0) for k in KINDS], dtype=np.float64)
    kind = rng.choice(len(KINDS), size=n, p=p / p.sum())
    out: list = [None] * n
    idx = {k: np.flatnonzero(kind == i) for i, k in enumerate(KINDS)}

    i_text = idx["text"]
    for i, t in zip(i_text.tolist(), _lognormal(rng, len(i_text), 700, 1.0, 16, max_tokens).tolist()):
        out[i] = NativeResSample("text", (), int(t))

    i_img = idx["image"]
    h, w = _grids(rng, len(i_img), 1024, 0.9, MAX_IMAGE_PATCHES)
    text = _lognormal(rng, len(i_img), 120, 0.8, 8, 2000)
    for j, i in enumerate(i_img.tolist()):
        t = int(text[j])
        out[i] = NativeResSample("image", _fit([(1, int(h[j]), int(w[j]))], t, max_tokens), t)

    i_doc = idx["document"]
    k = 2 + rng.poisson(1.5, size=len(i_doc))
    h, w = _grids(rng, int(k.sum()), 640, 0.8, MAX_DOC_IMAGE_PATCHES)
    text = _lognormal(rng, len(i_doc), 600, 0.8, 32, 6000)
    start = np.concatenate([[0], np.cumsum(k)])
    for j, i in enumerate(i_doc.tolist()):
        grids = [(1, int(a), int(b)) for a, b in zip(h[start[j]:start[j + 1]], w[start[j]:start[j + 1]])]
        t = int(text[j])
        out[i] = NativeResSample("document", _fit(grids, t, max_tokens), t)

    i_vid = idx["video"]
    tt = rng.integers(2, MAX_TEMPORAL + 1, size=len(i_vid))
    h, w = _grids(rng, len(i_vid), 300, 0.5, MAX_VIDEO_FRAME_PATCHES)
    text = _lognormal(rng, len(i_vid), 100, 0.7, 8, 1000)
    for j, i in enumerate(i_vid.tolist()):
        t = int(text[j])
        out[i] = NativeResSample("video", _fit([(int(tt[j]), int(h[j]), int(w[j]))], t, max_tokens), t)
    return out


def micro_step_frames(rng: np.random.Generator, num_ranks: int, seq_len: int = MAX_TOKENS):
    """One micro-step's frames over ``num_ranks`` ranks, each holding one sequence of
    consecutive samples while they fit in ``seq_len`` tokens: ``(owner, patches)`` per
    frame, rank-major (the frame planner's tests and benchmark)."""
    samples = draw_native_res(rng, int(num_ranks) * 48, max_tokens=seq_len)
    owner, patches, it = [], [], iter(samples)
    for r in range(int(num_ranks)):
        used = 0
        for s in it:
            if used + s.tokens > seq_len:
                break
            used += s.tokens
            owner.extend([r] * len(s.frames))
            patches.extend(s.frames)
    return np.asarray(owner, dtype=np.int64), np.asarray(patches, dtype=np.int64)


def native_res_trace(n: int = 60_000, seed: int = 0, *, max_tokens: int = MAX_TOKENS):
    """The simulator's ``native-res`` mixture: :func:`draw_native_res` as
    :class:`~megatron_mm_balance.data.traces.Sample` records whose "images" are the
    frames (``h*w / merge^2`` tokens each), so a pack's per-image costs are per-frame
    costs and image-level balancing moves frames (a video's frames separately)."""
    from .traces import Sample
    return [Sample(s.tokens, s.frame_tokens)
            for s in draw_native_res(np.random.default_rng(seed), n, max_tokens=max_tokens)]
