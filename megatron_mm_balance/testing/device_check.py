"""The balanced iterator on a real device, ranks sharing it over gloo (``scripts/gpu_check.py``).

Each rank draws deterministic packs of ragged sizes (bf16 pixels, int64 tokens; image-token
costs that differ between ranks, so packs move), delivers them with ``device="cuda"``
through the exchange's side stream, and on the compute stream, with no synchronize, adds
a position-weighted checksum of every delivered tensor into a device tensor and runs a
matmul stand-in for the model. At the end (one synchronize) every checksum is compared
with the one computed on the host from the pack's owner's draw: a delivery read before
its copy landed, or memory reused under it, gives a different sum. Along the way:

* ``torch.cuda.set_sync_debug_mode("warn")`` over the balanced iterations after warm-up;
  each warning is attributed by its stack (``ours``: this package; the rest: this
  harness, torch), and ours must be none;
* every ``sample_every`` global batches the pinned pool's figures (``it.pinned_pool()``)
  and the CUDA host allocator's (``torch.cuda.host_memory_stats()``): flat after warm-up;
* ``TORCH_CUDA_SANITIZER=1`` (``sanitizer=True``): PyTorch's stream sanitizer checks every
  kernel's accesses against the streams' ordering and fails the rank on a race.

Without a GPU the same ranks run with the fake CUDA of
:mod:`megatron_mm_balance.testing.fake_cuda` (device memory in host memory): the
checksums, the pool's figures and, in place of the sync debug mode, the count of device
reads of ours (:class:`~megatron_mm_balance.testing.fake_cuda.DeviceReads`) are checked
the same way; nothing of the timings or the sanitizer means anything there.

``python -m megatron_mm_balance.testing.device_check --world 2 --device cuda`` runs it alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

#: every checksum weight is below this prime: sums of a 64 MiB pack stay exact in int64
_WEIGHT_MOD = 65521


def draw(rank: int, i: int, max_rows: int):
    """Pack ``i`` of ``rank``'s source: ragged bf16 pixels (between half and all of
    ``max_rows`` rows of 2 KiB, so every pack needs the pool's same power-of-two buffer and
    its size shows after warm-up), tokens, a cost (every third pack of the even ranks is
    heavy, so packs move), an id."""
    import torch
    g = torch.Generator().manual_seed(7919 * rank + i)
    rows = int(torch.randint(max_rows // 2 + 1, max_rows - 3, (1,), generator=g))
    heavy = rank % 2 == 0 and i % 3 == 0
    return {"pixels": torch.randn(rows, 1024, generator=g).to(torch.bfloat16),
            "tokens": torch.randint(0, 32000, (int(torch.randint(64, 512, (1,), generator=g)),), generator=g),
            "image_tokens": rows * (8 if heavy else 1), "id": (rank, i)}


def checksum(pack, weights):
    """Position-weighted sum of every tensor's bytes (int64, on the tensors' device)."""
    import torch
    total = None
    for key in ("pixels", "tokens"):
        raw = pack[key].reshape(-1).view(torch.uint8).to(torch.int64)
        part = (raw * weights[: raw.numel()]).sum()
        total = part if total is None else total + part
    return total


def _weights(n: int, device):
    import torch
    return torch.arange(1, n + 1, device=device, dtype=torch.int64) % _WEIGHT_MOD + 1


class _SyncWarnings:
    """The sync debug mode's warnings, each attributed by its stack (any thread)."""

    def __init__(self):
        self.ours, self.other = [], 0
        self._show = warnings.showwarning

    def __enter__(self):
        from .fake_cuda import owner_of

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return self._show(message, category, filename, lineno, file, line)
            owner, where = owner_of(traceback.extract_stack()[:-1])
            if owner == "ours":
                self.ours.append(f"{where}: {message}")
            else:
                self.other += 1
        warnings.simplefilter("always")
        warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        warnings.showwarning = self._show
        return False


def rank_main(rank: int, world: int, port: int, out: str, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from ..runtime import BalancedDataIterator
    from .fake_cuda import DeviceReads, FakeCuda

    fake = cfg["device"] == "fake"
    cuda = cfg["device"] == "cuda"
    if fake:
        from ..runtime.device import set_cuda_api
        set_cuda_api(FakeCuda(device_count=world))
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())      # ranks share the GPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    G, batches, warmup = cfg["G"], cfg["batches"], cfg["warmup"]
    max_rows = max(16, int(cfg["mbytes"] * 2**20 / 2048))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    weights = _weights(max_rows * 2048, dev)
    sums = torch.zeros(batches * G, dtype=torch.int64, device=dev)
    a = torch.randn(cfg["compute_n"], cfg["compute_n"], device=dev,
                    dtype=torch.bfloat16 if cuda else torch.float32)

    def source():
        i = 0
        while True:
            yield draw(rank, i, max_rows)
            i += 1

    ids, pool, host, waits = [], [], [], []
    sync = _SyncWarnings()
    reads = DeviceReads()
    it = BalancedDataIterator(source(), num_microbatches=G, device="cuda" if (cuda or fake) else None,
                              timeout=cfg["timeout"])
    n = 0
    try:
        for b in range(batches):
            if b == warmup:                   # the balanced iterations watched for host syncs
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                    sync.__enter__()
                elif fake:
                    reads.__enter__()
            for _ in range(G):
                t0 = time.perf_counter()
                pack = next(it)
                waits.append(time.perf_counter() - t0)
                ids.append(list(pack["id"]))
                w = weights.to(pack["pixels"].device) if fake else weights
                sums[n] = checksum(pack, w)   # on the compute stream, nothing read back
                y = a
                for _ in range(cfg["matmuls"]):
                    y = y @ a
                n += 1
            if b % cfg["sample_every"] == 0 or b == batches - 1:
                st = it.pinned_pool()
                pool.append({"batch": b, **(st.__dict__ if st is not None else {})})
                if cuda and hasattr(torch.cuda, "host_memory_stats"):
                    hs = torch.cuda.host_memory_stats()
                    host.append({"batch": b, **{k: v for k, v in hs.items()
                                                if k.endswith(".current") or k.startswith("num_host")}})
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
            sync.__exit__()
        reads.__exit__()
        moved = sum(s.packs_moved for s in it.stats)
        it.close()
    if cuda:
        torch.cuda.synchronize()
    got = sums.cpu().tolist()
    cpu_w = _weights(weights.numel(), "cpu")
    want = [int(checksum(draw(r, i, max_rows), cpu_w)) for r, i in ids]
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "checked": len(got), "mismatches": sum(g != w for g, w in zip(got, want)),
            "moved": moved, "sync_ours": sync.ours[:20] + [f"{r.where}: {r.what}" for r in reads.ours()][:20],
            "sync_other": sync.other, "pool": pool, "host": host,
            "wait_ms_mean": 1e3 * sum(waits) / max(1, len(waits))}


def flat(samples: list, keys, after: int) -> dict:
    """``{key: (first, last)}`` of the samples after batch ``after`` whose value changed."""
    later = [s for s in samples if s["batch"] >= after]
    if len(later) < 2:
        return {}
    return {k: (later[0].get(k), later[-1].get(k)) for k in keys
            if later[0].get(k) != later[-1].get(k)}


POOL_KEYS = ("bytes", "buffers", "overflows")


def judge(results: list, *, warmup: int) -> dict:
    """Pass/fail of the ranks' results and the line that says why."""
    problems = []
    for r in results:
        if "error" in r:
            problems.append(f"rank {r.get('rank')}: {r['error']}")
            continue
        if r["mismatches"]:
            problems.append(f"rank {r['rank']}: {r['mismatches']} of {r['checked']} checksums differ")
        if r["sync_ours"]:
            problems.append(f"rank {r['rank']}: host syncs of ours: {r['sync_ours'][:3]}")
        grew = flat(r["pool"], POOL_KEYS, warmup)
        if grew:
            problems.append(f"rank {r['rank']}: pinned pool not flat after warm-up: {grew}")
        host_keys = [k for k in (r["host"][0] if r["host"] else {}) if k != "batch"]
        hgrew = flat(r["host"], [k for k in host_keys if "reserved" in k or "segment" in k
                                 or k == "num_host_alloc"], warmup)
        if hgrew:
            problems.append(f"rank {r['rank']}: host allocator not flat after warm-up: {hgrew}")
    ok = not problems
    good = [r for r in results if "error" not in r]
    line = (f"{sum(r['checked'] for r in good)} checksums equal, {sum(r['moved'] for r in good) // max(1, len(good))} "
            f"packs moved, syncs of ours 0 (others {sum(r['sync_other'] for r in good)}), pool "
            f"{good[0]['pool'][-1].get('bytes', 0) // 2**20 if good and good[0]['pool'] else 0} MiB flat"
            if ok else "; ".join(problems)[:600])
    return {"ok": ok, "line": line, "problems": problems}


def run_ranks(*, world: int = 2, device: str = "cuda", batches: int = 300, warmup: int = 50, G: int = 4,
              mbytes: float = 2.0, compute_n: int = 2048, matmuls: int = 2, sample_every: int = 50,
              sanitizer: bool = False, timeout: float = 300.0) -> dict:
    """Start ``world`` ranks (sharing the GPU with ``device="cuda"``; ``"fake"``: the CPU
    stand-in), collect and judge their results. Never waits past ``timeout``."""
    from ..bench.runtime import free_port
    cfg = dict(device=device, batches=batches, warmup=warmup, G=G, mbytes=mbytes, compute_n=compute_n,
               matmuls=matmuls, sample_every=sample_every, timeout=min(60.0, timeout))
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, "-m", "megatron_mm_balance.testing.device_check", "--rank",
                                   str(r), "--world", str(world), "--port", str(port), "--out", tmp,
                                   "--cfg", json.dumps(cfg)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for r in range(world)]
        deadline = time.monotonic() + timeout
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs.append((p.communicate()[0] or "") + f"\n(killed after {timeout:.0f} s)")
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                results.append({"rank": r, "error": (logs[r] if r < len(logs) else "")[-1500:]})
    return {"config": cfg, "sanitizer": sanitizer, "ranks": results, **judge(results, warmup=warmup)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--device", default="cuda", choices=("cuda", "fake", "cpu"))
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--sanitizer", action="store_true")
    a = ap.parse_args(argv)
    if a.rank is None:                       # the launcher
        rep = run_ranks(world=a.world, device=a.device, batches=a.batches, sanitizer=a.sanitizer)
        print(("PASS " if rep["ok"] else "FAIL ") + rep["line"])
        return 0 if rep["ok"] else 1
    try:
        res = rank_main(a.rank, a.world, a.port, a.out, json.loads(a.cfg))
    except BaseException as e:               # reported to the launcher, not hidden
        res = {"rank": a.rank, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1200:]}"}
    with open(os.path.join(a.out, f"rank{a.rank}.json.tmp"), "w") as f:
        json.dump(res, f)
    os.replace(os.path.join(a.out, f"rank{a.rank}.json.tmp"), os.path.join(a.out, f"rank{a.rank}.json"))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
