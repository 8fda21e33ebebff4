"""The native-resolution mix (data/native_res.py): reproducible from the seed, and the
distribution it promises: kinds in their shares, frames of 64 to thousands of patches at many
aspect ratios, videos of several temporal patches in the sizes Bridge's collate keeps,
multi-image documents, text-only samples, every sample within its token length."""
import math
from collections import Counter

import numpy as np
import pytest

from megatron_mm_balance.data import native_res as nr


def _draw(seed=0, n=2000, mix=nr.NativeResMix()):
    return nr.draw(np.random.default_rng(seed), n, mix)


def test_same_seed_same_samples_other_seed_differs():
    assert _draw(3, 300) == _draw(3, 300)
    assert _draw(3, 300) != _draw(4, 300)


def test_kinds_in_their_shares():
    mix = nr.NativeResMix()
    counts = Counter(s.kind for s in _draw(n=2000, mix=mix))
    total = sum(w for _, w in mix.shares)
    for kind, w in mix.shares:
        assert abs(counts[kind] - 2000 * w / total) <= 1, (kind, counts)
    assert Counter(nr.kinds_for(7, mix)) == Counter(nr.kinds_for(7, mix)) and len(nr.kinds_for(7, mix)) == 7


def test_frames_images_videos_documents_text():
    mix = nr.NativeResMix()
    samples = _draw(n=2000, mix=mix)
    images = [g for s in samples for g, v in zip(s.grids, s.videos) if not v]
    videos = [g for s in samples for g, v in zip(s.grids, s.videos) if v]
    # images: one frame, even sides (2 x 2 merge), 64 .. max_patches, many sizes and aspect ratios
    assert all(t == 1 and h % 2 == 0 and w % 2 == 0 for t, h, w in images)
    patches = [h * w for _, h, w in images]
    assert min(patches) >= mix.min_patches and max(patches) <= mix.max_patches
    assert min(patches) < 100 and max(patches) > 2500 and len(set(patches)) > 200
    aspects = [w / h for _, h, w in images]
    assert min(aspects) < 0.45 and max(aspects) > 2.2
    # videos: several temporal patches, frames of the sides Bridge's collate keeps
    assert videos and all(1 <= t <= mix.video_temporal[1] for t, _, _ in videos)
    assert sum(t >= 2 for t, _, _ in videos) > 0.9 * len(videos)
    assert all(h in nr.VIDEO_SIDES and w in nr.VIDEO_SIDES and h * w >= 14 * 28 for _, h, w in videos)
    # documents: several images; text-only: none
    docs = [s for s in samples if s.kind == "document"]
    assert all(len(s.grids) >= 1 and not any(s.videos) for s in docs)
    assert np.mean([len(s.grids) for s in docs]) > 2.5 and max(len(s.grids) for s in docs) == 5
    assert all(not s.grids and s.text_tokens >= 100 for s in samples if s.kind == "text")
    # every sample within its length; frames are h*w once per temporal patch
    assert all(nr.sample_tokens(s.grids, s.videos, s.text_tokens) <= mix.max_tokens for s in samples)
    s = next(s for s in samples if s.kind == "video")
    (t, h, w), = s.grids
    assert s.frames == (h * w,) * t and s.patches == t * h * w and s.vision_tokens == t * h * w // 4


def test_a_shorter_length_shrinks_documents_and_videos_not_below_one_unit():
    mix = nr.NativeResMix(max_tokens=900)
    for s in _draw(1, 800, mix):
        assert nr.sample_tokens(s.grids, s.videos, s.text_tokens) <= 900
        assert s.kind == "text" or s.grids


@pytest.mark.parametrize("kw, match", [
    (dict(shares=(("text", 1.0), ("image", 1.0))), "each of"),
    (dict(min_patches=16), "64 <= min_patches"),
    (dict(max_tokens=500), "cannot hold one image"),
])
def test_bad_mixes_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        nr.NativeResMix(**kw)


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown kind 'audio'"):
        nr.draw_sample(np.random.default_rng(0), "audio")


def test_image_grid_respects_bounds_at_the_extremes():
    mix = nr.NativeResMix(min_patches=64, max_patches=64 * 4)
    rng = np.random.default_rng(5)
    for _ in range(500):
        _, h, w = nr.image_grid(rng, mix)
        assert 64 <= h * w <= 256 and h % 2 == 0 and w % 2 == 0
        assert max(h, w) / min(h, w) <= 3.0 * 1.5 + 1e-9 or math.isclose(h * w, 64)


def test_the_simulator_mixture_lists_frames_as_images():
    from megatron_mm_balance.data.mixtures import make_mixture
    from megatron_mm_balance.data.native_res import SIM_MIX, draw, native_res_trace, sample_token_count
    trace = native_res_trace(300, seed=1)
    samples = draw(np.random.default_rng(1), 300, SIM_MIX)
    assert [t.images for t in trace] == [tuple(p // 4 for p in s.frames) for s in samples]
    assert all(t.tokens == sample_token_count(s) <= SIM_MIX.max_tokens for t, s in zip(trace, samples))
    assert make_mixture("native-res", n=300, seed=1) == trace
    frames = np.array([p for s in samples for p in s.frames])
    assert frames.min() >= 64 and frames.max() > 3000         # frames of several thousand patches


def test_a_micro_step_fills_each_rank_with_consecutive_samples():
    from megatron_mm_balance.data.native_res import micro_step_frames
    owner, patches = micro_step_frames(np.random.default_rng(0), 16)
    assert len(owner) == len(patches) and np.all(np.diff(owner) >= 0) and owner.max() <= 15
    assert patches.min() >= 64
