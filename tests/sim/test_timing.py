"""Timing files: derivations by hand, overrides, the shipped configs, bad files."""
import math

import pytest

from megatron_mm_balance.sim.timing import (BUILTIN_DEFAULT, CONFIG_DIR, TimingError,
                                            TimingModel, load_timing, model_from_dict,
                                            read_timing_config)

BASE = {
    "gpu": {"peak_tflops": 1000},
    "vision": {"params_b": 0.5, "layers": 10, "hidden": 1000, "patches_per_token": 2,
               "mfu": 0.5},
    "llm": {"params_b": 2.0, "layers": 20, "hidden": 2000, "mfu": 0.25},
    "exchange": {"bytes_per_image_token": 100, "link_gbps": 10},
}


def test_flops_derivation_by_hand():
    t = model_from_dict(BASE)
    # F_vision = 1000e12 * 0.5 FLOP/s = 5e11 FLOP/ms
    assert math.isclose(t.vision_ms_per_token, 2 * 0.5e9 * 2 / 5e11)            # 0.004
    assert math.isclose(t.vision_ms_per_token_sq, 4 * 10 * 1000 * 4 / 5e11)
    # F_llm = 2.5e11 FLOP/ms
    assert math.isclose(t.llm_ms_per_token, 2 * 2e9 / 2.5e11)                   # 0.016
    assert math.isclose(t.llm_ms_per_token_sq, 2 * 20 * 2000 / 2.5e11)
    assert t.vision_bwd_fwd_ratio == 2.0 and t.llm_compute_padding is True
    assert t.llm_params_b == 2.0


def test_explicit_coefficients_win_one_by_one():
    cfg = {**BASE, "llm": {**BASE["llm"], "ms_per_token_sq": 0}}
    t = model_from_dict(cfg)
    assert t.llm_ms_per_token_sq == 0 and math.isclose(t.llm_ms_per_token, 0.016)


def test_shipped_configs_load_and_make_sense():
    names = sorted(p.stem for p in CONFIG_DIR.glob("timing_*.yaml"))
    assert {"timing_default", "timing_vlm_2b_dense", "timing_vlm_30b_moe"} <= set(names)
    for n in names:
        t = load_timing(n[len("timing_"):])
        assert t.vision_ms_per_token > 0 and t.llm_ms_per_token > 0 and t.link_gbps > 0
    d = load_timing("default")
    # the default is the straight line through the seed's two measurements
    assert math.isclose(d.vision_ms_per_token * 3000 + d.vision_ms_per_pack, 900)
    assert math.isclose(d.vision_ms_per_token * 500 + d.vision_ms_per_pack, 200)
    # the 30B MoE config: vision is a minority of an 8K pack's compute
    m = load_timing("vlm-30b-moe")
    assert m.vision_ms_per_token * 4300 < m.llm_ms_per_token * 8192


def test_overrides_and_rescaling():
    t = load_timing("vlm_2b_dense", ["exchange.link_gbps=3", "llm.mfu=0.2"])
    base = load_timing("vlm_2b_dense")
    assert t.link_gbps == 3
    assert math.isclose(t.llm_ms_per_token, 2 * base.llm_ms_per_token)
    big = base.with_llm_params(base.llm_params_b * 8)
    assert math.isclose(big.llm_ms_per_token, 8 * base.llm_ms_per_token)
    assert math.isclose(big.llm_ms_per_token_sq, 4 * base.llm_ms_per_token_sq)
    with pytest.raises(TimingError, match="params_b"):
        TimingModel().with_llm_params(8)


@pytest.mark.parametrize("text,match", [
    ("vision: {ms_per_token: 1}\n", "missing section 'llm'"),
    ("vision: {ms_per_token: -1}\nllm: {ms_per_token: 1}\nexchange: {bytes_per_image_token: 1, "
     "link_gbps: 1}\n", "vision.ms_per_token must be >= 0"),
    ("vision: {ms_per_token: x}\nllm: {ms_per_token: 1}\nexchange: {bytes_per_image_token: 1, "
     "link_gbps: 1}\n", "must be a number"),
    ("vision: {ms_per_token: 1}\nllm: {ms_per_token: 1}\nexchange: {bytes_per_image_token: 1, "
     "link_gbps: 0}\n", "link_gbps"),
    ("vision: {params_b: 1, layers: 1, hidden: 1, mfu: 0.5}\nllm: {ms_per_token: 1}\n"
     "exchange: {bytes_per_image_token: 1, link_gbps: 1}\n", "peak_tflops"),
    ("vision: [1\n", "not valid YAML"),
    ("- 1\n", "mapping"),
])
def test_bad_files(tmp_path, text, match):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    with pytest.raises(TimingError, match=match):
        load_timing(str(p))


def test_bad_names_and_overrides(tmp_path):
    with pytest.raises(TimingError, match="no such file or built-in"):
        load_timing("nonexistent_model")
    with pytest.raises(TimingError, match="section.key=value"):
        load_timing("default", ["link_gbps"])
    with pytest.raises(TimingError, match="number or true/false"):
        load_timing("default", ["exchange.link_gbps=fast"])
    with pytest.raises(TimingError, match="is not a regular file"):
        load_timing(str(tmp_path))


def test_builtin_default_matches_the_config_file():
    cfg, _ = read_timing_config("default")
    assert cfg == BUILTIN_DEFAULT


def test_default_works_without_the_configs_directory(tmp_path, monkeypatch):
    import megatron_mm_balance.sim.timing as timing
    monkeypatch.setattr(timing, "CONFIG_DIR", tmp_path)
    built_in = timing.load_timing("default")
    monkeypatch.undo()
    assert built_in == timing.load_timing("default")
    monkeypatch.setattr(timing, "CONFIG_DIR", tmp_path)
    with pytest.raises(TimingError, match="none found"):
        timing.load_timing("vlm_2b_dense")
