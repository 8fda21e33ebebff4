"""``mm_balance.vision`` settings and the Qwen3-VL frame helpers of bridge/vision.py (fast, no
Bridge needed): defaults, values, the one-line refusals, frames of grids."""
import types

import numpy as np
import pytest
import torch

from megatron_mm_balance.bridge.config import MMBalanceBridgeConfig, as_args
from megatron_mm_balance.bridge.model_spec import ModelSpec
from megatron_mm_balance.bridge.vision import checked_vision, frame_grid, frames_of
from megatron_mm_balance.megatron.checks import MMBalanceConfigError


def _as_args(mm, cfg, **kw):
    """``as_args`` as ``wrap_train_data_iterator`` calls it, the model read once first."""
    return as_args(mm, cfg, ModelSpec.read(cfg.model), **kw)


def _cfg(**model):
    vision = types.SimpleNamespace(spatial_merge_size=2, hidden_size=64, intermediate_size=128,
                                   deepstack_visual_indexes=[0], depth=1, patch_size=16, temporal_patch_size=2,
                                   in_channels=3, out_hidden_size=128)
    fields = dict(expert_model_parallel_size=2, num_moe_experts=4, moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=1e-2, calculate_per_token_loss=False, hybrid_context_parallel=False,
                  vision_config=vision)
    fields.update(model)
    train = types.SimpleNamespace(micro_batch_size=1, global_batch_size=8, rampup_batch_size=None,
                                  decrease_batch_size_if_needed=False)
    return types.SimpleNamespace(model=types.SimpleNamespace(**fields), train=train,
                                 logger=types.SimpleNamespace(log_interval=5, tensorboard_dir=None),
                                 data_parallel_size=2, dataset=types.SimpleNamespace(dataloader_type="external"))


def test_defaults_keep_todays_behaviour():
    mm = MMBalanceBridgeConfig()
    assert mm.vision == "packs" and mm.image_patch_cap is None
    cfg = _cfg()
    assert checked_vision(mm, ModelSpec.read(cfg.model)) == "packs"
    _as_args(MMBalanceBridgeConfig(enabled=True, vision="images", image_patch_cap=4096), cfg)


@pytest.mark.parametrize("mm,model,match", [
    (dict(vision="frames"), {}, "mm_balance.vision must be one of packs, images, got 'frames'"),
    (dict(image_patch_cap=0), {}, "mm_balance.image_patch_cap must be a positive integer"),
    (dict(image_patch_cap=2.5), {}, "mm_balance.image_patch_cap must be a positive integer"),
    (dict(image_link_gbps=0), {}, r"mm_balance.image_link_gbps must be a positive number \(GB/s\)"),
    (dict(image_link_gbps="fast"), {}, "mm_balance.image_link_gbps must be a positive number"),
    (dict(image_link_gbps=float("nan")), {}, "mm_balance.image_link_gbps must be a positive number"),
    (dict(vision_tflops=-1.0), {}, r"mm_balance.vision_tflops must be a positive number \(TFLOP/s\)"),
    (dict(vision_tflops=float("inf")), {}, "mm_balance.vision_tflops must be a positive number"),
    (dict(image_rates="fast"), {}, "mm_balance.image_rates must be one of settings, measured, got 'fast'"),
    (dict(image_overlap="yes"), {}, "mm_balance.image_overlap must be true or false, got 'yes'"),
    (dict(image_pack_cost="tokens"), {},
     "mm_balance.image_pack_cost must be one of heaviest-frame, cost, got 'tokens'"),
    (dict(vision="images", enabled=False), {}, "vision=images needs mm_balance.enabled=true"),
    (dict(vision="images", mode="shadow"), {}, "mm_balance.mode=shadow moves nothing"),
    (dict(vision="images", mode="control"), {}, "mm_balance.mode=control moves nothing"),
    (dict(vision="images", cost="auto"), {}, "cannot be combined with mm_balance.cost=auto"),
    (dict(vision="images"), dict(vision_config=types.SimpleNamespace(spatial_merge_size=2)),
     "needs a Qwen3-VL vision tower"),
    (dict(vision="images"), dict(vision_config=None), "needs a Qwen3-VL vision tower"),
    (dict(vision="images"), dict(vision_cuda_graph_impl="transformer_engine"), "vision CUDA graphs"),
    (dict(vision="images"), dict(dist_train=types.SimpleNamespace(use_dist_train=True)), "use_dist_train"),
])
def test_refusals_name_the_setting_in_one_line(mm, model, match):
    values = dict(enabled=True)
    values.update(mm)
    with pytest.raises(MMBalanceConfigError, match=match) as err:
        _as_args(MMBalanceBridgeConfig(**values), _cfg(**model))
    assert "\n" not in str(err.value)


def test_without_expert_parallelism_one_line_and_nothing_installed(capsys):
    """Without expert parallelism no rank waits for another within an iteration: images mode
    says so in one line (global rank 0; here no process group) and installs nothing, before any
    group is made."""
    from megatron_mm_balance.bridge.model_spec import ModelSpec
    from megatron_mm_balance.bridge.vision import NOTHING_TO_BALANCE, install_frame_balance
    cfg = _cfg(expert_model_parallel_size=1)
    mm = MMBalanceBridgeConfig(enabled=True, vision="images")
    spec = ModelSpec.read(cfg.model)
    assert install_frame_balance(object(), mm, spec, None, None, None, None) is None
    assert capsys.readouterr().out.strip() == NOTHING_TO_BALANCE


def test_transfer_rates_are_the_settings_else_the_devices_nominal_ones():
    from megatron_mm_balance.bridge.vision import NOMINAL_RATES, transfer_rates
    assert transfer_rates(MMBalanceBridgeConfig(), "cuda") == NOMINAL_RATES["cuda"] == (25.0, 400.0)
    assert transfer_rates(MMBalanceBridgeConfig(), "cpu") == NOMINAL_RATES["cpu"]
    assert transfer_rates(MMBalanceBridgeConfig(image_link_gbps=450, vision_tflops=300.0), "cuda") == (450.0, 300.0)
    assert transfer_rates(MMBalanceBridgeConfig(image_link_gbps=float("inf")), "cuda")[0] == float("inf")
    _as_args(MMBalanceBridgeConfig(enabled=True, vision="images", image_link_gbps=float("inf")), _cfg())


def test_a_unit_of_frame_cost_is_four_hidden_depth_flops():
    """Per layer a frame of p patches takes 2*h*p*(p + 2h + ffn) multiply-adds (QKV 3ph^2,
    output ph^2, scores and values 2p^2h, MLP 2ph*ffn): 4*h FLOPs per unit of p*(p + 2h + ffn)."""
    from megatron_mm_balance.bridge.vision import tower_flops_per_unit
    h, ffn, depth, p = 1152, 4304, 27, 1000
    macs = depth * (3 * p * h * h + p * h * h + 2 * p * p * h + 2 * p * h * ffn)
    vision = dict(hidden_size=h, intermediate_size=ffn, depth=depth, patch_size=16, out_hidden_size=2048)
    cfg = types.SimpleNamespace(vision_config=types.SimpleNamespace(**vision))
    assert tower_flops_per_unit(ModelSpec.read(cfg)) * p * (p + 2 * h + ffn) == 2 * macs
    vision.pop("depth")
    with pytest.raises(ValueError, match="model.vision_config: the config has no 'depth'"):
        tower_flops_per_unit(ModelSpec.read(types.SimpleNamespace(vision_config=types.SimpleNamespace(**vision))))


def test_frames_of_grids_and_back():
    grid = torch.tensor([[1, 4, 6], [3, 2, 2], [1, 2, 2], [2, 8, 8]])
    hw = frames_of(grid)
    assert hw.tolist() == [[4, 6], [2, 2], [2, 2], [2, 2], [2, 2], [8, 8], [8, 8]]
    assert frames_of(None).shape == (0, 2)
    # consecutive frames of one size are one grid row (as Bridge's collapse_thw)
    assert frame_grid(hw).tolist() == [[1, 4, 6], [4, 2, 2], [2, 8, 8]]
    assert frame_grid(np.zeros((0, 2), np.int64)).shape == (0, 3)


def test_report_one_line_per_interval_from_the_reporting_rank(capsys):
    from megatron_mm_balance.bridge.vision import FrameReport
    from megatron_mm_balance.runtime.frames import frame_figures

    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, name, value, step):
            self.scalars.append((name, value, step))

    it = {"now": 1}
    tb = Writer()
    report = FrameReport(interval=2, iteration_fn=lambda: it["now"], reporter=True, writers=(tb, None))
    quiet = FrameReport(interval=2, iteration_fn=lambda: it["now"], reporter=False, writers=(None, None))
    figures = frame_figures(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([4, 3, 1]), np.array([4, 3, 1]), 2)
    for iteration in (1, 1, 2, 2, 3, 3, 4, 5):           # two micro-steps per iteration
        it["now"] = iteration
        for r in (report, quiet):
            r.add(figures if iteration != 3 else None)  # iteration 3: no frame anywhere
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[mm-balance-vision]")]
    assert [x.split(" | ")[0] for x in lines] == ["[mm-balance-vision] iteration 2",
                                                  "[mm-balance-vision] iteration 4"]
    assert "micro_steps: 4 | frames: 12 | patches: 32 | frames_moved: 4" in lines[0]
    assert "micro_steps: 3 | frames: 3 |" in lines[1]      # iterations 3 (two empty micro-steps) and 4
    assert ("mm-balance-vision/frames_moved", 4.0, 2) in tb.scalars and not quiet.lines


def test_report_lines_name_the_iterations_whose_frames_they_hold(capsys):
    """``mm_balance.mode=crossover-even``: frames only at even iterations. Each line is labelled
    with the iteration of its newest figures (not the one before the next figures arrive), at
    every interval and at two."""
    from megatron_mm_balance.bridge.vision import FrameReport
    from megatron_mm_balance.runtime.frames import frame_figures
    figures = frame_figures(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([4, 3, 1]), np.array([4, 3, 1]), 2)
    for interval, expected, micro_steps in ((1, [2, 4, 6], 2), (2, [2, 4, 6], 2), (4, [4], 4)):
        it = {"now": None}
        report = FrameReport(interval=interval, iteration_fn=lambda: it["now"], reporter=True, writers=(None, None))
        for iteration in (2, 2, 4, 4, 6, 6, 8):
            it["now"] = iteration
            report.add(figures)
        lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[mm-balance-vision]")]
        assert [int(x.split(" | ")[0].split()[-1]) for x in lines] == expected, (interval, lines)
        assert all(f"micro_steps: {micro_steps} |" in x for x in lines), (interval, lines)


def test_images_mode_places_packs_on_their_heaviest_frame():
    """``vision=images`` (``image_pack_cost=heaviest-frame``, the default) places packs on their
    heaviest frame by the frame planner's cost ``p * (p + alpha)``, alpha the whole tower's
    per-patch multiply-adds over its per-squared-patch ones; ``cost`` and ``vision=packs``
    keep ``mm_balance.cost``'s."""
    from megatron_mm_balance.bridge.vision import pack_cost_for
    from megatron_mm_balance.cost.pack import QwenVLCost
    model = ModelSpec.read(_cfg().model)
    default = QwenVLCost(2)
    assert pack_cost_for(MMBalanceBridgeConfig(enabled=True), model, default) is default
    assert pack_cost_for(MMBalanceBridgeConfig(enabled=True, vision="images", image_pack_cost="cost"),
                         model, default) is default
    cost = pack_cost_for(MMBalanceBridgeConfig(enabled=True, vision="images"), model, default)
    # one layer's projections and MLP 4*64^2 + 2*64*128, the patch embedding (3*2*16*16)*64, two
    # mergers (the final and one deepstack) of 64^2*2^2 + 64*128 each; over 2*64 per squared patch
    alpha = (4 * 64 ** 2 + 2 * 64 * 128 + 1536 * 64 + 2 * (64 ** 2 * 4 + 64 * 128)) // (2 * 64)
    assert alpha == 1408 and cost.components == 1 and "alpha=1408" in cost.identity
    # one 32 x 32 image and a video of three 16 x 16 frames: the image's frame is the heaviest
    pack = {"image_grid_thw": torch.tensor([[1, 32, 32]]), "video_grid_thw": torch.tensor([[3, 16, 16]])}
    assert cost(pack) == 1024 * (1024 + alpha)
    # a video's frames apart: three frames of 256 patches, not one of 768
    assert cost({"video_grid_thw": [[3, 16, 16]]}) == 256 * (256 + alpha)
    assert cost({"input_ids": torch.zeros(1, 8)}) == 0                      # text only
    # many small frames weigh less than one large one of the same patch count (the patch count ties)
    assert cost({"image_grid_thw": [[1, 8, 8]] * 16}) < cost({"image_grid_thw": [[1, 32, 32]]})
    assert default({"image_grid_thw": [[1, 8, 8]] * 16}) == default({"image_grid_thw": [[1, 32, 32]]})
