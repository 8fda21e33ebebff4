"""Named mixtures: reproducible, composed as documented (docs/mixtures.md)."""
from collections import Counter

import pytest

from megatron_mm_balance.data import mixtures
from megatron_mm_balance.data.traces import load_bundled

N = 20_000


@pytest.fixture(scope="module")
def heldout_real():
    return mixtures.blend_with_sources(mixtures.BLENDS["heldout-real"], N, seed=3)


def test_heldout_real_is_a_named_mixture_and_reproducible():
    assert "heldout-real" in mixtures.MIXTURES
    a = mixtures.make_mixture("heldout-real", n=5000, seed=7)
    assert a == mixtures.make_mixture("heldout-real", n=5000, seed=7)
    assert a != mixtures.make_mixture("heldout-real", n=5000, seed=8)
    assert len(a) == 5000


def test_blend_with_sources_returns_the_same_samples_as_blend():
    shares = mixtures.BLENDS["heldout-real"]
    samples, sources = mixtures.blend_with_sources(shares, 3000, seed=5)
    assert samples == mixtures.blend(shares, 3000, seed=5)
    assert len(sources) == len(samples)


def test_heldout_real_has_the_stated_shares(heldout_real):
    samples, sources = heldout_real
    shares = mixtures.BLENDS["heldout-real"]
    assert sum(shares.values()) == pytest.approx(1.0)
    got = Counter(sources)
    assert set(got) == set(shares)
    for name, share in shares.items():
        assert got[name] / len(samples) == pytest.approx(share, abs=1e-3), name
    # 35% text-only: every text-only sample is a text sample and vice versa
    text_only = [src for s, src in zip(samples, sources) if not s.images]
    assert len(text_only) / len(samples) == pytest.approx(0.35, abs=1e-3)
    assert set(text_only) == {"text"}
    # every described source is present: captions of 576 tokens, 64-token frames,
    # 1-12 tiles of 256, interleaved documents
    by = {name: [s for s, src in zip(samples, sources) if src == name] for name in shares}
    assert all(s.images == (576,) for s in by["caption"])
    assert all(set(s.images) == {64} for s in by["video"])
    assert {len(s.images) for s in by["tiles"]} == set(range(1, 13))
    assert all(s.images for s in by["interleaved"])


def test_heldout_real_draws_real_trace_samples(heldout_real):
    samples, sources = heldout_real
    for name in ("ai2d", "chartqa"):
        trace = load_bundled(name)
        real = set(trace)
        drawn = [s for s, src in zip(samples, sources) if src == name]
        assert len(drawn) > 0.04 * len(samples)
        assert all(s in real for s in drawn), name
        # a resample of the whole real trace: its tile-count frequencies and mean length
        for k in {len(s.images) for s in trace}:
            want = sum(len(s.images) == k for s in trace) / len(trace)
            got = sum(len(s.images) == k for s in drawn) / len(drawn)
            assert got == pytest.approx(want, abs=0.04), (name, k)
        mean = sum(s.tokens for s in trace) / len(trace)
        assert sum(s.tokens for s in drawn) / len(drawn) == pytest.approx(mean, rel=0.03)
