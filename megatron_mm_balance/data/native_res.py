"""The native-resolution data mix: per sample, its Qwen-VL grids and its text length.

Qwen-VL encoders see every image at its own resolution: the processor cuts it into a
``(1, h, w)`` grid of 16-pixel patches (``h`` and ``w`` even: 2 x 2 patches merge into one
language-model token), and a video of ``2t`` frames into a ``(t, h, w)`` grid (temporal
patches of 2 frames). This module draws such samples from a seeded
``numpy.random.Generator``: pure, no torch, no image bytes, so that the dataset writer
(``mm-balance make-dataset --format bridge-qwen-vl --mix native-res``) and the simulator
draw the same distribution.

The mix (:class:`NativeResMix`, shares of samples):

* ``text``: text-only conversations (long answers);
* ``image``: one image; patches log-uniform from ``min_patches`` (64: 128 x 128 px) to
  ``max_patches`` (3,136: 896 x 896 px), aspect ratio log-uniform in 1:3 .. 3:1;
* ``document``: 2-5 images of that distribution (a multi-image document);
* ``video``: 2-6 temporal patches (4-12 frames) of one frame size, ``h`` and ``w``
  multiples of 14 patches (224 px) between 14 x 28 and 42 x 42 patches. Only those sizes
  reach Bridge's Qwen-VL collate unchanged: it reads video frames through ``qwen_vl_utils``,
  which resizes every frame to a multiple of 28 px with at least 128 x 28 x 28 pixels
  before the processor rounds it to 32 px (224 px is a multiple of both).

Every sample fits ``max_tokens`` language-model tokens (its vision tokens ``t*h*w/4``,
its text and the chat template's tokens, :func:`sample_tokens`): a document drops
trailing images, a video temporal patches, and text is shortened to what is left.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np

#: Pixels per patch side, patches merged per token side (Qwen3-VL).
PATCH, MERGE = 16, 2
#: Video frame sides in patches: multiples of 14 (224 px), see the module docstring.
VIDEO_SIDES = (14, 28, 42)
#: Frames per temporal patch.
TEMPORAL_PATCH = 2
#: Template tokens of a conversation (role markers, turn ends) and of each image or video
#: (vision start / end) and of each video temporal patch (its timestamp and markers).
TEMPLATE_TOKENS, MEDIA_TOKENS, TEMPORAL_TOKENS = 24, 2, 12
#: Text every sample keeps at least (a question and a one-sentence answer).
MIN_TEXT_TOKENS = 40
KINDS = ("text", "image", "document", "video")

Grid = Tuple[int, int, int]


@dataclass(frozen=True)
class NativeResSample:
    """One sample: its kind, its images' and videos' grids ``(t, h, w)`` in patches (in
    the order they appear; ``videos`` marks which are videos) and its text tokens."""

    kind: str
    grids: Tuple[Grid, ...]
    videos: Tuple[bool, ...]
    text_tokens: int

    @property
    def patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    @property
    def vision_tokens(self) -> int:
        return self.patches // (MERGE * MERGE)

    @property
    def frames(self) -> Tuple[int, ...]:
        """Patches of every frame (what attends together): ``h*w`` once per temporal patch."""
        return tuple(h * w for t, h, w in self.grids for _ in range(t))


@dataclass(frozen=True)
class NativeResMix:
    """The distribution (see the module docstring); every field has a documented default."""

    shares: Tuple[Tuple[str, float], ...] = (("text", 0.15), ("image", 0.45), ("document", 0.25),
                                             ("video", 0.15))
    max_tokens: int = 1024
    min_patches: int = 64
    max_patches: int = 3136
    max_aspect: float = 3.0
    document_images: Tuple[int, int] = (2, 5)
    video_temporal: Tuple[int, int] = (2, 6)
    #: text tokens (log-uniform) per kind
    text_range: dict = field(default_factory=lambda: {"text": (200, 900), "image": (40, 400),
                                                      "document": (40, 400), "video": (40, 200)})

    def __post_init__(self):
        kinds = [k for k, _ in self.shares]
        if sorted(kinds) != sorted(KINDS) or any(not w >= 0 for _, w in self.shares) \
                or not sum(w for _, w in self.shares) > 0:
            raise ValueError(f"native-res shares must give each of {KINDS} a weight >= 0, got {self.shares}")
        if not 64 <= self.min_patches <= self.max_patches:
            raise ValueError(f"native-res patches: need 64 <= min_patches <= max_patches, got "
                             f"{self.min_patches}, {self.max_patches}")
        smallest = TEMPLATE_TOKENS + MEDIA_TOKENS + self.max_patches // 4 + MIN_TEXT_TOKENS
        if self.max_tokens < smallest:
            raise ValueError(f"native-res max_tokens {self.max_tokens} cannot hold one image of "
                             f"max_patches {self.max_patches} ({smallest} tokens)")


def sample_tokens(grids, videos, text_tokens: int) -> int:
    """Language-model tokens of a sample: vision tokens, text and template (an upper bound
    the dataset writer checks against the real tokenizer)."""
    temporal = sum(t for (t, _, _), v in zip(grids, videos) if v)
    vision = sum(t * h * w for t, h, w in grids) // (MERGE * MERGE)
    return vision + text_tokens + TEMPLATE_TOKENS + MEDIA_TOKENS * len(grids) + TEMPORAL_TOKENS * temporal


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def image_grid(rng: np.random.Generator, mix: NativeResMix) -> Grid:
    """One image's ``(1, h, w)``: patches log-uniform, aspect log-uniform, sides even."""
    p = _log_uniform(rng, mix.min_patches, mix.max_patches)
    r = _log_uniform(rng, 1.0 / mix.max_aspect, mix.max_aspect)
    h = max(MERGE, MERGE * round(math.sqrt(p / r) / MERGE))
    w = max(MERGE, MERGE * round(math.sqrt(p * r) / MERGE))
    while h * w > mix.max_patches:                     # rounding may overshoot the bound
        if h >= w:
            h -= MERGE
        else:
            w -= MERGE
    while h * w < mix.min_patches:
        if h <= w:
            h += MERGE
        else:
            w += MERGE
    return (1, h, w)


def video_grid(rng: np.random.Generator, mix: NativeResMix) -> Grid:
    """One video's ``(t, h, w)``: ``t`` temporal patches, a frame of the sides Bridge's
    collate keeps (at least 14 x 28 patches)."""
    lo, hi = mix.video_temporal
    t = int(rng.integers(lo, hi + 1))
    while True:
        h, w = (int(v) for v in rng.choice(VIDEO_SIDES, size=2))
        if h * w >= 14 * 28:
            return (t, h, w)


def _fit(kind: str, grids: List[Grid], videos: List[bool], text: int, mix: NativeResMix):
    """Shrink a sample to ``max_tokens``: trailing images, then temporal patches, then text
    (down to :data:`MIN_TEXT_TOKENS`)."""
    floor = MIN_TEXT_TOKENS
    while len(grids) > 1 and sample_tokens(grids, videos, floor) > mix.max_tokens:
        grids, videos = grids[:-1], videos[:-1]
    while grids and videos[0] and grids[0][0] > 1 and sample_tokens(grids, videos, floor) > mix.max_tokens:
        t, h, w = grids[0]
        grids = [(t - 1, h, w)]
    room = mix.max_tokens - sample_tokens(grids, videos, 0)
    if room < floor:
        raise ValueError(f"native-res: a {kind} sample of grids {grids} does not fit max_tokens "
                         f"{mix.max_tokens}")
    return NativeResSample(kind, tuple(grids), tuple(videos), int(max(floor, min(text, room))))


def draw_sample(rng: np.random.Generator, kind: str, mix: NativeResMix = NativeResMix()) -> NativeResSample:
    """One sample of ``kind`` (see :data:`KINDS`)."""
    if kind == "text":
        grids, videos = [], []
    elif kind == "image":
        grids, videos = [image_grid(rng, mix)], [False]
    elif kind == "document":
        lo, hi = mix.document_images
        n = int(rng.integers(lo, hi + 1))
        grids, videos = [image_grid(rng, mix) for _ in range(n)], [False] * n
    elif kind == "video":
        grids, videos = [video_grid(rng, mix)], [True]
    else:
        raise ValueError(f"native-res: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    lo, hi = mix.text_range[kind]
    text = int(round(_log_uniform(rng, lo, hi)))
    return _fit(kind, grids, videos, text, mix)


def kinds_for(n: int, mix: NativeResMix = NativeResMix()) -> List[str]:
    """``n`` sample kinds in the mix's shares (largest remainders), unshuffled."""
    total = sum(w for _, w in mix.shares)
    exact = [(k, n * w / total) for k, w in mix.shares]
    counts = {k: int(math.floor(x)) for k, x in exact}
    for k, x in sorted(exact, key=lambda kx: (-(kx[1] - math.floor(kx[1])), KINDS.index(kx[0])))[
            : n - sum(counts.values())]:
        counts[k] += 1
    return [k for k in KINDS for _ in range(counts[k])]


def draw(rng: np.random.Generator, n: int, mix: NativeResMix = NativeResMix()) -> List[NativeResSample]:
    """``n`` samples in the mix's shares, in a random order."""
    kinds = kinds_for(n, mix)
    order = rng.permutation(len(kinds))
    return [draw_sample(rng, kinds[i], mix) for i in order]


#: The mix at the production scale of the simulator's ``native-res`` mixture: 8K-token
#: sequences, images up to 8,192 patches (about 1,450 px square), videos of up to 32
#: temporal patches (64 frames), longer documents' text.
SIM_MIX = NativeResMix(max_tokens=8192, max_patches=8192, video_temporal=(2, 32),
                       text_range={"text": (200, 6000), "image": (40, 2000), "document": (40, 4000),
                                   "video": (40, 1000)})


def sample_token_count(s: NativeResSample) -> int:
    """The language-model tokens of one drawn sample (:func:`sample_tokens`)."""
    return sample_tokens(s.grids, s.videos, s.text_tokens)


def micro_step_frames(rng: np.random.Generator, num_ranks: int, mix: NativeResMix = SIM_MIX):
    """One micro-step's frames over ``num_ranks`` ranks, each holding one sequence of
    consecutive samples while they fit in ``mix.max_tokens`` tokens: ``(owner, patches)``
    per frame, rank-major (the frame planner's tests and benchmark)."""
    samples = draw(rng, int(num_ranks) * 48, mix)
    owner, patches, it = [], [], iter(samples)
    for r in range(int(num_ranks)):
        used = 0
        for s in it:
            tokens = sample_token_count(s)
            if used + tokens > mix.max_tokens:
                break
            used += tokens
            owner.extend([r] * len(s.frames))
            patches.extend(s.frames)
    return np.asarray(owner, dtype=np.int64), np.asarray(patches, dtype=np.int64)


def native_res_trace(n: int = 60_000, seed: int = 0, mix: NativeResMix = SIM_MIX):
    """The simulator's ``native-res`` mixture: :func:`draw` as
    :class:`~megatron_mm_balance.data.traces.Sample` records whose "images" are the
    frames (``h*w / merge^2`` tokens each), so a pack's per-image costs are per-frame
    costs and image-level balancing moves frames (a video's frames separately)."""
    from .traces import Sample
    return [Sample(sample_token_count(s), tuple(p // (MERGE * MERGE) for p in s.frames))
            for s in draw(np.random.default_rng(seed), n, mix)]
