"""Cost models judged by replay (cost/replay.py, ``mm-balance replay``): the candidate whose
placements balance the held-out iterations' measured times best is chosen, image tokens stay
unless beaten by the margin, and the table is the same for the same records."""
import json
import random

import numpy as np
import pytest

from megatron_mm_balance import cli
from megatron_mm_balance.cost import replay as rp
from megatron_mm_balance.cost.replay import ReplayError, ReplayOptions, global_batches, replay


def records(vision_ms, *, iterations=8, ranks=4, G=8, seed=0, noise=0.0, lengths=lambda rng: [1024],
            images=None):
    """Timing records with ``vision_ms(images) -> forward ms`` (backward = 2x), the packs'
    images either one large image or many small ones (equal image tokens, very different
    sums of squares); language forward 4.8 ms + 0.05 ms per token (56 ms for the default
    fixed-length packs), backward 2x."""
    rng = np.random.default_rng(seed)
    out = []
    for it in range(1, iterations + 1):
        for r in range(ranks):
            for m in range(G):
                if images is not None:
                    imgs = images(rng)
                else:
                    k = int(rng.integers(0, 4))
                    imgs = ([int(rng.integers(8, 13)) * 64] if k == 1 else
                            [64] * (int(rng.integers(2, 13)) * (k > 1)))
                v = vision_ms(imgs) * (1.0 + noise * rng.standard_normal()) if imgs else 0.0
                lens = lengths(rng)
                lm = 4.8 + 0.05 * sum(lens)
                out.append(dict(iteration=it, microbatch=m, rank=r, images=imgs, lengths=lens,
                                vision_forward_ms=v, vision_backward_ms=2 * v, lm_forward_ms=lm,
                                lm_backward_ms=2 * lm))
    return out


def quadratic(imgs):
    return sum(0.02 * n + 4e-4 * n * n for n in imgs)


def linear(imgs):
    return 0.3 * sum(imgs)


def test_quadratic_times_choose_the_fitted_quadratic_model():
    res = replay(records(quadratic, noise=0.01))
    assert res.choice == "fit", "\n".join(res.table())
    fit, tokens = res.row("fit"), res.row("image-tokens")
    assert fit.microstep_max_mean <= tokens.microstep_max_mean - rp.DEFAULT_MARGIN
    assert res.row("perfect").microstep_max_mean <= fit.microstep_max_mean + 1e-9
    assert res.row("unbalanced").microstep_max_mean > tokens.microstep_max_mean
    assert res.model.vision_ms_per_token_sq == pytest.approx(4e-4, rel=0.05)
    # fixed-length packs: the language phase is a constant, not a meaningless fit
    assert "constant lengths" in fit.detail and np.isnan(fit.r2_language)
    assert res.model.llm_ms_per_token == 0 and res.model.const_ms == pytest.approx(56.0)
    assert res.fit_iterations == (1, 2, 3, 4) and res.held_iterations == (5, 6, 7, 8)


def test_linear_times_keep_image_tokens():
    res = replay(records(linear, noise=0.01))
    assert res.choice == "image-tokens", "\n".join(res.table())
    best = min(r.microstep_max_mean for r in res.rows if r.selectable and not r.refused)
    assert res.row("image-tokens").microstep_max_mean - best < rp.DEFAULT_MARGIN


def test_unidentifiable_records_keep_image_tokens():
    # vision time unrelated to the images: every fit is refused (R^2 floor), tokens stay
    rng = random.Random(3)
    noise = records(lambda imgs: rng.uniform(10, 500))
    res = replay(noise)
    assert res.choice == "image-tokens"
    assert all("below the floor" in r.refused for r in res.rows if r.name.startswith("fit"))
    # every pack alike: no cost can tell them apart, nothing beats tokens
    same = replay(records(quadratic, images=lambda g: [256, 256]))
    assert same.choice == "image-tokens"


def test_replay_is_deterministic_whatever_the_record_order():
    recs = records(quadratic, noise=0.05, seed=7)
    a = replay(recs).to_json()
    shuffled = list(recs)
    random.Random(0).shuffle(shuffled)
    assert json.dumps(replay(shuffled).to_json(), sort_keys=True) == json.dumps(a, sort_keys=True)


def test_step_sync_chooses_by_rank_totals_and_varying_lengths_are_fitted():
    def lengths(rng):
        return [int(rng.integers(100, 1024))]
    res = replay(records(quadratic, noise=0.01, lengths=lengths), ReplayOptions(sync="step"))
    assert res.sync == "step" and "language R^2 1.000" in res.row("fit").detail
    assert res.models["fit"].llm_ms_per_token == pytest.approx(0.05, rel=1e-6)
    tokens = res.row("image-tokens")
    chosen = res.row(res.choice)
    assert chosen.rank_total_max_mean <= tokens.rank_total_max_mean


def test_language_time_of_packs_padded_alike_stays_with_its_micro_step():
    """Every pack of one length: a micro-step's language time varies with the machine, not
    with the packs, so moving packs does not move it (else balancing would look worse than
    not balancing); with varying lengths it is the pack's and moves with it."""
    rng = np.random.default_rng(5)
    slow = {(it, m): float(rng.uniform(1.0, 3.0)) for it in range(1, 9) for m in range(8)}
    recs = records(linear, noise=0.01)
    for r in recs:
        r["lm_forward_ms"] *= slow[(r["iteration"], r["microbatch"])]
    batches, _ = global_batches(recs)
    assert all(b.language_per_slot for b in batches)
    res = replay(recs)
    table = "\n".join(res.table())
    assert res.row("image-tokens").microstep_max_mean < res.row("unbalanced").microstep_max_mean, table
    assert res.row("perfect").microstep_max_mean <= res.row("image-tokens").microstep_max_mean + 1e-9, table
    varying, _ = global_batches(records(linear, lengths=lambda g: [int(g.integers(100, 1024))]))
    assert not any(b.language_per_slot for b in varying)


def test_incomplete_iterations_are_left_out_and_bad_input_is_named():
    recs = records(linear, iterations=3)
    recs = [r for r in recs if not (r["iteration"] == 2 and r["rank"] == 1 and r["microbatch"] == 7)]
    batches, incomplete = global_batches(recs)
    assert [b.iteration for b in batches] == [1, 3] and incomplete == [2]
    assert batches[0].shape == (4, 8)
    with pytest.raises(ReplayError, match="at least 2"):
        replay(records(linear, iterations=1))
    bad = records(linear, iterations=2)
    del bad[5]["lm_forward_ms"]
    with pytest.raises(ReplayError, match=r"missing \['lm_forward_ms'\]"):
        replay(bad)
    with pytest.raises(ReplayError, match="unknown replay candidate"):
        replay(records(linear), candidates=["nope"])


def test_a_registered_candidate_is_replayed_and_can_be_chosen():
    def oracle(batches, options):                  # the true model, as a config would give it
        from megatron_mm_balance.cost.model import CostModel
        return rp.PricedCost(CostModel(vision_ms_per_token=0.02, vision_ms_per_token_sq=4e-4,
                                       vision_backward_ratio=2.0, const_ms=56.0), "the true model")
    rp.register_candidate(rp.Candidate("true-model", "test", oracle))
    try:
        with pytest.raises(ValueError, match="already registered"):
            rp.register_candidate(rp.Candidate("true-model", "test", oracle))
        res = replay(records(quadratic, noise=0.01), candidates=["true-model"])
        assert [r.name for r in res.rows] == ["unbalanced", "image-tokens", "true-model", "perfect"]
        assert res.choice == "true-model"
    finally:
        del rp.CANDIDATES["true-model"]


def test_vit_flops_candidate_needs_the_encoder_shape():
    recs = records(quadratic, noise=0.01)
    assert "no vision encoder shape" in replay(recs).row("vit-flops").refused
    per_token, per_sq = rp.vit_flops_per_image((2, 64, 4, 256))
    assert per_token == 2 * 2 * 64 * (4 * 64 + 2 * 256) and per_sq == 2 * 4 * 64
    res = replay(recs, ReplayOptions(vision_shape=(2, 64, 4, 256)))
    assert not res.row("vit-flops").refused


def write_dir(tmp_path, recs):
    for rank in sorted({r["rank"] for r in recs}):
        with open(tmp_path / f"timing-rank{rank:05d}.jsonl", "w") as f:
            for r in recs:
                if r["rank"] == rank:
                    f.write(json.dumps(r) + "\n")
    return str(tmp_path)


def test_cli_prints_the_table_and_json(tmp_path, capsys):
    d = write_dir(tmp_path, records(quadratic, noise=0.01, iterations=10))
    assert cli.main(["replay", d, "--skip-iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "micro-step max/mean" in out and "<- chosen" in out and "iterations 3-6" in out
    assert cli.main(["replay", d, "--skip-iterations", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["choice"] in ("fit", "fit+pack", "fit+image") and rep["held_iterations"] == [7, 8, 9, 10]
    assert cli.main(["replay", str(tmp_path / "missing")]) == 2
    assert "no such timing directory" in capsys.readouterr().err
    assert cli.main(["replay", d, "--holdout", "1.5"]) == 2
    assert "held-out share" in capsys.readouterr().err


# -- Qwen-VL records (Megatron-Bridge): one unit per frame of the records' grids ------------

from megatron_mm_balance.cost.features import QwenVLFeatures, TileFeatures  # noqa: E402
from megatron_mm_balance.cost.model import CostModel  # noqa: E402
from megatron_mm_balance.testing import frame_records as fr  # noqa: E402

#: the true per-frame model of fr.per_frame_quadratic, as a FLOP count would give it (no timing)
TRUE_FRAMES = CostModel(vision_ms_per_token=fr.PER_PATCH_MS, vision_ms_per_token_sq=fr.PER_PATCH_SQ_MS,
                        vision_backward_ratio=2.0)
PER_FRAME_FITS = ("fit", "fit+frame", "fit+image")


def frames_options(**kw):
    return ReplayOptions(features=QwenVLFeatures(flops_model=TRUE_FRAMES), **kw)


def test_per_frame_quadratic_world_chooses_a_per_frame_cost_over_the_patch_count():
    """Micro-batches of one large image, many small ones, a video or a few medium images at
    similar patch counts; the time is quadratic per frame: the patch count loses, a fitted
    per-frame model wins by far more than the margin, and so does the FLOP-derived one."""
    recs = fr.frame_records(noise=0.02)
    res = replay(recs, frames_options())
    table = "\n".join(res.table())
    assert [r.name for r in res.rows] == ["unbalanced", "image-tokens", "flops", *PER_FRAME_FITS, "perfect"]
    assert res.features == "qwen_vl_frames(merge=2)" and "features qwen_vl_frames" in table
    tokens = res.row("image-tokens").microstep_max_mean
    assert res.choice in PER_FRAME_FITS + ("flops",), table
    assert res.row(res.choice).microstep_max_mean <= tokens - 4 * rp.DEFAULT_MARGIN, table
    assert res.row("flops").selectable and res.row("flops").microstep_max_mean <= tokens - 4 * rp.DEFAULT_MARGIN
    assert res.models["fit"].vision_ms_per_token_sq == pytest.approx(fr.PER_PATCH_SQ_MS, rel=0.05)
    # the native-resolution target's form: the best cost's excess over 1.0 at most 70% of the
    # patch count's, the FLOP default (no timing) below the patch count
    assert res.excess_share(res.choice) <= 0.7 and res.excess_share("flops") < 1.0, table
    assert res.excess_share("image-tokens") == 1.0 and "excess over 1.0 as a share" in table
    # the same records with a whole video squared as one unit (t*h*w per image): a worse fit
    # and a worse placement than per frame
    per_image = replay(recs, ReplayOptions(features=TileFeatures()), candidates=["fit"])
    assert per_image.row("fit").r2_vision < res.row("fit").r2_vision - 0.1
    assert per_image.row("fit").microstep_max_mean > res.row("fit").microstep_max_mean + rp.DEFAULT_MARGIN


def test_qwen_vl_records_keep_the_patch_count_when_nothing_beats_it():
    rng = random.Random(3)
    noise = replay(fr.frame_records(lambda frames: rng.uniform(10, 500)), frames_options())
    assert noise.choice == "image-tokens", "\n".join(noise.table())
    assert all("below the floor" in noise.row(n).refused for n in PER_FRAME_FITS)
    # the FLOP model is scored (the table shows it) but not chosen: its shape explains no time
    flops = noise.row("flops")
    assert not flops.refused and not flops.selectable and "not chosen" in flops.detail
    # linear per frame (a Qwen2.5-VL-like tower): the patch count is the right cost already
    linear = replay(fr.frame_records(lambda frames: 0.01 * sum(frames), noise=0.01), frames_options())
    assert linear.choice == "image-tokens", "\n".join(linear.table())


def test_qwen_vl_replay_without_a_flops_model_refuses_that_candidate_only():
    res = replay(fr.frame_records(noise=0.02), ReplayOptions(features=QwenVLFeatures()))
    assert res.row("flops").refused == "no FLOP-derived model (no vision config given)"
    assert res.choice in PER_FRAME_FITS
    with pytest.raises(ReplayError, match=r"missing \['grids'\]"):
        replay([{k: v for k, v in r.items() if k != "grids"} for r in fr.frame_records()], frames_options())


def test_cli_replays_a_bridge_timing_directory(tmp_path, capsys):
    """``mm-balance replay DIR`` on records with grids: frames, the FLOP model from the file the
    run wrote beside its records, or from ``--vision-config`` (a preset, a JSON file or text)."""
    from megatron_mm_balance.cost import flops
    d = write_dir(tmp_path, fr.frame_records(noise=0.02, iterations=range(1, 11)))
    assert cli.main(["replay", d, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["features"] == "qwen_vl_frames(merge=2)" and rep["held_iterations"] == [7, 8, 9, 10]
    rows = {r["name"]: r for r in rep["rows"]}
    assert "--vision-config" in rows["flops"]["refused"] and rep["choice"] in PER_FRAME_FITS
    assert rep["excess_vs_image_tokens"]["image-tokens"] == 1.0 and rep["excess_vs_image_tokens"]["flops"] is None
    TRUE_FRAMES.save(str(tmp_path / rp.FLOPS_MODEL_FILE))
    assert cli.main(["replay", d]) == 0
    out = capsys.readouterr().out
    assert "no timing: b/a 2000 patches" in out and "features qwen_vl_frames" in out
    assert cli.main(["replay", d, "--vision-config", "qwen3-vl-tiny-cpu", "--json"]) == 0
    flops_row = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}["flops"]
    toy = flops.vision_cost_model(flops.VISION_PRESETS["qwen3-vl-tiny-cpu"])
    assert f"b/a {toy.vision_ms_per_token / toy.vision_ms_per_token_sq:.0f} patches" in flops_row["detail"]
    (tmp_path / "vc.json").write_text(json.dumps({"vision_config": flops.VISION_PRESETS["qwen3-vl-30b-a3b"]}))
    assert cli.main(["replay", d, "--vision-config", str(tmp_path / "vc.json")]) == 0
    assert "b/a 7120 patches" in capsys.readouterr().out
    assert cli.main(["replay", d, "--vision-config", "{\"depth\": 2}"]) == 2
    assert "--vision-config: the config has no 'hidden_size'" in capsys.readouterr().err
    assert cli.main(["replay", d, "--vision-config", "nope"]) == 2
    assert "not a preset" in capsys.readouterr().err
    (tmp_path / "tiles").mkdir()
    tiles = write_dir(tmp_path / "tiles", records(quadratic))
    assert cli.main(["replay", tiles, "--vision-config", "qwen3-vl-tiny-cpu"]) == 2
    assert "no grids" in capsys.readouterr().err
