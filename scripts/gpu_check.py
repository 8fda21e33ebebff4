"""GPU validation, part by part (``scripts/gpu_check.sh`` runs each part in its own process
under its own timeout; docs/gpu.md). :data:`PARTS` is the list: what each checks, what it
needs, how long it may take; ``--list`` prints it for the GPUs here (``--dry-run`` of the
shell script), ``--part KEY`` runs one and writes ``OUT/parts/KEY.json`` (PASS / FAIL / SKIP
and one line), ``--summary`` prints the one-screen table.

One GPU: 1. cost-model calibration on real kernels (``cost_model.json``); 2. the runtime at
2 ranks sharing the GPU over gloo with CUDA delivery (:mod:`megatron_mm_balance.testing.
device_check`: checksums on the compute stream compared at the end, the sync debug mode,
the pinned pool and host allocator flat); 3. the same under ``TORCH_CUDA_SANITIZER=1``;
4. the overlap at world 1 with 64 MB packs; 5. the timing hooks and the online fit;
6. Megatron-LM's own loop (``MEGATRON_LM_DIR``, transformer-engine). Two or more: 7.
Megatron-LM off vs on (``mm-balance bench-realpath``); 8. Megatron-Bridge's Qwen3-VL toy
through the user's launcher (``--bridge-only``; off vs on against a control band, images
mode over NCCL, one process per GPU); 9. Bridge's CP=2 frame split (``--bridge-cp-split``).

Without a GPU (``--cpu``) parts 1, 2, 4 and 5 run small CPU configurations, part 2 with the
fake CUDA of :mod:`megatron_mm_balance.testing.fake_cuda`; the test suite runs exactly that,
so every part that can run on a CPU is exercised in CI. Installs nothing.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass


def environment() -> dict:
    import torch

    env = {
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "megatron_core": importlib.util.find_spec("megatron.core") is not None
        if importlib.util.find_spec("megatron") is not None else False,
    }
    return env


def init_single_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from megatron_mm_balance.bench.runtime import free_port
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)


def try_mcore_clip(log) -> str | None:
    """Build megatron-core's CLIPViTModel once, to report whether that path is usable
    here; the timings use the encoder body of the same shape either way."""
    try:
        import torch
        from megatron.core import parallel_state
        from megatron.core.models.vision.clip_vit_model import CLIPViTModel
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        init_single_process_group()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        if importlib.util.find_spec("transformer_engine") is not None:
            from megatron.core.models.vision.vit_layer_specs import (
                get_vit_layer_with_transformer_engine_spec as spec_fn)
        else:
            from megatron.core.models.vision.vit_layer_specs import (
                get_vit_layer_with_local_spec as spec_fn)
        cfg = TransformerConfig(num_layers=24, hidden_size=1024, num_attention_heads=16,
                                ffn_hidden_size=4096, bf16=True, params_dtype=torch.bfloat16,
                                add_bias_linear=True, gated_linear_unit=False)
        model = CLIPViTModel(cfg, spec_fn(), img_h=448, img_w=448, patch_dim=14).cuda()
        x = torch.randn(2, 3, 448, 448, device="cuda", dtype=torch.bfloat16)
        y = model(x)
        torch.cuda.synchronize()
        return f"megatron-core CLIPViTModel built and ran ({tuple(y.shape)})"
    except Exception as exc:  # report, never fail the whole check on this
        log(f"  megatron-core CLIPViTModel not usable here ({type(exc).__name__}: {exc}); "
            "timings use the plain PyTorch encoder of the same shape")
        return None


class PackSource:
    """World-size-1 source: MB-sized packs (pixels + token ids + metadata) on the host."""

    def __init__(self, n: int, mbytes: float, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        elems = max(1024, int(mbytes * 2**20 / 2) // 1024 * 1024)   # bf16, rows of 1024
        self.packs = []
        for i in range(n):
            self.packs.append({
                "imgs": torch.randn(elems, generator=g).to(torch.bfloat16).view(-1, 1024),
                "tokens": torch.randint(0, 32000, (8192,), generator=g),
                "image_tokens": int(torch.randint(0, 8192, (1,), generator=g)),
                "key": f"pack-{i}",
            })
        self.digests = [digest(p) for p in self.packs]

    def __iter__(self):
        return iter(self.packs)


def digest(pack) -> str:
    import torch

    h = hashlib.sha256()
    for k in sorted(pack):
        v = pack[k]
        if hasattr(v, "detach"):
            t = v.detach().cpu().contiguous()
            h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def _weights(n: int, device):
    import torch
    return torch.arange(1, n + 1, device=device, dtype=torch.int64) % 65521 + 1


def checksum(pack, weights):
    """Position-weighted int64 sum of ``imgs``' and ``tokens``' bytes, on their device."""
    import torch
    total = None
    for key in ("imgs", "tokens"):
        raw = pack[key].reshape(-1).view(torch.uint8).to(torch.int64)
        part = (raw * weights[: raw.numel()]).sum()
        total = part if total is None else total + part
    return total


def overlap_check(*, device, steps: int, ga: int, mbytes: float, compute_n: int, log) -> dict:
    import torch

    from megatron_mm_balance import BalancedDataIterator

    init_single_process_group()
    cuda = device.startswith("cuda")
    a = torch.randn(compute_n, compute_n, device=device,
                    dtype=torch.bfloat16 if cuda else torch.float32)
    results = {}
    for overlap in (False, True):
        src = PackSource(steps * ga, mbytes)
        it = BalancedDataIterator(iter(src), num_microbatches=ga, overlap=overlap,
                                  device=device, timeout=120.0)
        waits = []
        sums = torch.zeros(steps * ga, dtype=torch.int64, device=device)
        weights = _weights(max(p["imgs"].numel() * 2 for p in src.packs) + 8 * 8192, device)
        t_start = time.perf_counter()
        with it:
            for n in range(steps * ga):
                t0 = time.perf_counter()
                batch = next(it)
                waits.append((time.perf_counter() - t0) * 1e3)
                y = a
                for _ in range(4):            # the stand-in for a micro-step's compute
                    y = y @ a
                    y = y / y.abs().max()
                # read the delivered tensors on the compute stream, like a model would; no
                # synchronize: a copy not awaited would show in the sums compared at the end
                sums[n] = checksum(batch, weights)
                del y
        if cuda:
            torch.cuda.synchronize()
        total = time.perf_counter() - t_start
        cpu_w = _weights(weights.numel(), "cpu")
        identical = sums.cpu().tolist() == [int(checksum(p, cpu_w)) for p in src.packs]
        key = "overlap" if overlap else "sync"
        results[key] = {
            "wait_ms_mean": sum(waits) / len(waits),
            "wait_ms_p50": sorted(waits)[len(waits) // 2],
            "wait_ms_total": sum(waits),
            "total_s": total,
            "bit_identical": identical,
            "on_device": bool(batch["imgs"].device.type == torch.device(device).type),
        }
        del batch
        log(f"  overlap={overlap!s:5}: consumer wait {results[key]['wait_ms_mean']:.3f} ms/step, "
            f"total {total:.2f} s, bit-identical {identical}")
    sync_w = results["sync"]["wait_ms_total"]
    results["exposed_wait_ratio"] = results["overlap"]["wait_ms_total"] / sync_w if sync_w else 0.0
    return results


def llava_shaped(shape, *, lm_hidden: int, lm_layers: int, vocab: int, device, dtype):
    """A model with LLaVAModel's attributes and call (``vision_model``, ``vision_projection``,
    ``language_model`` with ``embedding``), so the timing hooks find what they find there."""
    import torch
    from torch import nn

    from megatron_mm_balance.cost.calibration import build_torch_encoder

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, lm_hidden)
            self.body = nn.Sequential(*[nn.Sequential(nn.LayerNorm(lm_hidden), nn.Linear(lm_hidden, 4 * lm_hidden),
                                                      nn.GELU(), nn.Linear(4 * lm_hidden, lm_hidden))
                                        for _ in range(lm_layers)])
            self.head = nn.Linear(lm_hidden, vocab)

        def forward(self, decoder_input=None, labels=None, **_):
            logits = self.head(self.body(decoder_input)).float()
            return nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_model = build_torch_encoder(shape, device, dtype)
            self.vision_projection = nn.Linear(shape.hidden, lm_hidden)
            self.language_model = LM()
            self.img_seq_len = 0          # set per call below: tokens per tile

        def forward(self, images, input_ids, position_ids, attention_mask, labels, loss_mask,
                    num_image_tiles=None, packed_seq_params=None):
            text = self.language_model.embedding(input_ids)
            if images is not None and images.shape[0] > 0:
                img = self.vision_projection(self.vision_model(images)).reshape(1, -1, text.shape[-1])
                combined = torch.cat([img, text], dim=1)
                labels = torch.cat([torch.zeros(1, img.shape[1], dtype=labels.dtype, device=labels.device),
                                    labels], dim=1)
            else:
                combined = text
            return self.language_model(decoder_input=combined, labels=labels), loss_mask

    return Model().to(device=device, dtype=dtype)


def timing_check(*, device, out: str, shape, tile_tokens: int, seq_len: int, lm_hidden: int,
                 lm_layers: int, iterations: int, microbatches: int, log) -> dict:
    """The timing hooks on the LLaVA-shaped model, then the online two-phase fit."""
    import random
    from types import SimpleNamespace

    import torch

    from megatron_mm_balance.cost.calibration import fit_phases
    from megatron_mm_balance.megatron.timing import TimingRecorder, _CpuClock, _CudaClock, install_hooks

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = llava_shaped(shape, lm_hidden=lm_hidden, lm_layers=lm_layers, vocab=1024, device=device, dtype=dtype)
    model.img_seq_len = tile_tokens
    rec = TimingRecorder(rank=0, clock=_CudaClock() if cuda else _CpuClock(), out_dir=out)
    install_hooks([model], rec)
    rng = random.Random(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for it in range(1, iterations + 1):
        rec.set_iteration(it)
        opt.zero_grad()
        for m in range(microbatches):
            tiles = [rng.randint(1, 12) for _ in range(rng.choice((0, 1, 2, 4, 8)))]
            while tiles and sum(tiles) * tile_tokens > seq_len - 16:     # a pack holds seq_len
                tiles.pop()
            n_img = sum(tiles) * tile_tokens
            n_text = max(16, seq_len - n_img)
            images = torch.randn(sum(tiles), tile_tokens, shape.hidden, device=device, dtype=dtype)
            ids = torch.randint(0, 1024, (1, n_text), device=device)
            cu = torch.tensor([0, (n_img + n_text) // 2, n_img + n_text], dtype=torch.int32)
            loss, _ = model(images, ids, None, None, ids, None,
                            num_image_tiles=torch.tensor(tiles, dtype=torch.int32),
                            packed_seq_params=SimpleNamespace(cu_seqlens_q=cu))
            loss.mean().backward()
        opt.step()
    rec.set_iteration(iterations + 1)
    if cuda:
        torch.cuda.synchronize()
    rec.close()
    with open(rec.path) as f:
        records = [json.loads(line) for line in f]
    fit = fit_phases([r for r in records if r["iteration"] > 1], first_iteration=2,
                     last_iteration=iterations, effective_iteration=iterations + 2)
    with open(os.path.join(out, "online_fit.json"), "w") as f:
        json.dump(fit.to_json(), f, indent=1)
    log(f"  {len(records)} micro-batches timed ({iterations} x {microbatches}); " + fit.line())
    return {"records": len(records), "expected": iterations * microbatches, "fit": fit.to_json(),
            "with_vision": sum(1 for r in records if r["vision_forward_ms"] > 0)}


# --- part 5: Megatron-Bridge's Qwen3-VL toy through the user's launcher -----------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BRIDGE_LAUNCHER = os.path.join(REPO, "scripts", "pretrain_bridge_vlm.sh")
BRIDGE_CONFIG = os.path.join(REPO, "configs", "bridge", "qwen3_vl_moe_tiny_cpu.sh")


#: what the node runs of Bridge the way its recipes train: gradient reduce and parameter
#: gather overlapped with compute, the loader's pinned memory
BRIDGE_GPU_OVERRIDES = ("ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true",
                        "dataset.pin_memory=true")


def bridge_plan(ranks: int, *, out: str, iters: int = 6, cuda: bool = False) -> list:
    """Part 8's launcher runs for ``ranks`` ranks. On GPUs (``cuda``): one GPU, the balanced
    job alone (its per-iteration times; with DP=1 nothing moves, so what shows is the hook's
    own cost); two or three, DP=2 packs and images mode (``mm_balance.vision=images``, NCCL);
    four or more, TP=2, PP=2 and CP=2 x DP=2, and images mode at DP=4; every multi-GPU layout
    off, control (the arithmetic-order band) and on, with Bridge's overlapped gradient
    reduce, parameter gather and pinned loader memory. Through the CPU harness (no CUDA):
    off then on at DP=2 (two or three ranks) or DP=2 x EP=2 (four or more). Each run: a
    name, its layout (the runs of one layout share it), its launcher environment, its
    command."""
    if ranks < 1:
        return []
    if ranks == 1:
        layouts = [("1gpu", {"NPROC_PER_NODE": "1", "EP": "1"}, ())]
    elif not cuda:
        layouts = [("dp2", {"NPROC_PER_NODE": "2", "EP": "1"}, ())] if ranks < 4 else \
            [("dp2-ep2", {"NPROC_PER_NODE": "4", "EP": "2"}, ())]
    elif ranks < 4:
        layouts = [("dp2", {"NPROC_PER_NODE": "2", "EP": "1"}, BRIDGE_GPU_OVERRIDES),
                   ("images-dp2", {"NPROC_PER_NODE": "2", "EP": "1"},
                    BRIDGE_GPU_OVERRIDES + ("mm_balance.vision=images",))]
    else:
        four = {"NPROC_PER_NODE": "4", "EP": "1"}
        layouts = [("tp2", {**four, "TP": "2"}, BRIDGE_GPU_OVERRIDES),
                   ("pp2", {**four, "PP": "2"}, BRIDGE_GPU_OVERRIDES),
                   ("cp2-dp2", {**four, "CP": "2"}, BRIDGE_GPU_OVERRIDES),
                   ("images-dp4", four, BRIDGE_GPU_OVERRIDES + ("mm_balance.vision=images",))]
    runs = []
    for layout, env, overrides in layouts:
        modes = ("on",) if ranks == 1 else ("off", "control", "on") if cuda else ("off", "on")
        for mode in modes:
            name = f"{layout}-{mode}"
            extra = ("mm_balance.mode=control",) if mode == "control" else ()
            runs.append({"name": name, "layout": layout,
                         "env": {**env, "MM_BALANCE": "0" if mode == "off" else "1",
                                 "TRAIN_ITERS": str(iters), "LOG_INTERVAL": "1",
                                 "OUTPUT_DIR": os.path.join(out, "bridge", name)},
                         "argv": ["bash", BRIDGE_LAUNCHER, "--config", BRIDGE_CONFIG, *overrides, *extra]})
    return runs


def parse_bridge_log(text: str) -> dict:
    """Per-iteration elapsed ms and lm loss (Bridge prints each iteration's own loss), and
    the packs our telemetry line says were moved."""
    from megatron_mm_balance.bench.realpath import ITER_RE
    from megatron_mm_balance.runtime.log_line import read_lines

    elapsed, losses = {}, {}
    for m in ITER_RE.finditer(text):
        elapsed[int(m.group(1))] = float(m.group(2))
        losses[int(m.group(1))] = float(m.group(3))
    moved = {it: int(fields["packs_moved"]) for it, chunk, fields in read_lines(text)
             if chunk == 0 and "packs_moved" in fields}
    return {"elapsed_ms": elapsed, "losses": losses, "packs_moved": moved}


def median_after_warmup(elapsed: dict, warmup: int = 2):
    its = sorted(elapsed)[warmup:] or sorted(elapsed)
    vals = sorted(elapsed[i] for i in its)
    return vals[len(vals) // 2] if vals else None


def bridge_prerequisites(python: str, env: dict, cuda: bool) -> str | None:
    """Why part 5 cannot run here (None when it can): the launcher's own checks in DRY_RUN
    (a patched Megatron-Bridge 0.6.x, its megatron-core, Python 3.12), and on a GPU
    transformer-engine in that python (Bridge's GPU model specs use it)."""
    import subprocess

    r = subprocess.run(["bash", BRIDGE_LAUNCHER, "--config", BRIDGE_CONFIG], env=dict(env, DRY_RUN="1"),
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or ["the launcher's dry run failed"])[-1]
    if not any(line.startswith("Megatron-Bridge ") for line in r.stderr.splitlines()):
        return ("no Megatron-Bridge: set MEGATRON_BRIDGE_DIR to a patched 0.6.x checkout, or install it "
                "(pip install megatron-bridge) for PYTHON and run scripts/apply_patches.sh --installed")
    if cuda:
        te = subprocess.run([python, "-c", "import importlib.util as u, sys; "
                             "sys.exit(u.find_spec('transformer_engine') is None)"], env=env, timeout=120)
        if te.returncode != 0:
            return f"transformer-engine is not importable by {python} (Bridge's GPU model specs need it)"
    return None


def bridge_check(*, out: str, ranks: int, iters: int, timeout: float, log) -> dict:
    """Part 8: the Bridge Qwen3-VL toy through scripts/pretrain_bridge_vlm.sh (bridge_plan),
    each run's per-iteration times, off vs on per layout against the control band
    (:func:`judge_layouts`: lm loss, packs moved, median iteration time) and, on GPUs, one
    process per GPU (:func:`watch_gpu_processes`). Skips, with the reason, what cannot run
    here."""
    import subprocess

    import torch

    python = os.environ.get("PYTHON", "python3")
    cuda = torch.cuda.is_available()
    plan = bridge_plan(ranks, out=out, iters=iters, cuda=cuda)
    if not plan:
        return {"skipped": "no GPU visible (give --bridge-ranks to run the toy through the CPU harness)"}
    env = dict(os.environ, PYTHON=python, PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    why = bridge_prerequisites(python, dict(env, **plan[0]["env"]), cuda)
    if why:
        return {"skipped": why}
    data = os.environ.get("DATA_PATH") or os.path.join(out, "bridge", "data")
    if not os.environ.get("DATA_PATH"):
        mk = subprocess.run([python, "-m", "megatron_mm_balance.cli", "make-dataset", data, "--samples", "128",
                             "--seed", "0", "--format", "bridge-qwen-vl"], env=env, capture_output=True,
                            text=True, timeout=600)
        if mk.returncode != 0:
            return {"skipped": f"make-dataset failed: {(mk.stderr or mk.stdout).strip()[-300:]}"}
    from megatron_mm_balance.bench.runtime import free_port

    runs = {}
    for run in plan:
        os.makedirs(run["env"]["OUTPUT_DIR"], exist_ok=True)
        log_path = os.path.join(out, "bridge", f"{run['name']}.log")
        renv = dict(env, DATA_PATH=data, MASTER_PORT=str(free_port()), **run["env"])
        t0 = time.perf_counter()
        nproc = int(run["env"]["NPROC_PER_NODE"])
        with open(log_path, "w") as f:
            proc = subprocess.Popen(run["argv"], env=renv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
            seen = watch_gpu_processes(proc, timeout) if cuda and nproc > 1 else None
            try:
                rc = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
        with open(log_path, errors="replace") as f:
            res = parse_bridge_log(f.read())
        res.update(rc=rc, wall_s=time.perf_counter() - t0, log=log_path, layout=run.get("layout"),
                   median_ms=median_after_warmup(res["elapsed_ms"]), gpu_processes=seen)
        runs[run["name"]] = res
        med = f"{res['median_ms']:.1f} ms" if res["median_ms"] is not None else "n/a"
        log(f"  {run['name']:<16} exit {rc}, {res['wall_s']:.0f} s wall, {len(res['losses'])} iterations, "
            f"median iteration {med}, packs moved {sum(res['packs_moved'].values())}"
            + (f", our processes per GPU at most {seen['most_per_gpu']} on {seen['gpus']} GPU(s)" if seen else ""))
    report = {"ranks": ranks, "cuda": cuda, "runs": runs, "layouts": judge_layouts(runs)}
    off = next((r for n, r in runs.items() if n.endswith("-off")), None)
    on = next((r for n, r in runs.items() if n.endswith("-on")), None)
    if off and on and off["losses"] and sorted(off["losses"]) == sorted(on["losses"]):
        report["max_rel_loss_diff"] = max(abs(on["losses"][i] - off["losses"][i]) / max(abs(off["losses"][i]), 1e-12)
                                          for i in off["losses"])
        if off["median_ms"] and on["median_ms"]:
            report["median_on_over_off"] = on["median_ms"] / off["median_ms"]
    per_gpu = [r["gpu_processes"] for r in runs.values() if r.get("gpu_processes")]
    report["one_process_per_gpu"] = all(p["most_per_gpu"] <= 1 for p in per_gpu) if per_gpu else None
    report["ok"] = all(r["rc"] == 0 and len(r["losses"]) == iters for r in runs.values()) and \
        all(j["ok"] for j in report["layouts"].values()) and report["one_process_per_gpu"] is not False
    return report


def judge_layouts(runs: dict) -> dict:
    """Off vs on per layout. With a control run (every rank its own packs, reordered as
    balancing orders them: only the arithmetic order changes), the band is the largest
    |control - off| lm loss over the iterations and on passes within 4 bands (or 1e-6 of the
    loss, where the band is 0); without one (the CPU harness, fp32 and deterministic), within
    1e-5 relative."""
    out = {}
    for layout in dict.fromkeys(r.get("layout") for r in runs.values()):
        mine = {n.rsplit("-", 1)[1]: r for n, r in runs.items() if r.get("layout") == layout}
        off, on, control = mine.get("off"), mine.get("on"), mine.get("control")
        if off is None or on is None or not off["losses"] or sorted(off["losses"]) != sorted(on["losses"]):
            out[layout] = {"ok": off is None and on is not None and on["rc"] == 0, "diff": None, "band": None}
            continue
        its = sorted(off["losses"])
        diff = max(abs(on["losses"][i] - off["losses"][i]) for i in its)
        scale = max(abs(off["losses"][i]) for i in its)
        if control is not None and sorted(control["losses"]) == its:
            band = max(abs(control["losses"][i] - off["losses"][i]) for i in its)
            tol = max(4 * band, 1e-6 * scale)
        else:
            band, tol = None, 1e-5 * scale
        out[layout] = {"ok": diff <= tol, "diff": diff, "band": band, "tolerance": tol,
                       "moved": sum(on["packs_moved"].values())}
    return out


def watch_gpu_processes(proc, timeout: float, every: float = 2.0) -> dict:
    """While ``proc`` (a launcher) runs: every ``every`` s, which GPU each of its processes
    (itself and its descendants) has a context on, from ``nvidia-smi``. ``most_per_gpu``: the
    most of them seen on one GPU at once (1 when each rank keeps to its own device; a rank
    whose thread touched GPU 0 shows as a second process there); ``gpus``: GPUs seen in use."""
    import subprocess
    most, gpus, samples = 0, set(), 0
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(every)
        try:
            q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return {"most_per_gpu": 0, "gpus": 0, "samples": 0, "note": "nvidia-smi not available"}
        ours = _descendants(proc.pid)
        per_gpu: dict = {}
        for line in q.stdout.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in ours:
                per_gpu[parts[1]] = per_gpu.get(parts[1], 0) + 1
        if per_gpu:
            samples += 1
            most = max(most, max(per_gpu.values()))
            gpus |= set(per_gpu)
    return {"most_per_gpu": most, "gpus": len(gpus), "samples": samples}


def _descendants(root: int) -> set:
    """``root`` and every process below it (from /proc)."""
    children: dict = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def print_bridge_table(rep: dict) -> None:
    if "skipped" in rep:
        print(f"== 8. Megatron-Bridge Qwen3-VL toy: skipped ({rep['skipped']})")
        return
    print(f"{'Bridge run':<14} {'exit':>5} {'iterations':>10} {'median ms':>10} {'packs moved':>12}")
    for name, r in rep["runs"].items():
        med = f"{r['median_ms']:.1f}" if r["median_ms"] is not None else "n/a"
        print(f"{name:<14} {r['rc']:>5} {len(r['losses']):>10} {med:>10} {sum(r['packs_moved'].values()):>12}")
    if "max_rel_loss_diff" in rep:
        print(f"{'max relative lm-loss difference off/on':<44} {rep['max_rel_loss_diff']:>14.2e}")
    if "median_on_over_off" in rep:
        print(f"{'median iteration time on / off':<44} {rep['median_on_over_off']:>14.3f}")
    for layout, j in rep.get("layouts", {}).items():
        band = "no control run" if j.get("band") is None else f"band {j['band']:.2e}"
        diff = "n/a" if j.get("diff") is None else f"{j['diff']:.2e}"
        print(f"{layout:<14} on - off lm loss {diff} ({band}): {'ok' if j['ok'] else 'OUT OF BAND'}")
    if rep.get("one_process_per_gpu") is not None:
        print(f"{'one process per GPU (nvidia-smi)':<44} {str(rep['one_process_per_gpu']):>14}")


def bridge_main(args) -> int:
    """--bridge-plan: print part 8's runs for the GPUs here (or --bridge-ranks) and exit;
    --bridge-only: run part 8, write OUT/bridge_check.json, print its table."""
    import torch
    cuda = torch.cuda.is_available()
    ranks = args.bridge_ranks
    if ranks is None:
        ranks = torch.cuda.device_count() if cuda else 0
    if args.bridge_plan:
        gpu_plan = cuda or "GPU_COUNT" in os.environ
        print(json.dumps(bridge_plan(ranks, out=args.out, iters=args.bridge_iters, cuda=gpu_plan), indent=1))
        return 0
    print(f"== 8. Megatron-Bridge Qwen3-VL toy through scripts/pretrain_bridge_vlm.sh ({ranks} rank(s))", flush=True)
    rep = bridge_check(out=args.out, ranks=ranks, iters=args.bridge_iters, timeout=args.bridge_timeout,
                       log=lambda m: print(m, flush=True))
    with open(os.path.join(args.out, "bridge_check.json"), "w") as f:
        json.dump(rep, f, indent=1)
    print_bridge_table(rep)
    return 0 if rep.get("ok", "skipped" in rep) else 1


# --------------------------------------------------------------------------- the parts
@dataclass(frozen=True)
class Part:
    """One part of the check: where it runs and what it checks (``--list`` prints these)."""

    number: int
    key: str
    title: str
    checks: str
    min_gpus: int = 1          #: GPUs it needs (0: also on the CPU, in its small configuration)
    timeout: int = 120         #: seconds the shell gives it
    cpu: bool = True           #: has a CPU fallback (``--cpu``, what the tests run)
    on_cpu: str = ""           #: what that fallback checks instead


PARTS = (
    Part(1, "calibration", "cost-model calibration",
         "vision encoder (ViT-L/14 body, bf16) forward/backward vs image tokens with CUDA events; "
         "fitted cost model in cost_model.json", min_gpus=0, timeout=90,
         on_cpu="a 2-layer encoder on the CPU: the code path, not a measurement"),
    Part(2, "runtime", "runtime, 2 ranks sharing the GPU",
         "BalancedDataIterator at 2 ranks over gloo with CUDA delivery, 300 global batches, no per-step "
         "synchronize: checksums of every delivered tensor taken on the compute stream equal the owner's "
         "at the end; set_sync_debug_mode('warn') over the balanced iterations: none of ours; pinned pool "
         "and the CUDA host allocator flat after warm-up", min_gpus=0, timeout=150,
         on_cpu="16 global batches with the fake CUDA (testing/fake_cuda.py): checksums, the pool flat, "
                "device reads of ours counted instead of the sync debug mode"),
    Part(3, "sanitizer", "runtime under the stream sanitizer",
         "part 2's ranks (24 global batches) under TORCH_CUDA_SANITIZER=1: no unsynchronised access "
         "between the side stream's copies and the compute stream", timeout=150, cpu=False),
    Part(4, "overlap", "overlap at world 1, 64 MB packs",
         "consumer wait per micro-step overlap=False vs True around 4 bf16 8192^3 matmuls; delivered bytes "
         "identical (checksums on the compute stream, compared at the end)", min_gpus=0, timeout=60,
         on_cpu="0.5 MB packs on the CPU (device='cpu'): the bytes, not the overlap"),
    Part(5, "timing", "timing hooks and the online fit",
         "--mm-balance-timing's hooks (CUDA events) on a LLaVA-shaped model: every micro-batch recorded; "
         "--mm-balance-cost auto's fit", min_gpus=0, timeout=90,
         on_cpu="a tiny model with the CPU clock"),
    Part(6, "megatron-1gpu", "Megatron-LM's own loop on one GPU",
         "the launcher with --mm-balance on MEGATRON_LM_DIR (a patched tree), 6 iterations, packs "
         "delivered on the GPU; needs transformer-engine (examples/multimodal's specs)", timeout=420,
         cpu=False),
    Part(7, "megatron-offon", "Megatron-LM off vs on, 2 GPUs",
         "mm-balance bench-realpath with configs/megatron/vision_heavy_cpu.sh, NCCL, transformer-engine",
         min_gpus=2, timeout=1500, cpu=False),
    Part(8, "bridge", "Megatron-Bridge Qwen3-VL toy",
         "the user's launcher; 2-3 GPUs: DP=2 packs and images mode (NCCL); 4+: TP=2, PP=2, CP=2 x DP=2 and "
         "images mode; overlap_grad_reduce, overlap_param_gather, pin_memory on; off vs on within 4x the "
         "control run's band; one process per GPU in nvidia-smi", timeout=3600, cpu=False),
    Part(9, "cp-split", "Bridge CP=2 frame split, count vs cost",
         "two launcher runs, mm_balance.cp_split=count vs cost, lm loss within 1e-5; needs "
         "MEGATRON_BRIDGE_DIR and DATA_PATH", min_gpus=2, timeout=1900, cpu=False),
)


def why_not(part: Part, gpus: int, cpu: bool) -> str | None:
    """Why ``part`` does not run here (None: it runs), from the visible GPUs and the settings."""
    if cpu or gpus == 0:
        if not part.cpu:
            return "needs a GPU" + ("" if gpus else " (none visible)")
        return None
    if gpus < part.min_gpus:
        return f"needs {part.min_gpus} GPUs ({gpus} visible)"
    if part.key == "megatron-1gpu" and not os.environ.get("MEGATRON_LM_DIR"):
        return "set MEGATRON_LM_DIR to a Megatron-LM checkout with scripts/apply_patches.sh applied"
    if part.key == "megatron-offon" and not os.environ.get("MEGATRON_LM_DIR"):
        return "set MEGATRON_LM_DIR to a Megatron-LM checkout with scripts/apply_patches.sh applied"
    if part.key == "cp-split" and not (os.environ.get("MEGATRON_BRIDGE_DIR") and os.environ.get("DATA_PATH")):
        return "needs MEGATRON_BRIDGE_DIR (patched) and DATA_PATH; PYTHON: Bridge's Python 3.12"
    return None


def part_command(part: Part, out: str, cpu: bool) -> str:
    return f"timeout {part.timeout} python3 scripts/gpu_check.py --part {part.key} --out {out}" + (" --cpu" if cpu else "")


def list_parts(gpus: int, out: str, cpu: bool) -> None:
    """``--dry-run``: every part, what it checks, and whether it would run here."""
    print(f"gpu_check parts ({gpus} GPU(s){', CPU configuration' if cpu or not gpus else ''}); results in {out}")
    for p in PARTS:
        why = why_not(p, gpus, cpu)
        print(f"== {p.number}. {p.title}: " + (f"skipped ({why})" if why else part_command(p, out, cpu)))
        print(f"   checks: {p.checks}")
        if (cpu or not gpus) and p.on_cpu:
            print(f"   here, in the CPU configuration: {p.on_cpu}")
    if gpus >= 1:
        print("   part 8's launcher runs here:")
        print(json.dumps([{k: r[k] for k in ("name", "env", "argv")}
                          for r in bridge_plan(gpus, out=out, cuda=True)], indent=1))


def run_part(key: str, out: str, cpu: bool, repeats: int | None = None) -> dict:
    """Run one part; ``{"status": PASS | FAIL | SKIP, "line": one line, ...}``, written to
    ``OUT/parts/<key>.json``."""
    import torch
    part = next(p for p in PARTS if p.key == key)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = why_not(part, gpus, cpu)
    on_gpu = gpus > 0 and not cpu
    device = "cuda" if on_gpu else "cpu"
    log = lambda m: print(m, flush=True)  # noqa: E731
    if why:
        res = {"status": "SKIP", "line": why}
    elif key == "calibration":
        res = part_calibration(out, on_gpu, repeats, log)
    elif key == "runtime":
        rep = _device_check().run_ranks(device="cuda" if on_gpu else "fake",
                                        **({} if on_gpu else CPU_RUNTIME), timeout=part.timeout - 10)
        res = {"status": "PASS" if rep["ok"] else "FAIL", "line": rep["line"], "report": rep}
    elif key == "sanitizer":
        rep = _device_check().run_ranks(device="cuda", batches=24, warmup=4, sample_every=4, mbytes=0.5,
                                        sanitizer=True, timeout=part.timeout - 10)
        res = {"status": "PASS" if rep["ok"] else "FAIL", "line": rep["line"], "report": rep}
    elif key == "overlap":
        ov = overlap_check(device=device, steps=8 if on_gpu else 3, ga=4, mbytes=64.0 if on_gpu else 0.5,
                           compute_n=8192 if on_gpu else 256, log=log)
        ok = ov["sync"]["bit_identical"] and ov["overlap"]["bit_identical"]
        res = {"status": "PASS" if ok else "FAIL", "report": ov,
               "line": f"wait {ov['sync']['wait_ms_mean']:.2f} -> {ov['overlap']['wait_ms_mean']:.2f} ms/step "
                       f"(exposed {ov['exposed_wait_ratio']:.2f}), bytes identical {ok}"}
    elif key == "timing":
        from megatron_mm_balance.cost import calibration
        tc = timing_check(device=device, out=out,
                          shape=calibration.EncoderShape() if on_gpu else calibration.EncoderShape.tiny(),
                          tile_tokens=256 if on_gpu else 16, seq_len=8192 if on_gpu else 512,
                          lm_hidden=2048 if on_gpu else 64, lm_layers=8 if on_gpu else 2,
                          iterations=6 if on_gpu else 3, microbatches=8 if on_gpu else 6, log=log)
        fit = tc["fit"]
        res = {"status": "PASS" if tc["records"] == tc["expected"] else "FAIL", "report": tc,
               "line": f"{tc['records']}/{tc['expected']} micro-batches timed; fit R^2 vision "
                       f"{fit['r2_vision']:.3f}, language {fit['r2_language']:.3f}"}
    elif key == "megatron-1gpu":
        res = part_megatron_one_gpu(out, part.timeout - 30, log)
    elif key == "megatron-offon":
        res = _shell_part(["python3", "-m", "megatron_mm_balance.cli", "bench-realpath", "--megatron-lm",
                           os.environ["MEGATRON_LM_DIR"], "--out", os.path.join(out, "bench-realpath"),
                           "--rounds", os.environ.get("ROUNDS", "1"), "--iters", "6", "--json",
                           os.path.join(out, "bench_realpath.json"), "--set", "GPUS_PER_NODE=2"], out, key)
    elif key == "bridge":
        rep = bridge_check(out=out, ranks=gpus, iters=6, timeout=600, log=log)
        with open(os.path.join(out, "bridge_check.json"), "w") as f:
            json.dump(rep, f, indent=1)
        res = {"status": "SKIP" if "skipped" in rep else "PASS" if rep["ok"] else "FAIL", "report": rep,
               "line": rep.get("skipped") or "; ".join(
                   f"{k}: {'ok' if j['ok'] else 'OUT OF BAND'} (diff {j['diff']}, band {j['band']})"
                   for k, j in rep["layouts"].items()) + f"; one process per GPU: {rep['one_process_per_gpu']}"}
    elif key == "cp-split":
        res = _shell_part(["python3", os.path.abspath(__file__), "--bridge-cp-split", "--out", out, "--gpus", "2"],
                          out, key)
    os.makedirs(os.path.join(out, "parts"), exist_ok=True)
    with open(os.path.join(out, "parts", f"{key}.json"), "w") as f:
        json.dump({"number": part.number, "title": part.title, **res}, f, indent=1, default=str)
    print(f"== {part.number}. {part.title}: {res['status']} {res['line']}", flush=True)
    return res


#: part 2 on the CPU (the fake CUDA): small packs, little compute, fewer batches
CPU_RUNTIME = dict(batches=16, warmup=4, sample_every=4, mbytes=0.125, compute_n=32, matmuls=1)


def _device_check():
    from megatron_mm_balance.testing import device_check
    return device_check


def _shell_part(argv, out: str, key: str) -> dict:
    import subprocess
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    with open(os.path.join(out, f"{key}.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    return {"status": "PASS" if r.returncode == 0 else "FAIL", "line": f"exit {r.returncode}: {tail[0][:200]}"}


def part_calibration(out: str, on_gpu: bool, repeats, log) -> dict:
    from megatron_mm_balance.cost import calibration
    env = environment()
    report = {}
    if on_gpu and env["megatron_core"]:
        report["mcore_clip"] = try_mcore_clip(log)
    cal = calibration.calibrate(device="cuda" if on_gpu else "cpu", quick=not on_gpu,
                                max_tokens=8192 if on_gpu else 1024, repeats=repeats or (10 if on_gpu else 5),
                                warmup=3 if on_gpu else 1, log=log)
    model = calibration.save_results(cal, os.path.join(out, "cost_model.json"), os.path.join(out, "calibration.json"))
    biggest = max(cal["records"], key=lambda r: sum(r["images"]))
    tokens = sum(biggest["images"])
    ok = model.vision_ms_per_token > 0 or model.vision_ms_per_token_sq > 0
    return {"status": "PASS" if ok or not on_gpu else "FAIL", "report": {**report, "cost_model": model.to_json()},
            "line": f"fwd {biggest['forward_ms']:.2f} / bwd {biggest['backward_ms']:.2f} ms at {tokens} image tokens, "
                    f"{model.vision_ms_per_token:.3e} ms per token"}


def part_megatron_one_gpu(out: str, timeout: float, log) -> dict:
    """Megatron-LM's own training loop on one GPU through the user's launcher, balancing on
    (DP=1: nothing moves; what shows is that the loop runs with packs delivered on the GPU)."""
    import importlib.util
    import subprocess
    if importlib.util.find_spec("transformer_engine") is None:
        return {"status": "SKIP", "line": "transformer-engine is not importable: examples/multimodal's GPU "
                                          "specs need it (the CPU harness runs this loop in the test suite)"}
    run_dir = os.path.join(out, "megatron-1gpu")
    os.makedirs(run_dir, exist_ok=True)
    env = dict(os.environ, NPROC_PER_NODE="1", EP="1", GBS="2", TRAIN_ITERS="6", MM_BALANCE="1",
               OUTPUT_DIR=run_dir)
    if not env.get("DATA_PATH"):
        from megatron_mm_balance.data.make_dataset import make_dataset
        data = os.path.join(out, "megatron-data")
        if not os.path.exists(os.path.join(data, "dataset.yaml")):
            make_dataset(data, samples=64, seed=0)
        env.update(DATA_PATH=os.path.join(data, "dataset.yaml"), TOKENIZER_MODEL=os.path.join(data, "tokenizer"))
    argv = ["bash", os.path.join(REPO, "scripts", "pretrain_vlm_moe.sh"), "--config",
            os.path.join(REPO, "configs", "megatron", "tiny_cpu.sh")]
    with open(os.path.join(out, "megatron-1gpu.log"), "w") as f:
        try:
            rc = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO,
                                start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    from megatron_mm_balance.bench.realpath import ITER_RE
    with open(os.path.join(out, "megatron-1gpu.log"), errors="replace") as f:
        iters = len(ITER_RE.findall(f.read()))
    ok = rc == 0 and iters >= 6
    return {"status": "PASS" if ok else "FAIL", "line": f"exit {rc}, {iters} iterations logged (megatron-1gpu.log)"}


def summary(out: str) -> int:
    """The one-screen table of every part's result; exit status 1 if any failed."""
    env = environment()
    print(f"== gpu_check: torch {env['torch']}, {env['device_name']}, transformer-engine "
          f"{'yes' if env['transformer_engine'] else 'missing'}, megatron-core "
          f"{'yes' if env['megatron_core'] else 'missing'}")
    failed = False
    for p in PARTS:
        path = os.path.join(out, "parts", f"{p.key}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            res = json.load(f)
        failed |= res["status"] == "FAIL"
        print(f"{res['status']:<5} {p.number}. {p.title:<38} {res['line'][:160]}")
    print(f"results in {os.path.abspath(out)}")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU validation for megatron-mm-balance (docs/gpu.md)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "./gpu_results")
    ap.add_argument("--cpu", action="store_true", help="the small CPU configuration (what the tests run)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--part", default=None, choices=[p.key for p in PARTS], help="run this part")
    ap.add_argument("--plan", action="store_true", help="print 'key timeout' of the parts that run here")
    ap.add_argument("--list", action="store_true", help="print every part, what it checks, whether it runs here")
    ap.add_argument("--summary", action="store_true", help="print the table of the parts' results in OUT")
    ap.add_argument("--gpus", type=int, default=None, help="plan for this many GPUs (default: the visible ones)")
    ap.add_argument("--bridge-only", action="store_true",
                    help="run only part 8 (Megatron-Bridge's Qwen3-VL toy through its launcher)")
    ap.add_argument("--bridge-plan", action="store_true", help="print part 8's launcher runs and exit")
    ap.add_argument("--bridge-ranks", type=int, default=None,
                    help="ranks of part 8 (default: the visible GPUs; on a CPU the launcher's CPU harness runs them)")
    ap.add_argument("--bridge-iters", type=int, default=6)
    ap.add_argument("--bridge-timeout", type=float, default=900.0, help="seconds per launcher run")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.bridge_only or args.bridge_plan:
        return bridge_main(args)
    if args.summary:
        return summary(args.out)
    gpus = args.gpus
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.list:
        list_parts(gpus, args.out, args.cpu)
        return 0
    if args.plan:
        for p in PARTS:
            if why_not(p, gpus, args.cpu) is None:
                print(p.key, p.timeout)
        return 0
    if args.part:
        return 0 if run_part(args.part, args.out, args.cpu, args.repeats)["status"] != "FAIL" else 1
    failed = False                          # every part that runs here, in this process
    for p in PARTS:
        if why_not(p, gpus, args.cpu) is None:
            failed |= run_part(p.key, args.out, args.cpu, args.repeats)["status"] == "FAIL"
    return summary(args.out) or int(failed)


# --------------------------------------------------------------------------- Bridge: CP frame split
# Self-contained: the context-parallel Qwen3-VL launcher run, mm_balance.cp_split=count vs cost
# (docs/notes/2026-12-02-bridge-cp-split.md). Only its planning runs without GPUs (tests/bridge/test_gpu_check_cp_split.py).

#: Bridge's iteration line (each line is that iteration's loss: Bridge resets its accumulators).
BRIDGE_ITER_RE = r"\biteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.Ee+-]+)"


def bridge_cp_split_plan(*, repo: str, bridge_dir: str, data_path: str, out: str, python: str = "python3",
                         iters: int = 6, gpus: int = 2) -> list:
    """The two launcher runs of the check: the toy Qwen3-VL MoE config on ``gpus`` GPUs with
    context parallel 2 and ``vision_dp_when_cp``, fp32, ``mm_balance`` on, frames split by
    count, then by cost. Each: ``{"name", "argv", "env", "log"}`` (env: the variables to set)."""
    if gpus < 2 or gpus % 2:
        raise ValueError(f"the context-parallel check needs an even number of GPUs (CP=2), got {gpus}")
    runs = []
    for split in ("count", "cost"):
        run_dir = os.path.join(out, f"bridge-cp2-{split}")
        env = {"MEGATRON_BRIDGE_DIR": bridge_dir, "DATA_PATH": data_path, "PYTHON": python,
               "MM_BALANCE": "1", "CP": "2", "EP": "1", "NPROC_PER_NODE": str(gpus), "GBS": "8",
               "PRECISION": "fp32", "TRAIN_ITERS": str(iters), "OUTPUT_DIR": run_dir, "LOG_INTERVAL": "1"}
        argv = ["bash", os.path.join(repo, "scripts", "pretrain_bridge_vlm.sh"), "--config",
                os.path.join(repo, "configs", "bridge", "qwen3_vl_moe_tiny_cpu.sh"),
                "model.vision_dp_when_cp=true", f"mm_balance.cp_split={split}"]
        runs.append({"name": split, "argv": argv, "env": env, "log": run_dir + ".log"})
    return runs


def bridge_cp_split_check(plan: list, log, timeout: float = 900.0) -> dict:
    """Run the plan's launcher commands; the per-iteration losses, their largest relative
    difference (count vs cost: the same maths, so only reduction order may differ), and wall times."""
    import re
    import subprocess
    result = {}
    for run in plan:
        t0 = time.perf_counter()
        with open(run["log"], "w") as f:
            rc = subprocess.run(run["argv"], env=dict(os.environ, **run["env"]), stdout=f,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        text = open(run["log"], errors="replace").read()
        losses = {int(i): float(v) for i, v in re.findall(BRIDGE_ITER_RE, text)}
        result[run["name"]] = {"rc": rc, "wall_s": time.perf_counter() - t0, "losses": losses}
        log(f"  cp_split={run['name']}: rc {rc}, {len(losses)} iterations, "
            f"{result[run['name']]['wall_s']:.0f} s, log {run['log']}")
    a, b = result["count"]["losses"], result["cost"]["losses"]
    common = sorted(set(a) & set(b))
    result["max_rel_loss_diff"] = max((abs(a[i] - b[i]) / abs(a[i]) for i in common), default=None)
    result["ok"] = all(result[n]["rc"] == 0 for n in ("count", "cost")) and bool(common) \
        and result["max_rel_loss_diff"] <= 1e-5
    return result


def bridge_cp_split_main(argv) -> int:
    """``gpu_check.py --bridge-cp-split``: the check above (``--plan-only`` prints the plan)."""
    ap = argparse.ArgumentParser(description="Bridge Qwen3-VL context-parallel frame split, count vs cost")
    ap.add_argument("--bridge-cp-split", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or "./gpu_results")
    ap.add_argument("--bridge-dir", default=os.environ.get("MEGATRON_BRIDGE_DIR"))
    ap.add_argument("--data-path", default=os.environ.get("DATA_PATH"))
    ap.add_argument("--python", default=os.environ.get("PYTHON", "python3"))
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--plan-only", action="store_true")
    args = ap.parse_args(argv)
    if not args.bridge_dir or not args.data_path:
        print("--bridge-cp-split needs MEGATRON_BRIDGE_DIR (a patched Megatron-Bridge v0.6.0) and DATA_PATH "
              "(mm-balance make-dataset --format bridge-qwen-vl)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plan = bridge_cp_split_plan(repo=repo, bridge_dir=args.bridge_dir, data_path=args.data_path,
                                out=os.path.abspath(args.out), python=args.python, iters=args.iters,
                                gpus=args.gpus)
    if args.plan_only:
        print(json.dumps(plan, indent=1))
        return 0
    result = bridge_cp_split_check(plan, log=print)
    with open(os.path.join(args.out, "bridge_cp_split.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'iter':>4} {'cp_split=count':>16} {'cp_split=cost':>16}")
    for i in sorted(result["count"]["losses"]):
        print(f"{i:>4} {result['count']['losses'][i]:>16.6E} {result['cost']['losses'].get(i, float('nan')):>16.6E}")
    print(f"max relative loss difference: {result['max_rel_loss_diff']}; ok: {result['ok']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(bridge_cp_split_main(sys.argv[1:]) if "--bridge-cp-split" in sys.argv[1:] else main())
