"""GPU validation: calibrate the cost model on real kernels and prove the overlap.

Run through ``scripts/gpu_check.sh`` (which sets up paths). On a GPU it:

1. times a CLIP ViT-L/14-sized vision encoder forward and backward in bf16 against
   image tokens per pack (0 to 8192, single and many images), CUDA events after
   warm-up, medians of repeats; megatron-core's ``CLIPViTModel`` when it can be
   built here, a plain PyTorch encoder of the same shape otherwise; fits the cost
   model and writes ``cost_model.json`` (accepted by ``--mm-balance-cost model``);
2. runs ``BalancedDataIterator``'s CUDA path with world size 1 (pinned host packs
   copied on the dedicated stream) around a matmul-heavy stand-in for compute,
   ``overlap=True`` vs ``overlap=False``: the consumer's wait per micro-step, and
   a bit-identity check of every delivered tensor;
3. the per-pack timing hooks of ``--mm-balance-timing`` (CUDA events) on a LLaVA-shaped
   model (that encoder body, a projection and a language-model stand-in) over packs of
   0 to 8 images, and the online fit of ``--mm-balance-cost auto`` from those records
   (coefficients, R^2; ``timing.jsonl`` and ``online_fit.json``);
4. installs nothing, and says what it skipped when a package is missing.

``scripts/gpu_check.sh`` then, with two or more visible GPUs and a patched Megatron-LM
in ``MEGATRON_LM_DIR``, runs ``mm-balance bench-realpath`` (NCCL, transformer-engine):
Megatron's own iteration time off vs on, one round; and (part 5, ``--bridge-only``) with a
patched Megatron-Bridge (``MEGATRON_BRIDGE_DIR``, or installed for ``PYTHON``) the Bridge
Qwen3-VL toy through ``scripts/pretrain_bridge_vlm.sh``: on one GPU the balanced run with
its per-iteration times, on two or more off vs on (NCCL, transformer-engine).

Without a GPU the same code runs on CPU with a tiny encoder and small payloads
(``--cpu``, also what the test suite runs), so every line is exercised in CI.
Results: ``OUT/gpu_check.json``, ``OUT/cost_model.json``, ``OUT/calibration.json``
and a short table printed last.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time


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
        waits, delivered = [], []
        t_start = time.perf_counter()
        with it:
            for _ in range(steps * ga):
                t0 = time.perf_counter()
                batch = next(it)
                waits.append((time.perf_counter() - t0) * 1e3)
                y = a
                for _ in range(4):            # the stand-in for a micro-step's compute
                    y = y @ a
                    y = y / y.abs().max()
                # touch the delivered tensor on the compute stream, like a model would
                s = batch["imgs"].float().sum()
                if cuda:
                    torch.cuda.synchronize()
                delivered.append(digest(batch))
                del s, y
        total = time.perf_counter() - t_start
        identical = delivered == src.digests
        key = "overlap" if overlap else "sync"
        results[key] = {
            "wait_ms_mean": sum(waits) / len(waits),
            "wait_ms_p50": sorted(waits)[len(waits) // 2],
            "wait_ms_total": sum(waits),
            "total_s": total,
            "bit_identical": identical,
            "on_device": bool(batch["imgs"].device.type == torch.device(device).type),
        }
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


def bridge_plan(ranks: int, *, out: str, iters: int = 6) -> list:
    """Part 5's launcher runs for ``ranks`` GPUs: one GPU, the balanced job alone (its
    per-iteration times; with DP=1 nothing moves, so what shows is the hook's own cost);
    two or three, off then on at DP=2; four or more, off then on at the config's
    DP=2 x EP=2 MoE layout. Each run: a name, its launcher environment, its command."""
    if ranks < 1:
        return []
    if ranks == 1:
        layouts = [("1gpu-on", 1, 1, "1")]
    elif ranks < 4:
        layouts = [("dp2-off", 2, 1, "0"), ("dp2-on", 2, 1, "1")]
    else:
        layouts = [("dp2-ep2-off", 4, 2, "0"), ("dp2-ep2-on", 4, 2, "1")]
    return [{"name": name,
             "env": {"NPROC_PER_NODE": str(nproc), "EP": str(ep), "MM_BALANCE": balance,
                     "TRAIN_ITERS": str(iters), "LOG_INTERVAL": "1",
                     "OUTPUT_DIR": os.path.join(out, "bridge", name)},
             "argv": ["bash", BRIDGE_LAUNCHER, "--config", BRIDGE_CONFIG]}
            for name, nproc, ep, balance in layouts]


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
    """Part 5: the Bridge Qwen3-VL toy through scripts/pretrain_bridge_vlm.sh (bridge_plan),
    each run's per-iteration times, and off vs on (lm loss equality, packs moved, median
    iteration time). Skips, with the reason, what cannot run here."""
    import subprocess

    import torch

    python = os.environ.get("PYTHON", "python3")
    cuda = torch.cuda.is_available()
    plan = bridge_plan(ranks, out=out, iters=iters)
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
        with open(log_path, "w") as f:
            try:
                rc = subprocess.run(run["argv"], env=renv, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout, cwd=REPO, start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                rc = -9
        with open(log_path, errors="replace") as f:
            res = parse_bridge_log(f.read())
        res.update(rc=rc, wall_s=time.perf_counter() - t0, log=log_path,
                   median_ms=median_after_warmup(res["elapsed_ms"]))
        runs[run["name"]] = res
        med = f"{res['median_ms']:.1f} ms" if res["median_ms"] is not None else "n/a"
        log(f"  {run['name']:<12} exit {rc}, {res['wall_s']:.0f} s wall, {len(res['losses'])} iterations, "
            f"median iteration {med}, packs moved {sum(res['packs_moved'].values())}")
    report = {"ranks": ranks, "cuda": cuda, "runs": runs}
    off = next((r for n, r in runs.items() if n.endswith("-off")), None)
    on = next((r for n, r in runs.items() if n.endswith("-on")), None)
    if off and on and off["losses"] and sorted(off["losses"]) == sorted(on["losses"]):
        report["max_rel_loss_diff"] = max(abs(on["losses"][i] - off["losses"][i]) / max(abs(off["losses"][i]), 1e-12)
                                          for i in off["losses"])
        if off["median_ms"] and on["median_ms"]:
            report["median_on_over_off"] = on["median_ms"] / off["median_ms"]
    report["ok"] = all(r["rc"] == 0 and len(r["losses"]) == iters for r in runs.values()) and \
        (off is None or report.get("max_rel_loss_diff", 1.0) <= 1e-5)
    return report


def print_bridge_table(rep: dict) -> None:
    if "skipped" in rep:
        print(f"== 5. Megatron-Bridge Qwen3-VL toy: skipped ({rep['skipped']})")
        return
    print(f"{'Bridge run':<14} {'exit':>5} {'iterations':>10} {'median ms':>10} {'packs moved':>12}")
    for name, r in rep["runs"].items():
        med = f"{r['median_ms']:.1f}" if r["median_ms"] is not None else "n/a"
        print(f"{name:<14} {r['rc']:>5} {len(r['losses']):>10} {med:>10} {sum(r['packs_moved'].values()):>12}")
    if "max_rel_loss_diff" in rep:
        print(f"{'max relative lm-loss difference off/on':<44} {rep['max_rel_loss_diff']:>14.2e}")
    if "median_on_over_off" in rep:
        print(f"{'median iteration time on / off':<44} {rep['median_on_over_off']:>14.3f}")


def bridge_main(args) -> int:
    """--bridge-plan: print part 5's runs for the GPUs here (or --bridge-ranks) and exit;
    --bridge-only: run part 5, write OUT/bridge_check.json, print its table."""
    ranks = args.bridge_ranks
    if ranks is None:
        import torch
        ranks = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.bridge_plan:
        print(json.dumps(bridge_plan(ranks, out=args.out, iters=args.bridge_iters), indent=1))
        return 0
    print(f"== 5. Megatron-Bridge Qwen3-VL toy through scripts/pretrain_bridge_vlm.sh ({ranks} rank(s))", flush=True)
    rep = bridge_check(out=args.out, ranks=ranks, iters=args.bridge_iters, timeout=args.bridge_timeout,
                       log=lambda m: print(m, flush=True))
    with open(os.path.join(args.out, "bridge_check.json"), "w") as f:
        json.dump(rep, f, indent=1)
    print_bridge_table(rep)
    return 0 if rep.get("ok", "skipped" in rep) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU validation for megatron-mm-balance")
    ap.add_argument("--out", default=os.environ.get("OUT") or "./gpu_results")
    ap.add_argument("--cpu", action="store_true", help="force the small CPU run")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--bridge-only", action="store_true",
                    help="run only part 5 (Megatron-Bridge's Qwen3-VL toy through its launcher)")
    ap.add_argument("--bridge-plan", action="store_true", help="print part 5's launcher runs and exit")
    ap.add_argument("--bridge-ranks", type=int, default=None,
                    help="ranks of part 5 (default: the visible GPUs; on a CPU the launcher's CPU harness runs them)")
    ap.add_argument("--bridge-iters", type=int, default=6)
    ap.add_argument("--bridge-timeout", type=float, default=900.0, help="seconds per launcher run")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.bridge_only or args.bridge_plan:
        return bridge_main(args)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    import torch

    from megatron_mm_balance.cost import calibration

    env = environment()
    on_gpu = env["cuda"] and not args.cpu
    device = "cuda" if on_gpu else "cpu"
    log(f"== environment: torch {env['torch']}, device {env['device_name']}, "
        f"transformer-engine {'yes' if env['transformer_engine'] else 'MISSING (skipped)'}, "
        f"megatron-core {'yes' if env['megatron_core'] else 'MISSING (skipped)'}")
    if not env["cuda"]:
        log("  no CUDA device: running the small CPU configuration (not a GPU measurement)")
    report = {"environment": env, "device": device}

    log("== 1. cost-model calibration (vision encoder forward/backward vs image tokens)")
    if on_gpu and env["megatron_core"]:
        report["mcore_clip"] = try_mcore_clip(log)
    t0 = time.perf_counter()
    cal = calibration.calibrate(
        device=device, quick=not on_gpu, max_tokens=8192 if on_gpu else 1024,
        repeats=args.repeats or (10 if on_gpu else 5), warmup=3 if on_gpu else 1,
        log=lambda m: log(m))
    model = calibration.save_results(cal, os.path.join(args.out, "cost_model.json"),
                                     os.path.join(args.out, "calibration.json"))
    report["calibration_s"] = time.perf_counter() - t0
    report["cost_model"] = model.to_json()
    log(f"  fitted: {model.vision_ms_per_token:.3e} ms/token + {model.vision_ms_per_token_sq:.3e} "
        f"ms/token^2 + {model.const_ms:.3f} ms, backward/forward {model.vision_backward_ratio:.2f}")

    log("== 2. BalancedDataIterator overlap on a dedicated stream (world size 1)")
    ov = overlap_check(device=device, steps=8 if on_gpu else 3, ga=4,
                       mbytes=64.0 if on_gpu else 0.5, compute_n=8192 if on_gpu else 256, log=log)
    report["overlap"] = ov

    log("== 3. per-pack timing hooks (--mm-balance-timing) and the online fit (--mm-balance-cost auto)")
    tc = timing_check(device=device, out=args.out,
                      shape=calibration.EncoderShape() if on_gpu else calibration.EncoderShape.tiny(),
                      tile_tokens=256 if on_gpu else 16, seq_len=8192 if on_gpu else 512,
                      lm_hidden=2048 if on_gpu else 64, lm_layers=8 if on_gpu else 2,
                      iterations=6 if on_gpu else 3, microbatches=8 if on_gpu else 6, log=log)
    report["timing"] = tc

    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    ok = (ov["sync"]["bit_identical"] and ov["overlap"]["bit_identical"]
          and tc["records"] == tc["expected"])
    print()
    print(f"{'check':<44} {'value':>14}")
    print(f"{'device':<44} {env['device_name'][:14]:>14}")
    biggest = max(cal["records"], key=lambda r: sum(r["images"]))
    print(f"{'vision fwd ms @ ' + str(sum(biggest['images'])) + ' image tokens':<44} {biggest['forward_ms']:>14.3f}")
    print(f"{'vision bwd ms @ ' + str(sum(biggest['images'])) + ' image tokens':<44} {biggest['backward_ms']:>14.3f}")
    print(f"{'fitted ms per image token':<44} {model.vision_ms_per_token:>14.3e}")
    print(f"{'consumer wait ms/step, overlap=False':<44} {ov['sync']['wait_ms_mean']:>14.3f}")
    print(f"{'consumer wait ms/step, overlap=True':<44} {ov['overlap']['wait_ms_mean']:>14.3f}")
    print(f"{'exposed wait / synchronous wait':<44} {ov['exposed_wait_ratio']:>14.3f}")
    print(f"{'delivered tensors bit-identical':<44} {str(ov['sync']['bit_identical'] and ov['overlap']['bit_identical']):>14}")
    print(f"{'micro-batches timed by the hooks / run':<44} {tc['records']:>7} / {tc['expected']:<5}")
    fit = tc["fit"]
    print(f"{'online fit: R^2 vision / language':<44} {fit['r2_vision']:>6.3f} / {fit['r2_language']:<6.3f}")
    if fit["model"]:
        print(f"{'online fit: vision ms per image token':<44} {fit['model']['vision_ms_per_token']:>14.3e}")
    print(f"results in {os.path.abspath(args.out)}")
    return 0 if ok else 1


# --------------------------------------------------------------------------- Bridge: CP frame split
# Self-contained: the context-parallel Qwen3-VL launcher run, mm_balance.cp_split=count vs cost
# (docs/bridge.md section 7). Only its planning runs without GPUs (tests/bridge/test_gpu_check_cp_split.py).

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
