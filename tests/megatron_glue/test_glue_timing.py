"""Per-pack timing hooks (megatron/timing.py) and --mm-balance-cost auto under real gloo ranks.

* the hooks record every micro-batch on every rank, with the pack's features, through
  DDP/Float16Module-style wrappers, and change no loss and no gradient (bitwise);
* every rank agrees on the fitted costs: each rank's records differ, the fit is decided
  once and broadcast, the balancer switches at the same global batch everywhere, and
  every rank's integer costs for the same packs are identical;
* the fit survives a checkpoint (the file beside ``--save``, read back on ``--load``).

About 15 s on 2 cores.
"""
import argparse
import json

import pytest

from megatron_mm_balance.testing.cpu_megatron import launch

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

G, ITERS = 4, 3
TILE_TOKENS = 4           # the toy encoder's tokens per tile (LLaVA's img_seq_len)


def toy_llava(seed=0):
    """A LLaVA-shaped model: ``vision_model``, ``vision_projection``, ``language_model`` (with
    ``embedding``), called like examples/multimodal calls LLaVAModel; wrapped twice in
    ``.module`` wrappers like Megatron's DDP(Float16Module(model))."""
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class Vision(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Linear(3, 16)
            self.block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

        def forward(self, images):                      # [tiles, tokens, 3]
            return self.block(self.conv1(images))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(50, 16)
            self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
            self.head = nn.Linear(16, 50)

        def forward(self, input_ids=None, position_ids=None, attention_mask=None, decoder_input=None,
                    labels=None, **_):
            logits = self.head(self.body(decoder_input))
            return nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")

    class ToyLLaVA(nn.Module):
        img_seq_len = TILE_TOKENS

        def __init__(self):
            super().__init__()
            self.vision_model = Vision()
            self.vision_projection = nn.Linear(16, 16)
            self.language_model = LM()

        def forward(self, images, input_ids, position_ids, attention_mask, labels, loss_mask,
                    num_image_tiles=None, packed_seq_params=None):
            text = self.language_model.embedding(input_ids)              # [1, s, h]
            if images is not None and images.shape[0] > 0:
                img = self.vision_projection(self.vision_model(images)).reshape(1, -1, 16)
                combined = torch.cat([img, text], dim=1)
                labels = torch.cat([torch.zeros(1, img.shape[1], dtype=labels.dtype), labels], dim=1)
            else:
                combined = text
            return self.language_model(decoder_input=combined, labels=labels), loss_mask

    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *a, **k):
            return self.module(*a, **k)

    return Wrapper(Wrapper(ToyLLaVA()))


def toy_batch(rank, it, m):
    """Micro-batch m of iteration it on rank: 0-3 images of 1-3 tiles (one text-only pack per
    iteration), two samples of different lengths."""
    import torch
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(1000 * rank + 10 * it + m)
    tiles = [] if m == 1 else [int(t) for t in torch.randint(1, 4, (int(torch.randint(1, 4, (1,), generator=g)),),
                                                              generator=g)]
    n_text = 6 + m
    images = torch.randn(sum(tiles), TILE_TOKENS, 3, generator=g) if tiles else torch.empty(0)
    total = sum(tiles) * TILE_TOKENS + n_text
    cu = torch.tensor([0, total // 2, total], dtype=torch.int32)
    return dict(images=images, input_ids=torch.randint(0, 50, (1, n_text), generator=g),
                labels=torch.randint(0, 50, (1, n_text), generator=g),
                num_image_tiles=torch.tensor(tiles, dtype=torch.int32),
                packed_seq_params=SimpleNamespace(cu_seqlens_q=cu)), tiles, [total // 2, total - total // 2]


def train(rank, hooks, out_dir=None):
    """ITERS iterations of G micro-batches; returns losses, gradient sums, and the recorder."""
    import torch
    import torch.distributed as dist
    from megatron_mm_balance.megatron.iterator import wrap_train_data_iterator

    model = toy_llava()
    args = argparse.Namespace(mm_balance=False, mm_balance_timing=hooks, mm_balance_timing_dir=out_dir,
                              mm_balance_log_interval=1, curr_iteration=None)
    loader = iter([toy_batch(rank, it, m)[0] for it in range(ITERS) for m in range(G)])
    train_iterator = wrap_train_data_iterator(loader, args, model=[model])
    if not hooks:
        assert train_iterator is loader                # off, no timing: unchanged
    losses, grads = [], []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(ITERS):
        args.curr_iteration = it                       # Megatron's 0-based counter
        opt.zero_grad()
        for m in range(G):
            batch = next(train_iterator)
            out, _ = model(batch["images"], batch["input_ids"], None, None, batch["labels"], None,
                           num_image_tiles=batch["num_image_tiles"],
                           packed_seq_params=batch["packed_seq_params"])
            loss = out.mean() / G
            loss.backward()
            losses.append(loss.detach().clone())
        for p in model.parameters():
            dist.all_reduce(p.grad)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
    with torch.no_grad():                              # evaluation: not recorded
        model.eval()
        batch, _, _ = toy_batch(rank, 0, 0)
        model(batch["images"], batch["input_ids"], None, None, batch["labels"], None,
              num_image_tiles=batch["num_image_tiles"], packed_seq_params=batch["packed_seq_params"])
    return torch.stack(losses), torch.stack(grads)


def hooks_worker(rank, world, out_dir):
    import torch
    import megatron_mm_balance.megatron.timing as timing

    made = []
    orig = timing.TimingRecorder.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        made.append(self)

    timing.TimingRecorder.__init__ = spy
    base_l, base_g = train(rank, hooks=False)
    assert not made
    l, g = train(rank, hooks=True, out_dir=out_dir)
    rec = made[0]
    rec.close()
    records = [json.loads(x) for x in open(rec.path)]
    want = []
    for it in range(ITERS):
        for m in range(G):
            _, tiles, lengths = toy_batch(rank, it, m)
            want.append({"iteration": it + 1, "microbatch": m, "rank": rank,
                         "images": [t * TILE_TOKENS for t in tiles], "lengths": lengths})
    return {"losses_equal": bool(torch.equal(base_l, l)), "grads_equal": bool(torch.equal(base_g, g)),
            "records": records, "want": want}


def test_timing_hooks_record_every_microbatch_and_change_nothing(tmp_path):
    results = launch(hooks_worker, 2, (str(tmp_path),), timeout=120)
    for rank, res in enumerate(results):
        assert res["losses_equal"] and res["grads_equal"], f"rank {rank}: the hooks changed the maths"
        recs = res["records"]
        assert [{k: r[k] for k in ("iteration", "microbatch", "rank", "images", "lengths")}
                for r in recs] == res["want"], f"rank {rank}: records do not match the micro-batches"
        for r in recs:
            timed = [r[k] for k in ("vision_forward_ms", "vision_backward_ms", "lm_forward_ms",
                                    "lm_backward_ms")]
            assert all(t >= 0 for t in timed) and r["lm_forward_ms"] > 0 and r["lm_backward_ms"] > 0
            if r["images"]:
                assert r["vision_forward_ms"] > 0 and r["vision_backward_ms"] > 0, r
            else:
                assert r["vision_forward_ms"] == r["vision_backward_ms"] == 0.0, r
            assert r["end_s"] > r["start_s"]
    assert (tmp_path / "timing-rank00000.jsonl").is_file() and (tmp_path / "timing-rank00001.jsonl").is_file()


# -- --mm-balance-cost auto on 3 gloo ranks ----------------------------------------------

K = 3                      # calibration iterations: the fit takes effect at iteration K + 2


class StubRecorder:
    """This rank's timing records (all ranks' with ``rank=None``), generated from a known model
    with rank-specific noise: vision time quadratic in each image's tokens (attention inside
    large images), which image tokens cannot see and the replay's fitted model can."""

    def __init__(self, rank=None):
        import sys
        sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "core"))
        from megatron_mm_balance.cost.model import CostModel
        from test_calibration import synthetic_records
        model = CostModel(vision_ms_per_token=0.05, vision_ms_per_token_sq=5e-3, vision_backward_ratio=1.8,
                          llm_ms_per_token=0.02, const_ms=10.0, llm_backward_ratio=1.2)
        self.recs = [r for r in synthetic_records(model, iterations=range(1, 8), ranks=3, G=G, noise=0.02,
                                                  seed=0)
                     if rank is None or r["rank"] == rank]
        self.waited = []

    def wait_until_done(self, iteration, timeout):
        self.waited.append(iteration)
        return True

    def records(self, first, last):
        return [r for r in self.recs if first <= r["iteration"] <= last]


def pack_source(rank):
    import torch
    n = 0
    while True:
        g = torch.Generator().manual_seed(97 * rank + n)
        tiles = torch.randint(0, 13, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
        yield {"num_tiles": tiles.to(torch.int32), "cu_lengths": torch.tensor([[0, 300, 900]]),
               "id": torch.tensor([1000 * rank + n])}
        n += 1


PROBES = [{"num_tiles": [t], "cu_lengths": [[0, 100 * t + 50, 1000]]} for t in range(0, 13, 3)]


def auto_worker(rank, world, save_dir, overlap):
    import torch.distributed as dist
    from megatron_mm_balance.megatron.config import MegatronArgs, MMBalanceConfig
    from megatron_mm_balance.megatron.timing import auto_cost_fn
    from megatron_mm_balance.runtime import BalancedDataIterator

    group = dist.new_group(list(range(world)), backend="gloo")
    cfg = MMBalanceConfig(enabled=True, sync="microstep", cost="auto", calibration_iters=K, timeout=60.0,
                          megatron=MegatronArgs(tokens_per_tile=16, start_iteration=0, save=save_dir,
                                                load=save_dir))
    rec = StubRecorder(rank)
    cost = auto_cost_fn(cfg, rec, group)
    it = BalancedDataIterator(pack_source(rank), num_microbatches=G, group=group, exchange_group=group,
                              cost_fn=cost, overlap=overlap, sync="microstep", timeout=60.0)
    got = [[int(next(it)["id"]) for _ in range(G)] for _ in range(7)]
    stats = list(it.stats)
    it.close()
    return {"fit": cost.fit.to_json(), "probes": [list(cost.for_batch(6)(p)) for p in PROBES],
            "got": got, "waited": rec.waited, "moved": [s.packs_moved for s in stats],
            "cpu": [s.exchange_cpu_ms for s in stats]}


def test_all_ranks_agree_on_the_fitted_costs(tmp_path):
    """Through the balanced iterator with its exchange thread (the calibration runs there)."""
    from megatron_mm_balance.cost.calibration import FIT_FILE, read_fit
    results = launch(auto_worker, 3, (str(tmp_path), True), timeout=180)
    fits = [json.dumps(r["fit"], sort_keys=True) for r in results]
    assert len(set(fits)) == 1, "ranks decided different fits"
    fit = results[0]["fit"]
    assert fit["ok"] and fit["effective_iteration"] == K + 2 and fit["records"] == 3 * G * (K - 1)
    assert fit["first_iteration"] == 2 and fit["last_iteration"] == K
    # chosen by replay: fitted on iteration 2, judged on held-out iteration K
    assert fit["choice"] not in ("image-tokens", None) and fit["model"] is not None
    assert fit["replay"]["fit_iterations"] == [2] and fit["replay"]["held_iterations"] == [K]
    rows = {r["name"]: r for r in fit["replay"]["rows"]}
    assert rows[fit["choice"]]["microstep_max_mean"] <= rows["image-tokens"]["microstep_max_mean"] - 0.005
    assert len({json.dumps(r["probes"]) for r in results}) == 1, "ranks compute different costs"
    assert all(r["waited"] == [K] for r in results)
    # every pack delivered exactly once per global batch, whatever the costs
    for gb in range(7):
        ids = sorted(i for r in results for i in r["got"][gb])
        assert ids == sorted(1000 * rank + gb * G + k for rank in range(3) for k in range(G))
    assert sum(results[0]["moved"]) > 0
    assert all(c is not None and c >= 0 for r in results for c in r["cpu"])
    saved = read_fit(str(tmp_path / FIT_FILE))
    assert json.dumps(saved.to_json(), sort_keys=True) == fits[0]


def test_the_fit_survives_a_checkpoint(tmp_path):
    """A job that loaded a checkpoint restores the fit beside it and balances with the same
    integer costs, from the same iteration; a fresh job (iteration 0) calibrates anew."""
    from megatron_mm_balance.megatron.config import MegatronArgs, MMBalanceConfig
    from megatron_mm_balance.megatron.timing import auto_cost_fn

    def config(iteration, load):
        return MMBalanceConfig(enabled=True, sync="microstep", cost="auto", calibration_iters=K,
                               megatron=MegatronArgs(tokens_per_tile=16, start_iteration=iteration,
                                                     save=str(tmp_path), load=load))
    first = auto_cost_fn(config(0, None), StubRecorder(), None)
    costs = [[first.for_batch(gb)(p) for p in PROBES] for gb in range(8)]
    assert costs[K] != costs[K + 1]                   # the switch (iteration K + 2)
    assert first.fit.ok
    resumed = auto_cost_fn(config(2, str(tmp_path)), StubRecorder(), None)
    assert resumed.fit == first.fit and resumed.fit.choice == first.fit.choice != "image-tokens"
    assert [[resumed.for_batch(gb)(p) for p in PROBES] for gb in range(6)] == costs[2:8]
    fresh = auto_cost_fn(config(0, str(tmp_path)), StubRecorder(1), None)
    assert fresh.fit is None                          # nothing restored without a loaded checkpoint
