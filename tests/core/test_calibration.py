"""The online calibration of ``--mm-balance-cost auto`` (cost/calibration.py): the fit recovers
known coefficients from synthetic timing records, refuses degenerate ones (saying so and
falling back to image tokens), switches at a global-batch boundary, and round-trips its file."""
import json
import math

import numpy as np
import pytest

from megatron_mm_balance.cost.calibration import (AutoCost, CalibrationConfig, FitResult, fit_phases,
                                                  language_compute_records, read_fit, write_fit)
from megatron_mm_balance.cost.model import CostModel, FeatureArrays, PackFeatures

TRUE = CostModel(vision_ms_per_token=0.41, vision_ms_per_token_sq=2e-5, vision_ms_per_pack=40.0,
                 vision_backward_ratio=1.8, llm_ms_per_token=0.12, llm_ms_per_len_sq=3e-5,
                 const_ms=60.0, llm_backward_ratio=1.2)


def synthetic_records(model=TRUE, *, iterations=range(2, 6), ranks=2, G=8, seed=0, noise=0.0,
                      wait=True):
    """Records as the timing hooks write them: the slower ranks' language forward includes
    waiting for the slowest vision forward of the micro-step (expert-parallel meetings)."""
    rng = np.random.default_rng(seed)
    recs = []
    for it in iterations:
        prev_vb = {}
        for m in range(G):
            packs = []
            for r in range(ranks):
                k = rng.integers(0, 5)
                images = [int(16 * rng.integers(1, 13)) for _ in range(k)]
                n = int(rng.integers(1, 4))
                lengths = [int(v) for v in rng.integers(100, 500, size=n)]
                f = PackFeatures(tuple(images), tuple(lengths))
                ph = model.phase_ms(FeatureArrays.of([f]))
                jitter = 1.0 + noise * rng.standard_normal(2)
                packs.append(dict(iteration=it, microbatch=m, rank=r, images=images, lengths=lengths,
                                  vision_forward_ms=float(ph.vision_forward[0]) * jitter[0],
                                  vision_backward_ms=float(ph.vision_backward[0]) * jitter[0],
                                  lm_forward_ms=float(ph.llm_forward[0]) * jitter[1],
                                  lm_backward_ms=float(ph.llm[0] - ph.llm_forward[0]) * jitter[1]))
            # a rank reaches the language model after its previous vision backward and this
            # vision forward; the others wait there for the last one
            arrive = [p["vision_forward_ms"] + prev_vb.get(p["rank"], 0.0) for p in packs]
            for p, t in zip(packs, arrive):
                if wait:
                    p["lm_forward_ms"] += max(arrive) - t
                prev_vb[p["rank"]] = p["vision_backward_ms"]
            recs += packs
    return recs


def test_fit_recovers_known_coefficients_through_the_expert_parallel_waits():
    fit = fit_phases(synthetic_records(), first_iteration=2, last_iteration=5, effective_iteration=7)
    assert fit.ok and fit.records == 4 * 8 * 2 and fit.r2_vision == pytest.approx(1.0)
    for name in ("vision_ms_per_token", "vision_ms_per_token_sq", "vision_ms_per_pack",
                 "vision_backward_ratio", "llm_backward_ratio"):
        assert getattr(fit.model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    # the language terms come from each micro-step's fastest rank, which did not wait; they
    # reproduce the true language forward of every pack (positions and const are collinear
    # here only through the lengths, so compare predictions, not coefficients)
    lang = language_compute_records(synthetic_records(wait=False))
    f = FeatureArrays.of([PackFeatures(tuple(r["images"]), tuple(r["lengths"])) for r in lang])
    np.testing.assert_allclose(fit.model.phase_ms(f).llm_forward, TRUE.phase_ms(f).llm_forward,
                               rtol=1e-6)
    # a fit on the raw (waiting) times would be far off: the min-of-ranks choice matters
    assert fit.model.phase_ms(f).llm_forward.mean() < 1.01 * TRUE.phase_ms(f).llm_forward.mean()


def test_noisy_records_still_fit_within_a_few_percent():
    fit = fit_phases(synthetic_records(noise=0.03, iterations=range(2, 12)))
    assert fit.ok and fit.r2_vision > 0.9
    assert fit.model.vision_ms_per_token == pytest.approx(TRUE.vision_ms_per_token, rel=0.1)
    assert fit.model.vision_backward_ratio == pytest.approx(TRUE.vision_backward_ratio, rel=0.05)


def test_degenerate_fits_are_refused_with_the_reason():
    few = fit_phases(synthetic_records(iterations=[2], G=2))
    assert not few.ok and few.model is None and "fewer than 8" in few.reason
    rng = np.random.default_rng(1)
    noise = synthetic_records()
    for r in noise:                                   # vision time unrelated to the images
        r["vision_forward_ms"] = float(rng.uniform(10, 500))
    low = fit_phases(noise, r2_floor=0.5)
    assert not low.ok and "below the floor 0.5" in low.reason and low.r2_vision < 0.5
    flat = synthetic_records()
    for r in flat:
        r["vision_forward_ms"] = 100.0
    assert "no variation" in fit_phases(flat).reason
    assert "fit refused" in low.line() and "balancing with image tokens" in low.line()


def _auto(records, *, start=0, K=3, phases=True, saved=None, fits=None):
    calls = []

    def collect(first, last):
        calls.append((first, last))
        return [r for r in records if first <= r["iteration"] <= last]

    def agree(local, fit):
        return fit(local)

    cost = AutoCost(CalibrationConfig(iterations=K, phases=phases, tokens_per_tile=16),
                    start_iteration=start, collect=collect, agree=agree,
                    on_fit=(fits.append if fits is not None else None), saved=saved)
    return cost, calls


PACK = {"num_tiles": [3, 12], "cu_lengths": [[0, 300, 700, 1000]]}


def test_auto_cost_switches_at_the_global_batch_keyed_iteration():
    fits = []
    cost, calls = _auto(synthetic_records(iterations=range(1, 8)), K=3, fits=fits)
    assert cost.components == 2 and "auto_cost" in cost.identity
    # job-local global batch gb is iteration gb + 1; the fit takes effect at iteration K + 2 = 5
    assert [cost.for_batch(gb)(PACK) for gb in range(4)] == [(15 * 16, 0)] * 4 and not calls
    v, lang = cost.for_batch(4)(PACK)
    assert calls == [(2, 3)] and fits and fits[0].ok and fits[0].effective_iteration == 5
    f = PackFeatures((48, 192), (300, 400, 300))
    assert (v, lang) == fits[0].model.phase_costs(f) and v > 0 and lang > 0
    assert cost.for_batch(5)(PACK) == (v, lang) and calls == [(2, 3)]      # fitted once


def test_auto_cost_refused_fit_keeps_image_tokens_and_scalar_mode():
    flat = synthetic_records(iterations=range(1, 8))
    for r in flat:
        r["images"] = []
    fits = []
    cost, _ = _auto(flat, K=3, phases=False, fits=fits)
    assert cost.components == 1
    assert [cost.for_batch(gb)(PACK) for gb in range(8)] == [15 * 16] * 8
    assert not fits[0].ok and fits[0].choice == "image-tokens" and fits[0].model is None
    assert all("records with images" in r["refused"] for r in fits[0].replay["rows"]
               if r["name"].startswith("fit")), fits[0].replay["rows"]


def test_fit_file_round_trip_and_resume(tmp_path):
    fits = []
    cost, _ = _auto(synthetic_records(iterations=range(1, 8)), K=3, fits=fits)
    costs = [cost.for_batch(gb)(PACK) for gb in range(8)]
    path = tmp_path / "fit.json"
    write_fit(fits[0], str(path))
    saved = read_fit(str(path))
    assert saved == fits[0]
    # resumed at iteration 2 (before the switch): image tokens until iteration 5, then the fit
    resumed, calls = _auto([], start=2, saved=saved)
    assert [resumed.for_batch(gb)(PACK) for gb in range(6)] == costs[2:8] and not calls
    # resumed after the switch: the fit from the first batch
    late, _ = _auto([], start=10, saved=saved)
    assert late.for_batch(0)(PACK) == costs[-1]
    path.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a cost-fit file"):
        read_fit(str(path))


def test_calibration_config_is_validated():
    with pytest.raises(ValueError, match=">= 2"):
        CalibrationConfig(iterations=1)
    with pytest.raises(ValueError, match="tokens_per_tile"):
        CalibrationConfig(tokens_per_tile=0)
    assert math.isnan(FitResult(False, None, float("nan"), 0.0, 0, 0, 0, 0, "x").r2_vision)
    with pytest.raises(ValueError, match="held-out share"):
        CalibrationConfig(holdout=1.0)
    with pytest.raises(ValueError, match="margin"):
        CalibrationConfig(margin=-0.1)
    # the replay plans as the balancer does: its sync mode, tolerance and nodes
    opts = CalibrationConfig(phases=False, balance_tolerance=0.02, ranks_per_node=2,
                             group_ranks=(6, 4, 5, 7), margin=0.01).replay_options()
    assert (opts.sync, opts.kind, opts.balance_tolerance, opts.ranks_per_node, opts.ranks, opts.margin) == \
        ("step", "time", 0.02, 2, (4, 5, 6, 7), 0.01)


def test_fit_files_of_the_first_format_are_read_with_their_choice(tmp_path):
    """A v1 file (before the replay) restores as it balanced: its accepted fit was the
    per-pack model, a refused one image tokens."""
    fit = fit_phases(synthetic_records(), first_iteration=2, last_iteration=5, effective_iteration=7)
    data = fit.to_json()
    for key in ("choice", "replay"):
        del data[key]
    data["format"] = "mm-balance-cost-fit/v1"
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    old = read_fit(str(path))
    assert old.ok and old.choice == "fit+pack" and old.model == fit.model and old.replay is None
    assert "fit refused" not in old.line() and "by replay" not in old.line()
    data.update(ok=False, model=None)
    path.write_text(json.dumps(data))
    assert read_fit(str(path)).choice == "image-tokens"
