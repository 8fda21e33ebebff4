"""The native-resolution sample distribution shared by the simulator and make-dataset."""
import numpy as np
import pytest

from megatron_mm_balance.data.mixtures import make_mixture
from megatron_mm_balance.data.native_res import (KINDS, MERGE, draw_native_res, micro_step_frames,
                                                 native_res_trace)


def test_the_draw_is_a_function_of_the_generator_alone():
    a = draw_native_res(np.random.default_rng(3), 500)
    b = draw_native_res(np.random.default_rng(3), 500)
    assert a == b and a != draw_native_res(np.random.default_rng(4), 500)


def test_the_samples_look_native_resolution():
    samples = draw_native_res(np.random.default_rng(0), 6000)
    share = {k: sum(s.kind == k for s in samples) / len(samples) for k in KINDS}
    assert share["text"] == pytest.approx(0.35, abs=0.03) and share["video"] == pytest.approx(0.15, abs=0.03)
    frames = np.array([p for s in samples for p in s.frames])
    assert frames.min() >= 64 and frames.max() <= 8192 and np.median(frames) < 1024
    assert (frames > 3000).sum() > 50                          # several thousand patches occur
    for s in samples:
        assert s.tokens <= 8192
        assert all(h % MERGE == 0 and w % MERGE == 0 and t >= 1 for t, h, w in s.grids)
        assert (s.kind == "text") == (not s.grids)
        assert len(s.frames) == sum(t for t, _, _ in s.grids)
    assert any(s.kind == "video" and len(s.frames) >= 8 for s in samples)
    assert any(s.kind == "document" and len(s.grids) >= 3 for s in samples)


def test_the_mixture_lists_frames_as_images():
    trace = native_res_trace(300, seed=1)
    samples = draw_native_res(np.random.default_rng(1), 300)
    assert [t.images for t in trace] == [s.frame_tokens for s in samples]
    assert make_mixture("native-res", n=300, seed=1) == trace


def test_a_micro_step_fills_each_rank_with_consecutive_samples():
    owner, patches = micro_step_frames(np.random.default_rng(0), 16)
    assert len(owner) == len(patches) and np.all(np.diff(owner) >= 0) and owner.max() <= 15
    assert patches.min() >= 64


@pytest.mark.parametrize("kwargs, match", [(dict(shares={"photo": 1.0}), "shares"),
                                           (dict(shares={"text": -1.0}), "shares"),
                                           (dict(max_tokens=100), "max_tokens")])
def test_bad_arguments_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        draw_native_res(np.random.default_rng(0), 10, **kwargs)
