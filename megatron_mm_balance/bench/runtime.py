"""``mm-balance bench-runtime``: the emulated-straggler benchmark of the runtime.

Real processes (gloo on 127.0.0.1), real pack payloads (a pixel tensor of
``image_tokens x bytes_per_image_token`` bytes, so packs are MB-sized) and
compute emulated by sleeping, per micro-step, for the time a
:class:`~megatron_mm_balance.cost.model.CostModel` gives (vision forward proportional
to image tokens, a constant language-model part, backward = 2 x forward).
Sleeping keeps 8 ranks honest on a 2-core machine. Every micro-step ends in a
barrier (the MoE expert-parallel case: ranks meet every micro-step) and every
global batch in an all-reduce.

Six modes run side by side in one launch, on identical data:

* ``off``: ``BalancedDataIterator(enabled=False)``, each rank computes its own packs;
* ``sync``: balanced, ``overlap=False`` (the exchange sits in ``next()``);
* ``overlap``: balanced, ``overlap=True`` (background thread), int num_microbatches
  (the thread also prefetches across global-batch boundaries);
* ``overlap-callable``: the same with num_microbatches passed as a callable, as
  Megatron's ``get_num_microbatches`` under batch-size ramp-up (each global
  batch starts on request);
* ``overlap-save-state``: ``overlap`` with a checkpointable source (a cheap
  ``save_state()``, as energon's loaders have): the thread prefetches across
  global batches and pairs each with the source state; the run checks that
  ``save_state()`` at the end is the consumed position;
* ``ideal``: the same placement with zero exchange cost (every rank knows every
  rank's packs and sleeps for the pack the placement assigns it).

Also :func:`spawn`, the small process launcher the soak benchmark shares.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time

DEFAULTS = dict(world=8, microbatches=8, batches=8, warmup=1, rounds=5, seq_len=8192, seed=0,
                vision_us_per_token=2.0, lm_ms=12.0, bytes_per_image_token=1176,
                allreduce_mb=1.0, timeout=120.0)
MODES = ("off", "sync", "overlap", "overlap-callable", "overlap-save-state", "ideal")
#: mode -> (target gain as a share of the ideal gain, target exposed wait as a share of the
#: synchronous exchange wait)
TARGETS = {"overlap": (0.90, 0.10), "overlap-callable": (0.90, 0.10),
           "overlap-save-state": (0.95, 0.05)}
_DESCRIPTION = ("Emulated-straggler benchmark of the balanced iterator: gloo ranks, MB-sized packs, "
                "sleep-emulated compute; prints off / sync / overlap (int, callable, savable source) / "
                "ideal side by side.")


# ---------------------------------------------------------------------------
# launcher

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo rendezvous of local processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, outdir, cfg):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=cfg.get("timeout", 120)))
    res = fn(rank, world, cfg)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn, world: int, cfg: dict, hard_timeout: float) -> list[dict]:
    """Run ``fn(rank, world, cfg) -> dict`` on ``world`` gloo ranks; every rank is
    killed after ``hard_timeout`` seconds. Returns the ranks' dicts."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), tmp, cfg), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + hard_timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"benchmark ranks did not finish within {hard_timeout:.0f}s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


# ---------------------------------------------------------------------------
# one rank

def _pack_pool(cfg):
    """The shared, deterministic pack sequence (every rank builds the same one)."""
    from ..data.mixtures import make_mixture
    from ..data.packing import pack_greedy
    packs = pack_greedy(make_mixture("mixed", seed=cfg["seed"]), cfg["seq_len"]).packs
    need = (cfg["warmup"] + cfg["batches"]) * cfg["microbatches"] * cfg["world"]   # per round
    if len(packs) < need:
        raise ValueError(f"the mixture gave {len(packs)} packs, the benchmark needs {need}")
    return [(p.image_tokens, p.tokens, tuple(p.images)) for p in packs[:need]]


def _bench_rank(rank, world, cfg):
    import numpy as np
    import torch
    import torch.distributed as dist

    from ..cost.model import CostModel, PackFeatures
    from ..solver.placement import plan_placement
    from ..runtime.iterator import BalancedDataIterator

    G, W, B = cfg["microbatches"], cfg["warmup"], cfg["batches"]
    pool = _pack_pool(cfg)
    model = CostModel(vision_ms_per_token=cfg["vision_us_per_token"] / 1000.0,
                      const_ms=cfg["lm_ms"], backward_ratio=2.0)
    sleep_s = {}

    overshoot = [0.0]

    def compute(img, tok, images):
        key = (img, images)
        if key not in sleep_s:
            sleep_s[key] = model.step_ms(PackFeatures(images=images)) / 1000.0
        t = time.perf_counter()
        time.sleep(sleep_s[key])
        overshoot[0] += time.perf_counter() - t - sleep_s[key]   # CPU contention shows here

    mine = pool[rank::world]                      # rank r's stream, in order
    pixels = torch.full((max(p[0] for p in pool) * cfg["bytes_per_image_token"],), rank,
                        dtype=torch.uint8)

    def source():
        for img, tok, images in mine:
            yield {"pixels": pixels[: img * cfg["bytes_per_image_token"]],
                   "tokens": torch.zeros(cfg["seq_len"], dtype=torch.int64),
                   "image_tokens": img, "n_tokens": tok, "images": images}

    class SavableSource:
        """``source()`` plus a cheap ``save_state()``: the number of packs read."""

        def __init__(self):
            self.gen, self.read = source(), 0

        def __iter__(self):
            return self

        def __next__(self):
            p = next(self.gen)
            self.read += 1
            return p

        def save_state(self):
            return {"read": self.read}

    grad = torch.zeros(int(cfg["allreduce_mb"] * 2**20 / 4))
    out = {mode: [] for mode in MODES}
    for _round, mode in [(r, m) for r in range(cfg["rounds"]) for m in MODES]:
        it = None
        if mode != "ideal":
            src = SavableSource() if mode == "overlap-save-state" else source()
            it = BalancedDataIterator(src, num_microbatches=(lambda: G) if "callable" in mode else G,
                                      enabled=mode != "off", overlap=mode.startswith("overlap"),
                                      timeout=cfg["timeout"])
        dist.barrier()
        t0 = None
        for b in range(W + B):
            if b == W:
                dist.barrier()
                t0 = time.perf_counter()
                overshoot[0] = 0.0
            if mode == "ideal":
                costs = np.array([[pool[(b * G + k) * world + r][0] for k in range(G)]
                                  for r in range(world)], dtype=np.int64)
                plc = plan_placement(costs)
            for k in range(G):
                if mode == "ideal":
                    p = pool[(b * G + int(plc.src_index[rank, k])) * world + int(plc.src_rank[rank, k])]
                    compute(*p)
                else:
                    p = next(it)
                    compute(p["image_tokens"], p["n_tokens"], p["images"])
                dist.barrier()
            dist.all_reduce(grad)
        elapsed = time.perf_counter() - t0
        rec = {"s_per_batch": elapsed / B, "overshoot_ms": overshoot[0] * 1e3 / B}
        if mode == "overlap-save-state":
            state = it.save_state()
            if state != {"read": (W + B) * G}:
                raise RuntimeError(f"rank {rank}: save_state() {state} after {(W + B) * G} packs consumed")
        if it is not None:
            st = list(it.stats)[-B:] if mode != "off" else []
            rec.update(
                wait_ms=float(np.mean([s.consumer_wait_ms for s in st])) if st else 0.0,
                wait_first_ms=float(np.mean([s.consumer_wait_first_ms for s in st])) if st else 0.0,
                exchange_ms=float(np.mean([s.exchange_ms + s.allgather_ms + s.solver_ms
                                           for s in st])) if st else 0.0,
                mb_moved=float(np.mean([s.bytes_received for s in st]) / 2**20) if st else 0.0,
                packs_moved=float(np.mean([s.packs_moved for s in st])) if st else 0.0,
                prefetched=float(np.mean([s.prefetched for s in st])) if st else 0.0,
                microstep_before=float(np.mean([s.plan.microstep_cost_before for s in st])) if st else 0.0,
                microstep_after=float(np.mean([s.plan.microstep_cost_after for s in st])) if st else 0.0)
            it.close()
        out[mode].append(rec)
    return out


# ---------------------------------------------------------------------------
# report

def summarise(results: list[dict]) -> dict:
    """Per mode: the best (minimum) over rounds of the slowest rank's seconds per
    global batch, and the median. Modes run interleaved, round after round, so
    drifting machine load hits them alike; other processes on the machine only
    ever add time, so the best round is the least disturbed one. Waits and
    bytes are means over ranks and rounds."""
    import numpy as np
    rows = {}
    for mode in MODES:
        rounds = len(results[0][mode])
        per_round = [max(r[mode][i]["s_per_batch"] for r in results) for i in range(rounds)]
        row = {"s_per_batch": float(np.min(per_round)), "s_per_batch_median": float(np.median(per_round)),
               "s_per_batch_rounds": per_round}
        for key in ("overshoot_ms", "wait_ms", "wait_first_ms", "exchange_ms", "mb_moved", "packs_moved",
                    "prefetched"):
            if key in results[0][mode][0]:
                row[key] = float(np.mean([x[key] for r in results for x in r[mode]]))
        rows[mode] = row
    off = rows["off"]["s_per_batch"]
    off_median = rows["off"]["s_per_batch_median"]
    for row in rows.values():
        row["gain"] = off / row["s_per_batch"] - 1.0
        row["gain_median"] = off_median / row["s_per_batch_median"] - 1.0
    return rows


def format_table(rows: dict, cfg: dict) -> str:
    lines = [f"world={cfg['world']} num_microbatches={cfg['microbatches']}, {cfg['rounds']} rounds x "
             f"{cfg['batches']} measured global batches (+{cfg['warmup']} warm-up) per mode, "
             f"{cfg['bytes_per_image_token']} payload bytes per image token; barrier per micro-step, "
             f"all-reduce per global batch; s / global batch = slowest rank, best of the rounds",
             "| mode | s / global batch | throughput gain vs off | gain, medians "
             "| consumer wait ms / batch "
             "| of which first micro-step | exchange-side ms / batch | MB received / rank / batch "
             "| sleep overshoot ms / batch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        r = rows[mode]
        fmt = lambda k: f"{r[k]:.1f}" if k in r else "-"
        lines.append(f"| {mode} | {r['s_per_batch']:.3f} | {100 * r['gain']:+.1f}% "
                     f"| {100 * r['gain_median']:+.1f}% | {fmt('wait_ms')} "
                     f"| {fmt('wait_first_ms')} | {fmt('exchange_ms')} | {fmt('mb_moved')} | {fmt('overshoot_ms')} |")
    lines.append("")
    lines.append("s / global batch per round: " + "; ".join(
        f"{m} " + " ".join(f"{x:.3f}" for x in rows[m]["s_per_batch_rounds"]) for m in MODES))
    for mode, (gain_target, wait_target) in TARGETS.items():
        sync_wait = rows["sync"]["wait_ms"]
        ratio = rows[mode]["wait_ms"] / sync_wait if sync_wait else float("nan")
        share = rows[mode]["gain"] / rows["ideal"]["gain"] if rows["ideal"]["gain"] > 0 else float("nan")
        share_med = (rows[mode]["gain_median"] / rows["ideal"]["gain_median"]
                     if rows["ideal"]["gain_median"] > 0 else float("nan"))
        lines.append(f"{mode}: exposed wait / synchronous exchange wait {100 * ratio:.1f}% "
                     f"(target <= {100 * wait_target:.0f}%); gain / ideal gain {100 * share:.0f}% "
                     f"(medians {100 * share_med:.0f}%; target >= {100 * gain_target:.0f}%)")
    lines.append("global batches pulled before the consumer asked for them: " + "; ".join(
        f"{m} {100 * rows[m]['prefetched']:.0f}%" for m in MODES if m not in ("off", "ideal"))
        + "; overlap-save-state: save_state() equal to the consumed position on every rank")
    return "\n".join(lines)


def run(args) -> int:
    cfg = {k: getattr(args, k) for k in DEFAULTS}
    if not 2 <= cfg["world"] <= 64:
        print(f"mm-balance bench-runtime: error: --world must be in [2, 64], got {cfg['world']}",
              file=sys.stderr)
        return 2
    if cfg["microbatches"] < 1 or cfg["batches"] < 1 or cfg["warmup"] < 0 or cfg["rounds"] < 1:
        print("mm-balance bench-runtime: error: --microbatches, --batches and --rounds must be >= 1, "
              "--warmup >= 0", file=sys.stderr)
        return 2
    t0 = time.time()
    results = spawn(_bench_rank, cfg["world"], cfg, hard_timeout=args.hard_timeout)
    rows = summarise(results)
    print(format_table(rows, cfg))
    print(f"(wall {time.time() - t0:.0f}s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, "ranks": results}, f, indent=1)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=DEFAULTS["world"], help="gloo ranks (4-8 on 2 cores)")
    p.add_argument("--microbatches", type=int, default=DEFAULTS["microbatches"],
                   help="num_microbatches per global batch")
    p.add_argument("--batches", type=int, default=DEFAULTS["batches"], help="measured global batches per mode")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="unmeasured global batches per mode")
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"],
                   help="the modes run interleaved this many times; the table shows best and medians")
    p.add_argument("--seq-len", dest="seq_len", type=int, default=DEFAULTS["seq_len"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="mixture seed")
    p.add_argument("--vision-us-per-token", dest="vision_us_per_token", type=float,
                   default=DEFAULTS["vision_us_per_token"], help="emulated vision forward, us per image token")
    p.add_argument("--lm-ms", dest="lm_ms", type=float, default=DEFAULTS["lm_ms"],
                   help="emulated language-model forward per pack, ms")
    p.add_argument("--bytes-per-image-token", dest="bytes_per_image_token", type=int,
                   default=DEFAULTS["bytes_per_image_token"], help="payload bytes per image token")
    p.add_argument("--allreduce-mb", dest="allreduce_mb", type=float, default=DEFAULTS["allreduce_mb"])
    p.add_argument("--timeout", type=float, default=DEFAULTS["timeout"], help="exchange timeout, s")
    p.add_argument("--hard-timeout", dest="hard_timeout", type=float, default=900.0,
                   help="kill every rank after this many seconds")
    p.add_argument("--json", default=None, help="also write the numbers to this file")


def register(subparsers) -> None:
    p = subparsers.add_parser("bench-runtime", help="emulated-straggler benchmark of the balanced iterator",
                              description=_DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_runtime", description=_DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))
