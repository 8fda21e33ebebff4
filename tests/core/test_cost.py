import numpy as np
import pytest

from megatron_mm_balance.cost.model import CostModel, PackFeatures, load_cost_file
from megatron_mm_balance.cost.pack import ImageTokenCost


def test_image_token_cost_is_the_sum():
    cost = ImageTokenCost()
    assert cost({"image_token_counts": [256, 256, 64]}) == 576 and cost({}) == 0


def test_fit_recovers_known_coefficients():
    true = CostModel(vision_ms_per_token=0.03, vision_ms_per_token_sq=2e-6,
                     llm_ms_per_len_sq=1e-7, const_ms=5.0, backward_ratio=2.0)
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(40):
        imgs = tuple(int(v) for v in rng.integers(64, 2048, size=rng.integers(0, 5)))
        lens = tuple(int(v) for v in rng.integers(100, 4000, size=rng.integers(1, 6)))
        f = PackFeatures(imgs, lens)
        fwd = true.forward_ms(f)
        recs.append({"images": list(imgs), "lengths": list(lens), "forward_ms": fwd,
                     "backward_ms": 2.0 * fwd})
    fit = CostModel.fit(recs)
    for name in ("vision_ms_per_token", "vision_ms_per_token_sq", "llm_ms_per_len_sq", "const_ms"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-9)
    assert fit.vision_backward_ratio == fit.llm_backward_ratio == pytest.approx(2.0)


def test_fit_never_returns_negative_coefficients():
    # Decreasing time with tokens would fit a negative slope: it is dropped instead.
    recs = [{"images": [n], "forward_ms": 10.0 - n * 1e-3} for n in (100, 200, 400, 800)]
    fit = CostModel.fit(recs)
    assert fit.vision_ms_per_token >= 0 and fit.vision_ms_per_token_sq >= 0


def test_costs_are_integers_and_reproducible():
    m = CostModel(0.0301, 1.3e-6, 0.0, 0.0, backward_ratio=2.0)
    f = PackFeatures((256, 1024), (500, 3000))
    assert isinstance(m.cost(f), int) and m.cost(f) == m.cost(PackFeatures((256, 1024), (500, 3000)))


def test_cost_file_roundtrip_and_errors(tmp_path):
    m = CostModel(0.02, 1e-6, 3e-8, 1.5, backward_ratio=2.1)
    path = tmp_path / "cost.json"
    m.save(str(path))
    assert load_cost_file(str(path)) == m
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a cost file"):
        load_cost_file(str(bad))
    bad.write_text('{"format": "mm-balance-cost/v1", "vision_ms_per_token": -1}')
    with pytest.raises(ValueError, match="vision_ms_per_token must be"):
        load_cost_file(str(bad))
    bad.write_text('{"format": "mm-balance-cost/v1", "typo": 1}')
    with pytest.raises(ValueError, match="unknown cost-file fields"):
        load_cost_file(str(bad))
    with pytest.raises(ValueError, match="no such cost file"):
        load_cost_file(str(tmp_path / "missing.json"))
