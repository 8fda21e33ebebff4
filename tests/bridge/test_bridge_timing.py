"""Timing hooks on Megatron-Bridge's Qwen3-VL model and ``mm_balance.cost=auto`` on Bridge
(bridge/timing.py, bridge/iterator.py, cost/calibration.py's Qwen-VL features), without Bridge:

* the settings: ``timing``, ``timing_dir``, ``calibration_iters``, ``cost=auto`` reach the core
  config with ``checkpoint.load``/``save``; the refusals are the Megatron-LM path's;
* the features a record and a batch give agree, and ``cost=auto`` costs Bridge's batches
  (``visual_inputs`` grids) with the fit, image tokens before it;
* on 2 gloo ranks, through Bridge's ``wrap_train_data_iterator`` with balancing off, the hooks
  on a Qwen3-VL-shaped model (``vision_model(hidden_states=, grid_thw=)`` returning embeddings
  and deepstack features, ``language_model(decoder_input=...)``, called with keyword arguments
  as ``qwen3_vl_step`` calls it, inside two ``.module`` wrappers) record every micro-batch with
  its grids and change no loss and no gradient bitwise; the ranks' records give one agreed fit,
  and on records whose time is quadratic per frame one agreed per-frame choice.

The launcher runs (the real model, DP=2 x EP=2) are in test_bridge_realpath.py. About 10 s.
"""
import dataclasses
import json
import types

import pytest

from megatron_mm_balance.bridge.config import MMBalanceBridgeConfig, as_args
from megatron_mm_balance.bridge.model_spec import ModelSpec
from megatron_mm_balance.cost.calibration import AutoCost, CalibrationConfig, QwenVLFeatures, fit_phases
from megatron_mm_balance.megatron.checks import MMBalanceConfigError, checked_config
from megatron_mm_balance.testing.cpu_megatron import launch


def _as_args(mm, cfg, **kw):
    """``as_args`` as ``wrap_train_data_iterator`` calls it, the model read once first."""
    return as_args(mm, cfg, ModelSpec.read(cfg.model), **kw)

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

G, ITERS, HIDDEN, IMAGE_TOKEN = 3, 3, 16, 7


def bridge_cfg(mm, *, pp=1, ep=1, save="/ckpt", load="/ckpt"):
    """The parts of Bridge's ``ConfigContainer`` the glue reads."""
    model = types.SimpleNamespace(expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
                                  context_parallel_size=1, num_moe_experts=None, calculate_per_token_loss=False,
                                  vision_config=types.SimpleNamespace(spatial_merge_size=2))
    train = types.SimpleNamespace(micro_batch_size=1, global_batch_size=2 * G, rampup_batch_size=None,
                                  decrease_batch_size_if_needed=False)
    return types.SimpleNamespace(mm_balance=mm, model=model, train=train, data_parallel_size=2,
                                 logger=types.SimpleNamespace(log_interval=1, tensorboard_dir=None),
                                 checkpoint=types.SimpleNamespace(save=save, load=load),
                                 dataset=types.SimpleNamespace(dataloader_type="external"))


# -- settings ----------------------------------------------------------------------------

def test_settings_reach_the_core_config():
    mm = MMBalanceBridgeConfig(enabled=True, cost="auto", calibration_iters=3, timing_dir="/t")
    ts = types.SimpleNamespace(step=4, consumed_train_samples=0)
    cfg = checked_config(_as_args(mm, bridge_cfg(mm, ep=2), train_state=ts))
    assert (cfg.cost, cfg.calibration_iters, cfg.timing, cfg.timing_dir) == ("auto", 3, True, "/t")
    assert (cfg.megatron.save, cfg.megatron.load, cfg.megatron.start_iteration) == ("/ckpt", "/ckpt", 4)
    assert cfg.sync == "microstep"
    # timing alone (balancing off) and auto (on) resolve as the Megatron-LM flags do
    off = MMBalanceBridgeConfig(timing=True)
    assert off.wraps_train_iterator and checked_config(_as_args(off, bridge_cfg(off))).timing
    auto = MMBalanceBridgeConfig(enabled=True, cost="auto")
    assert checked_config(_as_args(auto, bridge_cfg(auto))).timing
    assert not MMBalanceBridgeConfig().wraps_train_iterator
    assert MMBalanceBridgeConfig().calibration_iters == 10 and not MMBalanceBridgeConfig().timing


@pytest.mark.parametrize("mm,layout,match", [
    (dict(cost="auto"), dict(pp=2), "pipeline-model-parallel-size 1"),
    (dict(cost="auto", calibration_iters=1), {}, "calibration-iters"),
])
def test_cost_auto_refusals(mm, layout, match):
    cfg = MMBalanceBridgeConfig(enabled=True, **mm)
    with pytest.raises(MMBalanceConfigError, match=match):
        checked_config(_as_args(cfg, bridge_cfg(cfg, **layout)))


# -- features and costs ------------------------------------------------------------------

def qwen_batch(grids, text=10):
    """A Bridge collate batch (``visual_inputs`` with the grids) and the model call's kwargs."""
    import torch
    n_lm = sum(t * h * w // 4 for t, h, w in grids)
    ids = torch.full((1, text + n_lm), 3, dtype=torch.long)
    ids[0, 1:1 + n_lm] = IMAGE_TOKEN
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    batch = {"input_ids": ids, "visual_inputs": types.SimpleNamespace(image_grid_thw=grid)}
    call = {"input_ids": ids, "labels": ids.clone(), "image_grid_thw": grid if grids else None,
            "pixel_values": torch.randn(sum(t * h * w for t, h, w in grids), 6), "attention_mask": None}
    return batch, call


def test_record_and_batch_features_agree():
    """One unit per frame: a video of t temporal patches is t frames of h*w."""
    from megatron_mm_balance.bridge.timing import qwen_vl_features
    f = QwenVLFeatures(2)
    for grids in ([[1, 4, 6]], [[1, 2, 2], [3, 4, 4]], []):
        batch, call = qwen_batch(grids)
        images, lengths, got = qwen_vl_features(None, (), call)
        assert got == grids and images == [t * h * w for t, h, w in grids]
        record = {"images": images, "lengths": lengths, "grids": got}
        assert f.of_record(record) == f.of_pack(batch)
        assert f.of_record(record).images == tuple(h * w for t, h, w in grids for _ in range(t))
        assert f.of_record(record).image_count == len(grids)
        assert f.tokens(batch) == sum(images)
    with pytest.raises(ValueError, match="grids"):
        f.of_record({"images": [4], "lengths": [8], "iteration": 2, "rank": 0})


def test_cost_auto_costs_bridge_batches_with_the_fit():
    """Records of 4 ranks whose vision time is quadratic per frame (large images, many small
    ones, videos): the replay of the calibration iterations (fit on the first, scored on the
    held-out rest) chooses a fitted per-frame model over the patch count, and Bridge batches
    are costed with it from iteration K + 2, a video per frame."""
    from megatron_mm_balance.testing import frame_records as fr
    K = 5
    recs = fr.frame_records(iterations=range(2, K + 1), ranks=4, G=G)
    auto = AutoCost(CalibrationConfig(iterations=K), collect=lambda a, b: [r for r in recs if a <= r["iteration"] <= b],
                    agree=lambda local, fit: fit(local), features=QwenVLFeatures(2))
    assert "qwen_vl_frames" in auto.identity
    small, large = qwen_batch([[1, 4, 4]])[0], qwen_batch([[1, 16, 16]])[0]
    video = qwen_batch([[4, 16, 16]])[0]
    assert auto.for_batch(0)(small) == (16, 0) and auto.for_batch(0)(large) == (256, 0)   # patch count
    assert auto.for_batch(0)(video) == (1024, 0)
    cost = auto.for_batch(K + 1)               # iteration K + 2: the choice from iterations 2..K
    assert auto.fit.ok and auto.fit.choice.startswith("fit"), auto.fit
    assert auto.fit.features == "qwen_vl_frames(merge=2)"
    m = auto.fit.model
    assert m.vision_ms_per_token_sq > 0        # the quadratic term: attention within each frame
    # vision forward + backward (x2) in microseconds, from the chosen model's own terms
    for batch, frames in ((small, [16]), (large, [256]), (video, [256] * 4)):
        want = (sum(m.vision_ms_per_token * p + m.vision_ms_per_token_sq * p * p + m.vision_ms_per_unit
                    for p in frames) + m.vision_ms_per_pack + m.vision_ms_per_image) * (1 + m.vision_backward_ratio)
        assert cost(batch)[0] == round(want * 1000)
    # the records' features through the extension point: the full fit recovers the quadratic
    direct = fit_phases(recs, features=QwenVLFeatures(2).of_record)
    assert direct.ok and direct.model.vision_ms_per_token_sq == pytest.approx(fr.PER_PATCH_SQ_MS, rel=1e-6)
    # a saved model of other units (the per-image features of before) is not applied to frames
    with pytest.raises(ValueError, match="prices qwen_vl_per-image"):
        AutoCost(CalibrationConfig(iterations=K), collect=None, agree=None, features=QwenVLFeatures(2),
                 saved=dataclasses.replace(auto.fit, features="qwen_vl_per-image(merge=2)"))


# -- the hooks on a Qwen3-VL-shaped model, 2 gloo ranks --------------------------------------

def toy_qwen3_vl(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class Vision(nn.Module):                     # patch embedding, blocks, 2 x 2 merger
        def __init__(self):
            super().__init__()
            self.patch_embed = nn.Linear(6, HIDDEN)
            self.blocks = nn.Sequential(nn.Linear(HIDDEN, 32), nn.GELU(), nn.Linear(32, HIDDEN))
            self.merger = nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, hidden_states, grid_thw):
            x = self.blocks(self.patch_embed(hidden_states))
            merged = self.merger(x.reshape(-1, 4 * HIDDEN))
            return merged, [0.5 * merged]          # embeddings, deepstack features

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(50, HIDDEN)
            self.body = nn.Sequential(nn.Linear(HIDDEN, 32), nn.GELU(), nn.Linear(32, HIDDEN))
            self.head = nn.Linear(HIDDEN, 50)

        def forward(self, input_ids=None, decoder_input=None, labels=None, visual_pos_masks=None,
                    deepstack_visual_embeds=None, **_):
            h = self.body(decoder_input).transpose(0, 1)          # [b, s, h]
            if deepstack_visual_embeds:
                h = h.clone()
                h[visual_pos_masks] = h[visual_pos_masks] + deepstack_visual_embeds[0]
            return nn.functional.cross_entropy(self.head(h).transpose(1, 2), labels, reduction="none")

    class Qwen3VL(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_model = Vision()
            self.language_model = LM()

        def forward(self, input_ids, labels=None, loss_mask=None, attention_mask=None, position_ids=None,
                    packed_seq_params=None, pixel_values=None, image_grid_thw=None, **_):
            combined = self.language_model.embedding(input_ids).clone()
            mask = input_ids == IMAGE_TOKEN
            ds = None
            if image_grid_thw is not None and image_grid_thw.shape[0] > 0:
                v, ds = self.vision_model(hidden_states=pixel_values, grid_thw=image_grid_thw)
                combined[mask] = v
            return self.language_model(input_ids=input_ids, decoder_input=combined.transpose(0, 1),
                                       labels=labels, visual_pos_masks=mask, deepstack_visual_embeds=ds)

    class Wrapper(nn.Module):                    # DDP(Float16Module(model))
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *a, **k):
            return self.module(*a, **k)

    return Wrapper(Wrapper(Qwen3VL()))


def toy_grids(rank, it, m):
    """1-2 images of 2 x 2-merged patches, one text-only micro-batch per iteration."""
    import torch
    if m == 1:
        return []
    g = torch.Generator().manual_seed(100 * rank + 10 * it + m)
    return [[1, 2 * int(torch.randint(1, 5, (1,), generator=g)), 2 * int(torch.randint(1, 5, (1,), generator=g))]
            for _ in range(int(torch.randint(1, 3, (1,), generator=g)))]


def train(rank, mm):
    """ITERS iterations of G micro-batches, Bridge's counter advanced as its loop does."""
    import torch
    import torch.distributed as dist
    from megatron_mm_balance.bridge.iterator import wrap_train_data_iterator

    torch.manual_seed(rank)
    model = toy_qwen3_vl()
    state = types.SimpleNamespace(train_state=types.SimpleNamespace(step=0, consumed_train_samples=0))
    calls = [qwen_batch(toy_grids(rank, it, m), text=6 + m) for it in range(ITERS) for m in range(G)]
    loader = iter([batch for batch, _ in calls])
    train_iterator = wrap_train_data_iterator(loader, bridge_cfg(mm), None, state=state, model=[model])
    if not mm.timing_dir:
        assert train_iterator is loader          # off, no timing: unchanged
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for it in range(ITERS):
        opt.zero_grad()
        for m in range(G):
            next(train_iterator)                 # what the step reads (the hooks' features, host copy)
            _, call = calls[it * G + m]
            loss = model(**call).mean() / G
            loss.backward()
            losses.append(loss.detach().clone())
        for p in model.parameters():
            dist.all_reduce(p.grad)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
        state.train_state.step += 1
    with torch.no_grad():                        # evaluation: not recorded
        model.eval()
        model(**qwen_batch(toy_grids(rank, 0, 0))[1])
    return torch.stack(losses), torch.stack(grads)


def hooks_worker(rank, world, out_dir):
    import torch
    import torch.distributed as dist
    import megatron_mm_balance.megatron.timing as timing
    from megatron_mm_balance.bridge.iterator import auto_features_for

    made = []
    orig = timing.TimingRecorder.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        made.append(self)

    timing.TimingRecorder.__init__ = spy
    base = train(rank, MMBalanceBridgeConfig())
    assert not made, "hooks installed with the timing settings off"
    hooked = train(rank, MMBalanceBridgeConfig(timing_dir=out_dir))
    rec = made[0]
    rec.close()
    records = [json.loads(x) for x in open(rec.path)]
    want = [{"iteration": it + 1, "microbatch": m, "rank": rank, "grids": toy_grids(rank, it, m),
             "images": [t * h * w for t, h, w in toy_grids(rank, it, m)], "lengths": [6 + m + sum(
                 t * h * w // 4 for t, h, w in toy_grids(rank, it, m))]}
            for it in range(ITERS) for m in range(G)]
    # the ranks' records of iterations 2-3 fitted on one rank, agreed by both (cost=auto's flow)
    from megatron_mm_balance.megatron.config import MegatronArgs, MMBalanceConfig
    from megatron_mm_balance.megatron.timing import auto_cost_fn
    cfg = MMBalanceConfig(enabled=True, cost="auto", calibration_iters=2, sync="microstep",
                          megatron=MegatronArgs(start_iteration=0))
    cost = auto_cost_fn(cfg, rec, dist.new_group([0, 1], backend="gloo"),
                        features=auto_features_for(ModelSpec.read(bridge_cfg(None).model)))
    cost.for_batch(3)
    probes = [cost(qwen_batch(g)[0]) for g in ([[1, 2, 2]], [[1, 8, 8]], [[1, 4, 4], [2, 4, 4]], [])]
    frames = per_frame_choice(rank, cfg)
    return {"losses_equal": bool(torch.equal(base[0], hooked[0])),
            "grads_equal": bool(torch.equal(base[1], hooked[1])), "records": records, "want": want,
            "fit": json.dumps(cost.fit.to_json(), sort_keys=True), "probes": probes, **frames}


class FrameRecords:
    """This rank's share of synthetic per-frame records, as the timing recorder hands them over."""

    def __init__(self, records):
        self._records = records

    def wait_until_done(self, last, wait_s):
        return True

    def records(self, first, last):
        return [r for r in self._records if first <= r["iteration"] <= last]


def per_frame_choice(rank, cfg):
    """cost=auto's agreement on records whose time is quadratic per frame: each rank holds its
    own records, the group's first rank replays every rank's (the toy tower's FLOP model among
    the candidates), both balance with the one choice broadcast."""
    import dataclasses as dc

    import torch.distributed as dist
    from megatron_mm_balance.cost.flops import CPU_FLOPS_PER_MS, VISION_PRESETS, vision_cost_model
    from megatron_mm_balance.megatron.timing import auto_cost_fn
    from megatron_mm_balance.testing import frame_records as fr
    K = 5
    mine = [r for r in fr.frame_records(iterations=range(2, K + 1), ranks=2, G=8, noise=0.02) if r["rank"] == rank]
    toy = vision_cost_model(VISION_PRESETS["qwen3-vl-tiny-cpu"], flops_per_ms=CPU_FLOPS_PER_MS)
    cost = auto_cost_fn(dc.replace(cfg, calibration_iters=K), FrameRecords(mine),
                        dist.new_group([0, 1], backend="gloo"),
                        features=QwenVLFeatures(2, flops_model=toy))
    cost.for_batch(K + 1)
    probes = [cost(qwen_batch(g)[0]) for g in ([[1, 8, 8]] * 4, [[1, 16, 16]], [[4, 8, 8]], [[1, 4, 4], [2, 6, 6]])]
    return {"frames_fit": json.dumps(cost.fit.to_json(), sort_keys=True), "frames_probes": probes}


def test_hooks_on_qwen3_vl_record_every_microbatch_and_change_nothing(tmp_path):
    results = launch(hooks_worker, 2, (str(tmp_path),), timeout=120)
    for rank, res in enumerate(results):
        assert res["losses_equal"] and res["grads_equal"], f"rank {rank}: the hooks changed the maths"
        recs = res["records"]
        got = [{k: r[k] for k in ("iteration", "microbatch", "rank", "grids", "images", "lengths")} for r in recs]
        assert got == res["want"], f"rank {rank}: records do not match the micro-batches"
        for r in recs:
            assert r["lm_forward_ms"] > 0 and r["lm_backward_ms"] > 0, r
            if r["grids"]:
                assert r["vision_forward_ms"] > 0 and r["vision_backward_ms"] > 0, r
            else:
                assert r["vision_forward_ms"] == r["vision_backward_ms"] == 0.0, r
    assert results[0]["fit"] == results[1]["fit"], "the ranks decided different fits"
    fit = json.loads(results[0]["fit"])
    assert (fit["first_iteration"], fit["last_iteration"], fit["records"]) == (2, 2, 2 * G)
    assert results[0]["probes"] == results[1]["probes"], "the ranks compute different costs"
    # per-frame records: one choice on both ranks, a per-frame model, the same integer costs
    assert results[0]["frames_fit"] == results[1]["frames_fit"], "the ranks decided different per-frame fits"
    frames = json.loads(results[0]["frames_fit"])
    assert frames["ok"] and frames["features"] == "qwen_vl_frames(merge=2)", frames["reason"]
    assert frames["choice"] in ("flops", "fit", "fit+frame", "fit+image"), frames["replay"]["table"]
    assert [r["name"] for r in frames["replay"]["rows"]][1:-1] == ["image-tokens", "flops", "fit", "fit+frame",
                                                                 "fit+image"]
    assert results[0]["frames_probes"] == results[1]["frames_probes"]
    four_small, one_large = results[0]["frames_probes"][:2]
    assert one_large[0] > four_small[0], "a 256-patch frame costs more than four 64-patch frames"


def test_hooks_read_no_device_tensor_with_the_host_features():
    """The hooks as Bridge installs them, the grids handed over from the micro-batch's host
    copy and the call on the (fake) device: no device read of ours; without the hand-over the
    call's grids are read (counted as ours), the reads the host copy saves."""
    import torch
    from megatron_mm_balance.bridge.timing import call_lengths, qwen_vl_features, qwen_vl_pack_features
    from megatron_mm_balance.megatron.timing import install_timing
    from megatron_mm_balance.testing.fake_cuda import DeviceReads, FakeDeviceTensor

    model = toy_qwen3_vl()
    rec = install_timing([model], out_dir=None, interval=1, features=qwen_vl_features,
                         host_features=qwen_vl_pack_features, call_lengths=call_lengths, writers=(None, None))
    on_device = lambda call: {k: v.as_subclass(FakeDeviceTensor) if isinstance(v, torch.Tensor) else v  # noqa: E731
                              for k, v in call.items()}
    grids = [[1, 2, 4], [2, 2, 2]]
    batch, call = qwen_batch(grids, text=5)
    with DeviceReads() as reads:
        rec.expect(rec.host_features(batch))
        model(**on_device(call)).mean().backward()
    assert reads.ours() == [], reads.ours()
    with DeviceReads() as fallback:
        model(**on_device(call)).mean().backward()
    assert [r.what for r in fallback.ours()] == ["tolist()"]          # the call's image_grid_thw
    rec.close()
    first, second = rec.records(0, 10)
    for r in (first, second):
        assert r["grids"] == grids and r["images"] == [8, 8] and r["lengths"] == [5 + 2 + 2]
