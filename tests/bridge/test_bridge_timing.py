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
  its grids and change no loss and no gradient bitwise; the ranks' records give one agreed fit.

The launcher runs (the real model, DP=2 x EP=2) are in test_bridge_realpath.py. About 10 s.
"""
import json
import types

import pytest

from megatron_mm_balance.bridge.config import MMBalanceBridgeConfig, as_args
from megatron_mm_balance.cost.calibration import AutoCost, CalibrationConfig, QwenVLFeatures, fit_phases
from megatron_mm_balance.megatron.checks import MMBalanceConfigError, checked_config
from megatron_mm_balance.testing.cpu_megatron import launch

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
    cfg = checked_config(as_args(mm, bridge_cfg(mm, ep=2), train_state=ts))
    assert (cfg.cost, cfg.calibration_iters, cfg.timing, cfg.timing_dir) == ("auto", 3, True, "/t")
    assert (cfg.megatron.save, cfg.megatron.load, cfg.megatron.start_iteration) == ("/ckpt", "/ckpt", 4)
    assert cfg.sync == "microstep"
    # timing alone (balancing off) and auto (on) resolve as the Megatron-LM flags do
    off = MMBalanceBridgeConfig(timing=True)
    assert off.wraps_train_iterator and checked_config(as_args(off, bridge_cfg(off))).timing
    auto = MMBalanceBridgeConfig(enabled=True, cost="auto")
    assert checked_config(as_args(auto, bridge_cfg(auto))).timing
    assert not MMBalanceBridgeConfig().wraps_train_iterator
    assert MMBalanceBridgeConfig().calibration_iters == 10 and not MMBalanceBridgeConfig().timing


@pytest.mark.parametrize("mm,layout,match", [
    (dict(cost="auto"), dict(pp=2), "pipeline-model-parallel-size 1"),
    (dict(cost="auto", calibration_iters=1), {}, "calibration-iters"),
])
def test_cost_auto_refusals(mm, layout, match):
    cfg = MMBalanceBridgeConfig(enabled=True, **mm)
    with pytest.raises(MMBalanceConfigError, match=match):
        checked_config(as_args(cfg, bridge_cfg(cfg, **layout)))


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
    from megatron_mm_balance.bridge.timing import qwen_vl_features
    f = QwenVLFeatures(2)
    for grids in ([[1, 4, 6]], [[1, 2, 2], [2, 4, 4]], []):
        batch, call = qwen_batch(grids)
        images, lengths, got = qwen_vl_features(None, (), call)
        assert got == grids and images == [t * h * w for t, h, w in grids]
        record = {"images": images, "lengths": lengths, "grids": got}
        assert f.of_record(record) == f.of_pack(batch)
        assert f.tokens(batch) == sum(images)
    with pytest.raises(ValueError, match="grids"):
        f.of_record({"images": [4], "lengths": [8], "iteration": 2, "rank": 0})


def grid_records(iterations=range(2, 5), ranks=2, seed=0):
    """Records with grids whose vision time follows a known per-image quadratic."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for it in iterations:
        for m in range(G):
            for r in range(ranks):
                grids = [[1, 2 * int(rng.integers(1, 9)), 2 * int(rng.integers(1, 9))]
                         for _ in range(int(rng.integers(1, 3)))]
                n = [t * h * w for t, h, w in grids]
                vf = 0.2 * sum(n) + 1e-3 * sum(x * x for x in n) + 5.0
                out.append(dict(iteration=it, microbatch=m, rank=r, images=n, lengths=[512], grids=grids,
                                vision_forward_ms=vf, vision_backward_ms=2 * vf, lm_forward_ms=50.0,
                                lm_backward_ms=60.0, start_s=0.0, end_s=0.0))
    return out


def test_cost_auto_costs_bridge_batches_with_the_fit():
    """Records of 4 ranks whose vision time is quadratic per image: the replay of the
    calibration iterations (fit on the first, scored on the held-out rest) chooses a fitted
    model over image tokens, and Bridge batches are costed with it from iteration K + 2."""
    K = 5
    recs = grid_records(iterations=range(2, K + 1), ranks=4)
    auto = AutoCost(CalibrationConfig(iterations=K), collect=lambda a, b: [r for r in recs if a <= r["iteration"] <= b],
                    agree=lambda local, fit: fit(local), features=QwenVLFeatures(2))
    assert "qwen_vl_per-image" in auto.identity
    small, large = qwen_batch([[1, 4, 4]])[0], qwen_batch([[1, 16, 16]])[0]
    assert auto.for_batch(0)(small) == (16, 0) and auto.for_batch(0)(large) == (256, 0)   # image tokens
    cost = auto.for_batch(K + 1)               # iteration K + 2: the choice from iterations 2..K
    assert auto.fit.ok and auto.fit.choice.startswith("fit"), auto.fit
    m = auto.fit.model
    assert m.vision_ms_per_token_sq > 0        # the quadratic term: attention within each image
    v_small, v_large = cost(small)[0], cost(large)[0]
    assert v_large > 16 * v_small              # quadratic per image, not the 16x of image tokens
    # vision forward + backward (x2) in microseconds, from the chosen model's own terms
    for batch, n in ((small, 16), (large, 256)):
        want = (m.vision_ms_per_token * n + m.vision_ms_per_token_sq * n * n + m.vision_ms_per_pack
                + m.vision_ms_per_image) * (1 + m.vision_backward_ratio)
        assert cost(batch)[0] == round(want * 1000)
    # the records' features through the extension point: the full fit recovers the quadratic
    direct = fit_phases(recs, features=QwenVLFeatures(2).of_record)
    assert direct.ok and direct.model.vision_ms_per_token_sq == pytest.approx(1e-3, rel=1e-6)


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
    sentinel = object()
    assert wrap_train_data_iterator(sentinel, bridge_cfg(mm), None, state=state, model=[model]) is sentinel
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for it in range(ITERS):
        opt.zero_grad()
        for m in range(G):
            _, call = qwen_batch(toy_grids(rank, it, m), text=6 + m)
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
                        features=auto_features_for(bridge_cfg(None).model))
    cost.for_batch(3)
    probes = [cost(qwen_batch(g)[0]) for g in ([[1, 2, 2]], [[1, 8, 8]], [[1, 4, 4], [2, 4, 4]], [])]
    return {"losses_equal": bool(torch.equal(base[0], hooked[0])),
            "grads_equal": bool(torch.equal(base[1], hooked[1])), "records": records, "want": want,
            "fit": json.dumps(cost.fit.to_json(), sort_keys=True), "probes": probes}


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
