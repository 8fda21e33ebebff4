"""Per-frame Qwen-VL costs: grids as features, the FLOP-derived model against a FLOP count
written out here, the regimes, cost files, and unreadable micro-batches as errors."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from megatron_mm_balance.cost.flops import (TrainingRegime, VisionTower, vision_cost_model,
                                            vision_flops)
from megatron_mm_balance.cost.frames import grid_feature_arrays, grid_frames, grid_pack_features
from megatron_mm_balance.cost.model import CostModel, PackFeatures, load_cost_file
from megatron_mm_balance.cost.pack import QwenVLBatchError, QwenVLCost

#: Qwen3-VL-30B-A3B-Instruct's vision_config (Hugging Face config.json)
QWEN3_VL = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                temporal_patch_size=2, in_channels=3, spatial_merge_size=2, out_hidden_size=2048,
                deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
#: Qwen2.5-VL-7B-Instruct's vision_config
QWEN25_VL = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                 temporal_patch_size=2, in_channels=3, spatial_merge_size=2, out_hidden_size=3584,
                 window_size=112, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")


def forward_flops(p, *, layers, full, hidden, ffn, gated, window, patch_in, mergers, out, merge=2):
    """An independent forward FLOP count of one frame of ``p`` patches (2 per multiply-add)."""
    h = hidden
    qkv_proj = p * h * 3 * h + p * h * h
    mlp = p * h * ffn * (3 if gated else 2)
    full_attn = 2 * p * p * h                        # Q K^T, then softmax(.) V
    window_attn = 2 * p * window * h
    merged = p // merge ** 2
    merger = merged * (h * merge ** 2) ** 2 + merged * h * merge ** 2 * out
    macs = (layers * (qkv_proj + mlp) + full * full_attn + (layers - full) * window_attn
            + p * patch_in * h + mergers * merger)
    return 2 * macs


def test_frames_of_grids_and_their_features():
    assert grid_frames([(1, 4, 6), (3, 2, 2)]) == (24, 4, 4, 4)
    f = grid_pack_features([(1, 4, 6), (3, 2, 2)], lengths=(5, 7))
    assert f.images == (24, 4, 4, 4) and f.image_count == 2 and f.lengths == (5, 7)
    arr = grid_feature_arrays([[(1, 4, 6), (3, 2, 2)], [], [(2, 8, 8)]])
    np.testing.assert_array_equal(arr.image_tokens, [36, 0, 128])
    np.testing.assert_array_equal(arr.image_sq, [24 ** 2 + 3 * 16, 0, 2 * 64 ** 2])
    np.testing.assert_array_equal(arr.units, [4, 0, 2])
    np.testing.assert_array_equal(arr.num_images, [2, 0, 1])
    for bad in ([(1, 2)], [(1, -2, 2)], [(1, 2.5, 2)], ["abc"]):
        with pytest.raises(ValueError, match="triple"):
            grid_frames(bad)


@pytest.mark.parametrize("name,vc,shape", [
    ("qwen3", QWEN3_VL, dict(layers=27, full=27, hidden=1152, ffn=4304, gated=False, window=0,
                             patch_in=3 * 2 * 16 * 16, mergers=4, out=2048)),
    ("qwen25", QWEN25_VL, dict(layers=32, full=4, hidden=1280, ffn=3420, gated=True, window=64,
                               patch_in=3 * 2 * 14 * 14, mergers=1, out=3584)),
])
def test_flop_model_matches_an_independent_count(name, vc, shape):
    frozen = TrainingRegime(freeze_vision_model=True, freeze_vision_projection=True)   # forward only
    m = vision_cost_model(vc, frozen, flops_per_ms=1.0)
    for p in (64, 1024, 16384):
        got = m.phase_ms(grid_feature_arrays([[(1, p // 64, 64)]])).vision[0]
        assert got == pytest.approx(forward_flops(p, **shape), rel=1e-12), (name, p)


def test_derived_constants_of_the_real_towers():
    q3 = VisionTower.from_config(QWEN3_VL)
    assert q3.layer_macs_per_patch() / q3.attention_macs_per_patch_sq() == 2 * 1152 + 4304   # 6608
    per_patch, per_sq = vision_flops(q3, TrainingRegime(freeze_vision_model=True,
                                                        freeze_vision_projection=True))
    assert round(per_patch / per_sq) == 7129                  # with the patch embedding and 4 mergers
    per_patch, per_sq = vision_flops(VisionTower.from_config(QWEN25_VL))
    assert round(per_patch / per_sq) == 63154                 # 28 window layers: nearly linear


@pytest.mark.parametrize("vc,shape,alpha", [
    (QWEN3_VL, dict(layers=27, full=27, hidden=1152, ffn=4304, gated=False, window=0, patch_in=1536, mergers=4,
                    out=2048), 7129),
    (QWEN25_VL, dict(layers=32, full=4, hidden=1280, ffn=3420, gated=True, window=64, patch_in=1176, mergers=1,
                     out=3584), 63203),
    # the native-resolution bench's CPU tower (configs/bridge/qwen3_vl_moe_native_res_cpu.py): one layer,
    # where 2*hidden + ffn = 352 would leave out the embedding and mergers, 3/4 of its per-patch work
    (dict(depth=1, hidden_size=48, intermediate_size=256, patch_size=16, temporal_patch_size=2, in_channels=3,
          spatial_merge_size=2, out_hidden_size=128, deepstack_visual_indexes=[0]),
     dict(layers=1, full=1, hidden=48, ffn=256, gated=False, window=0, patch_in=1536, mergers=2, out=128), 1440),
])
def test_frame_alpha_is_the_whole_towers_linear_over_quadratic_work(vc, shape, alpha):
    """``p * (p + alpha)`` (the frame planner's cost) is the whole tower's forward FLOPs up to a
    constant factor: alpha is the independent count's linear over quadratic coefficient."""
    p1, p2 = 1024, 4096
    f1, f2 = forward_flops(p1, **shape), forward_flops(p2, **shape)
    quad = (f2 / p2 - f1 / p1) / (p2 - p1)                 # f(p) = quad*p^2 + lin*p
    lin = f1 / p1 - quad * p1
    tower = VisionTower.from_config(vc)
    assert tower.frame_alpha() == alpha == round(lin / quad)
    with pytest.raises(ValueError, match="no full-attention layer"):
        VisionTower.from_config(dict(QWEN25_VL, fullatt_block_indexes=[])).frame_alpha()


def test_one_large_frame_against_sixteen_small_at_equal_patches():
    m = vision_cost_model(QWEN3_VL)
    big, small = m.phase_ms(grid_feature_arrays([[(1, 128, 128)], [(1, 32, 32)] * 16])).vision
    assert 16384 == 16 * 1024
    assert big / small == pytest.approx((16384 + 7120) / (1024 + 7120), rel=1e-9)   # about 2.9x
    assert 2.8 < big / small < 3.0
    assert QwenVLCost(2)({"image_grid_thw": [[1, 128, 128]]}) == QwenVLCost(2)(
        {"image_grid_thw": [[1, 32, 32]] * 16})                               # patch count: equal


def test_a_video_is_frames_not_one_squared_sequence():
    m = vision_cost_model(QWEN3_VL, flops_per_ms=1.0)
    video = m.phase_ms(grid_feature_arrays([[(8, 64, 64)]])).vision[0]
    frames = m.phase_ms(grid_feature_arrays([[(1, 64, 64)] * 8])).vision[0]
    assert video == pytest.approx(frames)
    sq_coef = m.vision_ms_per_token_sq
    whole = m.vision_ms_per_token * 8 * 4096 + sq_coef * (8 * 4096) ** 2
    assert (whole - m.vision_ms_per_token * 8 * 4096) == pytest.approx(8 * (video - m.vision_ms_per_token * 8 * 4096))


def test_regimes_change_the_step_by_their_flops():
    tower = VisionTower.from_config(QWEN3_VL)
    fwd = vision_flops(tower, TrainingRegime(freeze_vision_model=True, freeze_vision_projection=True))
    train = vision_flops(tower)
    frozen_tower = vision_flops(tower, TrainingRegime(freeze_vision_model=True))
    recompute = vision_flops(tower, TrainingRegime(recompute_granularity="full", recompute_method="uniform"))
    layers, embed, merge = (tower.layer_macs_per_patch() * 27 * 2, tower.embed_macs_per_patch() * 2,
                            tower.merger_macs_per_patch() * 4 * 2)
    assert fwd[0] == pytest.approx(layers + embed + merge)
    assert train[0] == pytest.approx(3 * layers + 2 * embed + 3 * merge) and train[1] == 3 * fwd[1]
    assert frozen_tower[0] == pytest.approx(layers + embed + 2 * merge) and frozen_tower[1] == fwd[1]
    assert recompute[0] == pytest.approx(train[0] + layers) and recompute[1] == 4 * fwd[1]
    block = vision_flops(tower, TrainingRegime(recompute_granularity="full", recompute_method="block",
                                               recompute_num_layers=9))
    assert block[1] == pytest.approx(3 * fwd[1] + fwd[1] / 3)
    selective = vision_flops(tower, TrainingRegime(recompute_granularity="selective"))
    assert selective == (train[0], 4 * fwd[1])
    with pytest.raises(ValueError, match="CUDA graphs"):
        vision_cost_model(QWEN3_VL, TrainingRegime(vision_cuda_graphs=True))
    with pytest.raises(ValueError, match="'depth'"):
        vision_cost_model({"hidden_size": 4})


def test_language_terms_from_a_megatron_config():
    lm = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
              ffn_hidden_size=256, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
              gated_linear_unit=True, vocab_size=1000)
    m = vision_cost_model(QWEN3_VL, language_config=lm, flops_per_ms=1.0)
    attn = 128 * 128 + 2 * 128 * 2 * 32 + 128 * 128
    mlp = 2 * 3 * 128 * 128 + 128 * 4
    assert m.llm_ms_per_token == pytest.approx(2 * 3 * (2 * (attn + mlp) + 1000 * 128))
    assert m.llm_ms_per_len_sq == pytest.approx(2 * 3 * 2 * 4 * 32)
    cost = QwenVLCost(2, model=m, phases=True)
    vis, lang = cost({"input_ids": torch.zeros(1, 10), "attention_mask": torch.ones(1, 10)})
    assert vis == 0 and lang == round(1000 * (10 * m.llm_ms_per_token + 100 * m.llm_ms_per_len_sq))


def test_cost_files_v2_load_and_unit_terms_write_v3(tmp_path):
    v2 = {"format": "mm-balance-cost/v2", "vision_ms_per_token": 0.5, "vision_ms_per_token_sq": 0.0,
          "llm_ms_per_len_sq": 0.0, "const_ms": 0.0, "vision_backward_ratio": 2.0,
          "llm_backward_ratio": 2.0, "vision_ms_per_pack": 0.0, "llm_ms_per_token": 0.0}
    (tmp_path / "v2.json").write_text(json.dumps(v2))
    m = load_cost_file(str(tmp_path / "v2.json"))
    assert m.vision_ms_per_unit == 0 and m.to_json() == v2                 # still written as v2
    units = dataclasses.replace(m, vision_ms_per_unit=0.25, vision_ms_per_image=1.0)
    units.save(str(tmp_path / "v3.json"))
    data = json.loads((tmp_path / "v3.json").read_text())
    assert data["format"] == "mm-balance-cost/v3" and load_cost_file(str(tmp_path / "v3.json")) == units
    with pytest.raises(ValueError, match="unknown cost-file fields"):
        CostModel.from_json({**data, "format": "mm-balance-cost/v2"})
    f = PackFeatures((4, 4, 4), num_images=1)                             # one video of 3 frames
    assert units.forward_ms(f) == pytest.approx(0.5 * 12 + 0.25 * 3 + 1.0)


# --------------------------------------------------------------------------- unreadable batches

@dataclasses.dataclass
class GenericVisualInputs:      # Megatron-Bridge 0.6.x's fields
    pixel_values: object = None
    pixel_values_videos: object = None
    image_grid_thw: object = None
    video_grid_thw: object = None


@dataclasses.dataclass
class OtherRelease:             # a container this code does not know
    images: object = None


def test_unreadable_vision_input_is_an_error_naming_what_it_found():
    cost = QwenVLCost(2)
    grid = torch.tensor([[1, 4, 4]])
    ok = {"input_ids": torch.zeros(1, 4),
          "visual_inputs": GenericVisualInputs(pixel_values=torch.zeros(16, 8), image_grid_thw=grid)}
    assert cost(ok) == 16
    text = {"input_ids": torch.zeros(1, 4), "visual_inputs": GenericVisualInputs()}
    assert cost(text) == 0 and cost({"input_ids": torch.zeros(1, 4), "visual_inputs": None}) == 0
    cases = [
        ({"visual_inputs": GenericVisualInputs(pixel_values=torch.zeros(16, 8))},
         r"pixel_values without image_grid_thw.*visual_inputs \(GenericVisualInputs\) with \['pixel_values'\]"),
        ({"visual_inputs": GenericVisualInputs(pixel_values=torch.zeros(15, 8), image_grid_thw=grid)},
         "pixel_values has 15 patch rows but image_grid_thw sums to 16"),
        ({"visual_inputs": GenericVisualInputs(pixel_values_videos=torch.zeros(32, 8),
                                               video_grid_thw=torch.tensor([[1, 4, 4]]))},
         "pixel_values_videos has 32 patch rows but video_grid_thw sums to 16"),
        ({"input_ids": 1, "visual_inputs": OtherRelease(images=torch.zeros(2))},
         r"cannot read the Qwen-VL grids.*\['input_ids', 'visual_inputs'\].*OtherRelease.*\['images'\]"
         r".*Megatron-Bridge 0\.6\.x"),
        ({"visual_inputs": {"image_grid_thw": "1x4x4"}}, "must hold numbers"),
        ({"visual_inputs": GenericVisualInputs(pixel_values=torch.zeros(1, 3, 8, 8), image_grid_thw=grid)},
         r"shape \(1, 3, 8, 8\); expected patch rows"),
        ([1, 2], "is a list, expected a dict"),
    ]
    for batch, match in cases:
        with pytest.raises(QwenVLBatchError, match=match):
            cost(batch)
        with pytest.raises(QwenVLBatchError, match=match):         # the model path reads the same
            QwenVLCost(2, model=vision_cost_model(QWEN3_VL))(batch)
