"""No host sync of ours in the pack path or the timing hooks, counted on a CPU.

Two gloo ranks run Megatron's glue (``wrap_train_data_iterator``: the balanced iterator, its
exchange thread, the telemetry, the per-pack timing hooks) with a fake CUDA
(:mod:`megatron_mm_balance.testing.fake_cuda`): packs are delivered on the fake device, and
every read of device memory by the host (``.cpu()``, ``.item()``, ``.tolist()``, Python
conversions, blocking copies, data-dependent sizes) is attributed by its stack to our
package or to the rest (the loop below stands in for examples/multimodal's ``get_batch``,
which reads sizes with ``.cpu()`` as Megatron-LM's ``broadcast_data`` does, and for the
model). Ours must be 0; theirs are counted, to show the counter sees them. Our pre-fix
hook features (``llava_features`` on device tensors) are counted as ours.
"""
import argparse

import pytest

pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 not installed")

from megatron_mm_balance.testing.cpu_megatron import launch  # noqa: E402

#: multi-process runs of Megatron's glue
pytestmark = pytest.mark.realpath

G, ITERS, PER_TILE = 4, 4, 4


def loader(rank):
    """examples/multimodal micro-batches on the host: rank 0's image-heavy, so packs move."""
    import torch
    n = 0
    while True:
        g = torch.Generator().manual_seed(100 * rank + n)
        tiles = [] if n % 5 == 4 else [int(t) for t in torch.randint(1, 4 if rank else 7, (2,), generator=g)]
        text = 6 + n % 3
        total = sum(tiles) * PER_TILE + text
        yield {"imgs": torch.randn(sum(tiles), PER_TILE, 3, 1, generator=g) if tiles else torch.zeros(1, 1),
               "num_tiles": torch.tensor(tiles, dtype=torch.int32),
               "tokens": torch.randint(0, 50, (1, text), generator=g),
               "labels": torch.randint(0, 50, (1, text), generator=g),
               "cu_lengths": torch.tensor([[0, total // 2, total]], dtype=torch.int32),
               "id": torch.tensor([1000 * rank + n])}
        n += 1


def get_batch(data_iterator):
    """What examples/multimodal's get_batch does with a micro-batch, on the (fake) device:
    ``broadcast_data`` moves each key there and reads its sizes back with ``.cpu()``."""
    from types import SimpleNamespace

    import torch
    from megatron_mm_balance.runtime.device import cuda_api

    api = cuda_api()
    data = next(data_iterator)
    out = {}
    for key in ("tokens", "labels", "imgs", "num_tiles", "cu_lengths"):
        value = data[key]
        if type(value).__name__ != "FakeDeviceTensor":             # .cuda(): a no-op when there
            value = api.to_device(value, None)
        api.to_device(torch.tensor(list(value.shape) + [0]), None).cpu()   # the sizes, read back
        out[key] = value
    imgs = out["imgs"]
    imgs = imgs[:0] if tuple(imgs.shape) == (1, 1) else imgs[..., 0]       # the toy's [tiles, tokens, 3]
    return imgs, out["tokens"], out["labels"], out["num_tiles"], SimpleNamespace(cu_seqlens_q=out["cu_lengths"][0])


def reads_worker(rank, world):
    import torch
    from megatron_mm_balance.megatron.groups import init_exchange_groups
    from megatron_mm_balance.megatron.iterator import balancers, wrap_train_data_iterator
    from megatron_mm_balance.megatron.timing import llava_features, llava_pack_features
    from megatron_mm_balance.runtime.device import set_cuda_api
    from megatron_mm_balance.testing.fake_cuda import DeviceReads, FakeCuda
    from test_glue_multirank import _args
    from test_glue_timing import toy_llava

    import megatron_mm_balance.megatron.timing as timing

    made = []
    init = timing.TimingRecorder.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    timing.TimingRecorder.__init__ = spy
    fake = FakeCuda(device_count=world)
    set_cuda_api(fake)
    fake.set_device(rank)
    model = toy_llava()
    model.module.module.img_seq_len = PER_TILE
    args = _args(mm_balance_timing=True, curr_iteration=0)
    groups = init_exchange_groups({"holds_data": True, "dp_ranks": list(range(world))}, num_chunks=1,
                                  timeout=60)
    it = wrap_train_data_iterator(loader(rank), args, exchange_groups=groups, num_microbatches=G,
                                  model=[model])
    delivered, features = [], []
    with DeviceReads() as reads:
        for step in range(ITERS):
            args.curr_iteration = step
            for _ in range(G):
                imgs, tokens, labels, tiles, psp = get_batch(it)
                delivered.append(type(tokens).__name__)
                out, _ = model(imgs, tokens, None, None, labels, None, num_image_tiles=tiles,
                               packed_seq_params=psp)
                out.float().mean().backward()
                features.append(llava_pack_features(
                    {"imgs": imgs.cpu()[..., None] if imgs.numel() else torch.zeros(1, 1), "num_tiles": tiles.cpu(),
                     "cu_lengths": psp.cu_seqlens_q.cpu()[None], "tokens": tokens.cpu()}, PER_TILE))
    bal = balancers(it)[0]
    moved = sum(s.packs_moved for s in bal.stats)
    with DeviceReads() as control:                     # the hooks' features before: read the call
        llava_features(model.module.module, (imgs,), {"num_image_tiles": tiles, "packed_seq_params": psp})
    bal.close()
    return {"ours": [(r.what, r.where, r.thread) for r in reads.ours()],
            "upstream": len(reads.upstream()), "delivered": sorted(set(delivered)), "moved": moved,
            "control": [(r.what, r.owner, r.where) for r in control.reads],
            "records": timing_records(made), "want": features}


def timing_records(made):
    """The per-pack records of this rank's one timing recorder: ``[images, lengths]`` each."""
    (rec,) = made
    rec.close()
    return [[r["images"], r["lengths"]] for r in rec.records(0, 10**9)]


def test_no_device_reads_of_ours_in_the_pack_path_and_the_timing_hooks():
    results = launch(reads_worker, 2, (), timeout=180)
    for rank, res in enumerate(results):
        assert res["ours"] == [], f"rank {rank}: host syncs of ours: {res['ours']}"
        assert res["upstream"] >= G * ITERS * 5, res["upstream"]       # get_batch's .cpu() per key
        assert res["delivered"] == ["FakeDeviceTensor"]                # packs arrived on the device
        assert res["records"] == [list(f) for f in res["want"]], rank  # features from the host copy
        assert [(w, o) for w, o, _ in res["control"]] == [("tolist()", "ours")] * 2, res["control"]  # the counter sees ours
    assert sum(r["moved"] for r in results) > 0
