"""Multi-process harness for the runtime tests: real processes, real gloo on
127.0.0.1, a hard timeout on every launch (processes are killed, never waited on
forever).

``launch(world, scenario, **kw)`` runs ``python rt_harness.py`` once per rank;
each rank runs the scenario function ``scenario_<name>(rank, world, **kw)`` and
writes its JSON-able return value (or the exception text) to a file that the
launcher collects.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

from megatron_mm_balance.bench.runtime import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def launch(world: int, scenario: str, hard_timeout: float = 120.0, **kw) -> list[dict]:
    """Run ``scenario`` on ``world`` ranks; returns each rank's result dict.

    A rank that does not finish within ``hard_timeout`` is killed and reported as
    ``{"killed": True}``; a rank that exits without a result as ``{"exitcode": n}``.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        procs = []
        for r in range(world):
            cmd = [sys.executable, os.path.join(HERE, "rt_harness.py"), scenario, str(r), str(world),
                   str(port), tmp, json.dumps(kw)]
            log = open(os.path.join(tmp, f"log{r}.txt"), "w")
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + hard_timeout
        results = []
        for r, (p, log) in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for r, (p, log) in enumerate(procs):
            killed = p.poll() is None
            if killed:
                p.kill()
                p.wait()
            log.close()
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path) and not killed:
                with open(path) as f:
                    res = json.load(f)
            else:
                res = {"killed": killed, "exitcode": p.returncode}
            with open(os.path.join(tmp, f"log{r}.txt")) as f:
                res["log"] = f.read()[-4000:]
            results.append(res)
        return results


# --------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------

def make_pack(rank: int, i: int, seed: int = 0):
    """A deterministic ragged pack with nested tensors and plain values."""
    import torch
    g = torch.Generator().manual_seed(hash((seed, rank, i)) & 0xFFFFFFFF)
    u = torch.rand((), generator=g).item()
    cost = 0 if u < 0.3 else int(torch.randint(1, 4000, (), generator=g))
    ntok = int(torch.randint(1, 64, (), generator=g))
    tiles = int(torch.randint(0, 3, (), generator=g))
    return {
        "id": f"r{rank}-p{i}",
        "image_tokens": torch.tensor(cost),
        "tokens": torch.randint(0, 50000, (ntok,), generator=g),
        "imgs": torch.randn(tiles, 3, 4, 4, generator=g).to(torch.bfloat16),
        "meta": {"name": f"sample {i}", "n": i, "ok": True, "none": None,
                 "nested": [torch.randn(2, 3, generator=g).t(), ("x", 3.5, torch.tensor(True))]},
    }


def checksum(obj) -> str:
    """Hash over tensor bytes, dtypes, shapes and the plain values, in structure order."""
    import torch
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            h.update(f"D{type(x).__name__}".encode())
            for k, v in x.items():
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"L{type(x).__name__}{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"V{type(x).__name__}{x!r}".encode())
    walk(obj)
    return h.hexdigest()


def stats_rows(it, keys) -> list:
    """``it.stats`` as plain dicts of ``keys`` (:class:`BatchStats` fields and properties, or
    the plan's fields), then the exhaustion as ``{global_batch, exhausted, packs_pulled,
    not_delivered}`` once the source ran out: picklable, for the parent process."""
    rows = []
    for s in it.stats:
        row = {}
        for k in keys:
            if hasattr(s, k):
                row[k] = getattr(s, k)
            elif hasattr(s.plan, k):
                row[k] = getattr(s.plan, k)
        rows.append(row)
    ex = it.exhaustion
    if ex is not None:
        rows.append({"global_batch": ex.global_batch, "exhausted": True,
                     "packs_pulled": list(ex.pulled), "not_delivered": ex.not_delivered})
    return rows


def recording_source(rank: int, n: int, log: list, seed: int = 0, fail_at=None):
    """Yields ``n`` packs, appending ``(id, cost, checksum)`` as each is pulled."""
    for i in range(n):
        if fail_at is not None and i == fail_at:
            raise ValueError(f"boom in the data source of rank {rank}")
        p = make_pack(rank, i, seed)
        log.append((p["id"], int(p["image_tokens"]), checksum(p)))
        yield p


def _run_iterator(it, G, out: list):
    """Consume until StopIteration; ``out`` gets ``[gb, step, id, checksum]`` rows."""
    gb = 0
    while True:
        for k in range(G):
            try:
                p = next(it)
            except StopIteration:
                return
            out.append([gb, k, p["id"], checksum(p)])
        gb += 1


def scenario_exactly_once(rank, world, configs, batches, extra=1, ranks_per_node=None, node_of_rank=None):
    """For each (G, overlap): ``batches`` full global batches, then exhaustion
    (rank 0 holds ``extra`` more packs than the others, never delivered). ``node_of_rank``:
    this rank's torchrun ``GROUP_RANK`` is ``node_of_rank[rank]`` (the node the iterator finds)."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    if node_of_rank is not None:
        os.environ["GROUP_RANK"] = str(node_of_rank[rank])
    res = []
    for ci, (G, overlap, *rest) in enumerate(configs):
        as_callable = bool(rest and rest[0])
        pulled, got = [], []
        n = batches * G + (extra if rank == 0 else 0)
        src = recording_source(rank, n, pulled, seed=ci)
        num_mb = (lambda G=G: G) if as_callable else G    # callable: consumer-triggered batches
        with BalancedDataIterator(src, num_microbatches=num_mb, overlap=overlap, timeout=60,
                                  ranks_per_node=ranks_per_node) as it:
            _run_iterator(it, G, got)
            try:
                next(it)
                again = "no StopIteration"
            except StopIteration:
                again = "StopIteration"
            stats = stats_rows(it, ("global_batch", "packs_moved", "bytes_received", "bytes_sent",
                                    "inter_node_packs", "inter_node_bytes_sent"))
        res.append({"G": G, "overlap": overlap, "pulled": pulled, "delivered": got, "again": again,
                    "stats": stats})
    return {"configs": res}


class SourceState:
    """A savable source's checkpoint: the index of the next pack (weak-referenceable, so a
    test can count how many states are still alive)."""

    def __init__(self, next_index: int):
        self.next = next_index


class SavableSource:
    """Deterministic packs ``make_pack(rank, i, seed)`` for ``i`` in ``[start, n)``, with
    ``save_state()``; ``SavableSource(rank, n, seed, start=state.next)`` resumes exactly."""

    def __init__(self, rank: int, n: int, seed: int = 0, start: int = 0, live=None):
        self.rank, self.n, self.seed, self.i = rank, n, seed, start
        self.pulls = 0
        self.live = live            # a WeakSet that collects every state handed out

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        p = make_pack(self.rank, self.i, self.seed)
        self.i += 1
        self.pulls += 1
        return p

    def save_state(self) -> SourceState:
        st = SourceState(self.i)
        if self.live is not None:
            self.live.add(st)
        return st


def scenario_save_state(rank, world, configs, before=3, total=6, soak=30):
    """Per (G, overlap, callable): an uninterrupted run of ``total`` global batches; a run
    stopped after ``before`` (state saved at the boundary while the thread has read ahead,
    then one micro-batch more to hit the mid-batch error); a fresh source and iterator
    resumed from the saved state for the rest. Then a soak counting live states."""
    import gc
    import weakref
    from megatron_mm_balance.runtime import BalancedDataIterator

    def make(src, G, overlap, as_callable):
        return BalancedDataIterator(src, num_microbatches=(lambda: G) if as_callable else G,
                                    overlap=overlap, timeout=60)

    def consume(it, G, batches, out):
        for gb in range(batches):
            for k in range(G):
                p = next(it)
                out.append([gb, k, p["id"], checksum(p)])

    res = []
    for ci, (G, overlap, as_callable) in enumerate(configs):
        n = total * G
        r = {"G": G, "overlap": overlap, "callable": as_callable}
        full = []
        with make(SavableSource(rank, n, seed=ci), G, overlap, as_callable) as it:
            r["state_initial"] = it.save_state().next
            consume(it, G, total, full)
            try:
                next(it)
                r["after_end"] = "no StopIteration"
            except StopIteration:
                r["after_end"] = "StopIteration"
            r["state_exhausted"] = it.save_state().next
            r["moved"] = sum(s.packs_moved for s in it.stats)
        src = SavableSource(rank, n, seed=ci)
        first = []
        with make(src, G, overlap, as_callable) as it:
            consume(it, G, before, first)
            deadline = time.monotonic() + 30.0   # let the thread pull the whole next batch
            while overlap and not as_callable and src.pulls < (before + 1) * G and time.monotonic() < deadline:
                time.sleep(0.01)
            r["pulled_at_save"] = src.pulls
            state = it.save_state()
            r["state_saved"] = state.next
            r["prefetched"] = [s.prefetched for s in it.stats]
            next(it)
            try:
                it.save_state()
                r["mid_batch"] = "no error"
            except Exception as e:
                r["mid_batch"] = f"{type(e).__name__}: {e}"
        resumed = []
        with make(SavableSource(rank, n, seed=ci, start=state.next), G, overlap, as_callable) as it:
            consume(it, G, total - before, resumed)
        r.update(full=full, first=first, resumed=resumed)
        res.append(r)

    # Soak: states of consumed batches are dropped (only a few are ever alive).
    live = weakref.WeakSet()
    G = configs[0][0]
    with make(SavableSource(rank, soak * G + G, live=live), G, True, False) as it:
        alive = []
        for b in range(soak):
            for _ in range(G):
                next(it)
            gc.collect()
            alive.append(len(live))
        handed = it.save_state().next
    return {"configs": res, "alive": alive, "handed": handed}


def scenario_predict(rank, world, schedule, wrong_at=None):
    """Ramp-up with ``predict_microbatches``: the thread free-runs on the predicted counts,
    the consumer's callable gives the real ones (differing at ``wrong_at`` if set)."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    real, pred = iter(schedule), iter(schedule)
    seen = []

    def num_mb():
        n = next(real)
        seen.append(n)
        return n + (1 if wrong_at is not None and len(seen) - 1 == wrong_at else 0)

    pulled, got, out = [], [], {}
    src = SavableSource(rank, sum(schedule), seed=3)
    with BalancedDataIterator(src, num_microbatches=num_mb, predict_microbatches=lambda: next(pred),
                              timeout=30) as it:
        try:
            for gb, G in enumerate(schedule):
                for k in range(G):
                    p = next(it)
                    got.append([gb, k, p["id"], checksum(p)])
                if gb == 1:
                    deadline = time.monotonic() + 10.0     # the thread reads ahead at once
                    while src.pulls <= 3 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    out["state_after_1"] = it.save_state().next
                    out["pulled_after_1"] = src.pulls
            out["outcome"] = "ok"
        except Exception as e:
            out["outcome"] = f"{type(e).__name__}: {e}"
        out["prefetched"] = [s.prefetched for s in it.stats]
        out["per_batch"] = [s.num_microbatches for s in it.stats]
    out["delivered"] = got
    return out


class PhaseCost:
    """A two-phase cost: (image tokens, 1000 x text length) per pack."""
    components = 2
    identity = "rt_harness.PhaseCost"

    def __call__(self, pack):
        return (int(pack["image_tokens"]), 1000 * int(pack["tokens"].numel()))


def scenario_two_phase(rank, world, G=5, batches=3, overlap=True):
    """Vector (vision, language) costs through the real exchange."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    pulled, got = [], []
    cost = PhaseCost()

    def src():
        for i in range(batches * G):
            p = make_pack(rank, i, seed=7)
            pulled.append((p["id"], *cost(p), checksum(p)))
            yield p

    with BalancedDataIterator(src(), num_microbatches=G, overlap=overlap, timeout=60,
                              cost_fn=cost) as it:
        _run_iterator(it, G, got)
        stats = stats_rows(it, ("global_batch", "packs_moved", "microstep_cost_after"))
    return {"pulled": pulled, "delivered": got, "stats": stats}


def scenario_soak(rank, world, batches, G=4, warmup=50):
    """Small packs, many global batches: threads and RSS after warm-up vs at the end."""
    import threading
    import torch
    from megatron_mm_balance.runtime import BalancedDataIterator

    def source():
        i = 0
        while True:
            yield {"image_tokens": (i * 7919 + rank * 104729) % 3000,
                   "tokens": torch.full((64 + i % 17,), i), "id": i}
            i += 1

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    import json
    import tempfile
    probe_dir = tempfile.mkdtemp(prefix="mm-balance-probe-")
    os.environ["MM_BALANCE_PROBE"] = f"{probe_dir}:25"        # a sample every 25 global batches
    out = {}
    with BalancedDataIterator(source(), num_microbatches=G, timeout=60) as it:
        del os.environ["MM_BALANCE_PROBE"]
        for b in range(batches):
            for _ in range(G):
                next(it)
            if b == warmup - 1:
                out.update(threads_warm=threading.active_count(), rss_warm=rss_mb(),
                           os_threads_warm=len(os.listdir("/proc/self/task")))
        out.update(threads_end=threading.active_count(), rss_end=rss_mb(),
                   os_threads_end=len(os.listdir("/proc/self/task")),
                   moved=sum(s.packs_moved for s in it.stats))
    out["threads_closed"] = threading.active_count()
    out["exchange_threads_closed"] = sum(t.name == "mm-balance-exchange" for t in threading.enumerate())
    with open(os.path.join(probe_dir, f"probe-rank{rank:05d}.jsonl")) as f:
        out["probe"] = [json.loads(line) for line in f]
    return out


def scenario_disabled(rank, world):
    """Rank 0 iterates a disabled iterator over the world group while rank 1 issues
    no collective at all: any collective (even creating a group) would block."""
    import threading
    import torch.distributed as dist
    from megatron_mm_balance.runtime import BalancedDataIterator
    out = {}
    if rank == 0:
        items = [{"image_tokens": i, "id": i} for i in range(20)]
        before = threading.active_count()
        it = BalancedDataIterator(iter(items), num_microbatches=3, group=dist.group.WORLD,
                                  enabled=False, timeout=5)
        got = list(it)
        out = {"same_objects": all(a is b for a, b in zip(got, items)) and len(got) == len(items),
               "threads_delta": threading.active_count() - before, "stats": len(it.stats)}
        it.close()
    return out


def scenario_shadow(rank, world, G=4, batches=3):
    """Shadow mode: costs gathered and solved, every rank delivered its own packs in order."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    from megatron_mm_balance.runtime.config import BalancerConfig
    pulled, got = [], []
    src = recording_source(rank, batches * G, pulled)
    with BalancedDataIterator(src, num_microbatches=G,
                              config=BalancerConfig(shadow=True, timeout=60)) as it:
        _run_iterator(it, G, got)
        stats = [row for row in stats_rows(it, (
            "shadow", "packs_moved", "packs_would_move", "packs_sent", "packs_received", "bytes_sent",
            "bytes_received", "predicted_gain", "microstep_cost_before", "microstep_cost_after"))
            if not row.get("exhausted")]
    return {"pulled": [p[0] for p in pulled], "costs": [p[1] for p in pulled],
            "delivered": [row[2] for row in got], "stats": stats}


def scenario_control(rank, world, G=4, batches=3, overlap=True):
    """Control mode: costs gathered and solved, every rank delivered its own packs permuted
    across micro-steps (``overlap``: on the exchange thread or inside ``next()``)."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    from megatron_mm_balance.runtime.config import BalancerConfig
    pulled, got = [], []
    src = recording_source(rank, batches * G, pulled)
    with BalancedDataIterator(src, num_microbatches=G,
                              config=BalancerConfig(control=True, overlap=overlap, timeout=60)) as it:
        _run_iterator(it, G, got)
        stats = [row for row in stats_rows(it, (
            "mode", "control", "packs_moved", "packs_reordered", "packs_sent", "packs_received",
            "bytes_sent", "bytes_received", "my_costs")) if not row.get("exhausted")]
    return {"pulled": [p[0] for p in pulled], "costs": [p[1] for p in pulled],
            "checksums": [p[2] for p in pulled], "delivered": [row[2] for row in got],
            "delivered_checksums": [row[3] for row in got], "stats": stats}


def scenario_crossover(rank, world, G=4, batches=4, overlap=True, parity="even", first_iteration=None):
    """Crossover: balanced delivery at iterations of ``parity``, every rank's own packs in order
    at the others (``first_iteration``: the training iteration of global batch 0)."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    from megatron_mm_balance.runtime.config import BalancerConfig
    pulled, got = [], []
    src = recording_source(rank, batches * G, pulled)
    cfg = BalancerConfig(crossover=parity, overlap=overlap, timeout=60)
    with BalancedDataIterator(src, num_microbatches=G, config=cfg, first_iteration=first_iteration) as it:
        _run_iterator(it, G, got)
        stats = [row for row in stats_rows(it, ("mode", "shadow", "packs_moved", "packs_would_move",
                                                "packs_sent", "packs_received"))
                 if not row.get("exhausted")]
    return {"pulled": [p[0] for p in pulled], "costs": [p[1] for p in pulled],
            "checksums": [p[2] for p in pulled], "delivered": [row[2] for row in got],
            "delivered_checksums": [row[3] for row in got], "stats": stats}


def scenario_whole_batch(rank, world, G=4, batches=3):
    """Without the exchange thread, the first ``next()`` of a global batch exchanges all of
    it: rank 0 takes every micro-step of each batch while the other ranks, after their first
    micro-step, wait in a barrier that rank 0 joins only when it has its whole batch. An
    exchange that met at later micro-steps would leave rank 0 waiting for a peer's pack
    until the timeout."""
    import torch.distributed as dist
    from megatron_mm_balance.runtime import BalancedDataIterator
    from megatron_mm_balance.runtime.config import BalancerConfig
    pulled, got = [], []
    src = recording_source(rank, batches * G, pulled)
    with BalancedDataIterator(src, num_microbatches=G,
                              config=BalancerConfig(overlap=False, timeout=10)) as it:
        for gb in range(batches):
            for k in range(G):
                if rank != 0 and k == 1:
                    dist.barrier()
                p = next(it)
                got.append([gb, k, p["id"], checksum(p)])
            if rank == 0:
                dist.barrier()
        stats = [row for row in stats_rows(it, ("packs_moved", "packs_sent", "packs_received"))]
    return {"pulled": [p[0] for p in pulled], "costs": [p[1] for p in pulled],
            "checksums": [p[2] for p in pulled], "delivered": [row[2] for row in got],
            "delivered_checksums": [row[3] for row in got], "stats": stats}


def _outcome(fn):
    """Run ``fn``; describe the exception it raised (or "ok"), with the context the runtime
    attached to an error it re-raises unchanged."""
    try:
        return {"ok": fn()}
    except StopIteration as e:
        return {"type": "StopIteration", "msg": str(e)}
    except BaseException as e:
        return {"type": type(e).__name__, "msg": str(e), "context": getattr(e, "mm_balance_context", None)}


def scenario_misc(rank, world, G=2):
    """Failure modes that leave the group healthy, in one launch (world >= 3)."""
    import torch
    from megatron_mm_balance.runtime import BalancedDataIterator
    out = {}

    def consume(it, n=None):
        got = []
        while n is None or len(got) < n:
            got.append(next(it)["id"])
        return got

    # a. a peer's data source raises at global batch 2.
    src = recording_source(rank, 50, [], fail_at=2 * G + 1 if rank == 1 else None)
    with BalancedDataIterator(src, num_microbatches=G, timeout=20) as it:
        out["raise"] = _outcome(lambda: consume(it))
        out["raise_again"] = _outcome(lambda: consume(it))

    # b. inconsistent num_microbatches; c. inconsistent solver settings.
    with BalancedDataIterator(recording_source(rank, 50, []), num_microbatches=G + (rank == 2),
                              timeout=20) as it:
        out["mismatch_G"] = _outcome(lambda: consume(it))
    with BalancedDataIterator(recording_source(rank, 50, []), num_microbatches=G, timeout=20,
                              sync="step" if rank == 0 else "microstep") as it:
        out["mismatch_settings"] = _outcome(lambda: consume(it))

    # d. ramp-up: a callable num_microbatches read once per global batch.
    schedule, calls = [1, 2, 3, 3, 5], []

    def num_mb():
        calls.append(1)
        return schedule[min(len(calls) - 1, len(schedule) - 1)]
    pulled, got = [], []
    with BalancedDataIterator(recording_source(rank, sum(schedule), pulled), num_microbatches=num_mb,
                              timeout=20) as it:
        gb = 0
        try:
            while True:
                for k in range(schedule[min(gb, len(schedule) - 1)]):
                    p = next(it)
                    got.append([gb, k, p["id"], checksum(p)])
                gb += 1
        except StopIteration:
            pass
        out["ramp"] = {"pulled": pulled, "delivered": got, "calls": len(calls),
                       "per_batch": [s.num_microbatches for s in it.stats]}

    # e. the cost function raises inside the background thread on rank 0.
    def bad_cost(p):
        if p["id"] == "r0-p3":
            raise KeyError("cost of r0-p3")
        return int(p["image_tokens"])
    with BalancedDataIterator(recording_source(rank, 50, []), num_microbatches=G, cost_fn=bad_cost,
                              timeout=20) as it:
        out["thread_error"] = _outcome(lambda: consume(it))

    # g. iterators built in a different order on different ranks over one exchange group:
    #    the store keys come from the group's name and the caller's name, not from how many
    #    iterators this process built, so rank 1's posted error still reaches its peers.
    from megatron_mm_balance.runtime import new_exchange_groups
    shared = new_exchange_groups([list(range(world))], timeout=20)
    if rank == 0:
        BalancedDataIterator(recording_source(rank, 4, []), num_microbatches=G, timeout=20,
                             exchange_group=shared, name="other").close()
    src = recording_source(rank, 50, [], fail_at=G + 1 if rank == 1 else None)
    with BalancedDataIterator(src, num_microbatches=G, timeout=20, exchange_group=shared,
                              name="train") as it:
        out["keys_by_name"] = _outcome(lambda: consume(it))

    # f. one rank's source ends mid-batch: all ranks stop at the same boundary.
    n = 3 * G - (1 if rank == 1 else 0)
    with BalancedDataIterator(recording_source(rank, n, []), num_microbatches=G, timeout=20) as it:
        got = []
        out["short"] = _outcome(lambda: [got.append(next(it)["id"]) for _ in range(100)])
        out["short"]["delivered"] = len(got)
        out["short"]["stats"] = stats_rows(it, ())[-1]
    return out


def scenario_unreadable_qwen_vl(rank, world, G=2):
    """Qwen-VL packs costed by :class:`QwenVLCost`; rank 1's fourth pack (global batch 1)
    has pixels but no grid. Every rank must stop at batch 1 with that rank's message,
    after delivering batch 0 only (nothing of batch 1 moves), overlapped or not."""
    import torch
    from megatron_mm_balance.cost.pack import QwenVLCost
    from megatron_mm_balance.runtime import BalancedDataIterator

    def source():
        for i in range(50):
            side = 2 + (rank + i) % 3
            vi = {"pixel_values": torch.zeros(side * side, 4),
                  "image_grid_thw": torch.tensor([[1, side, side]])}
            if rank == 1 and i == G + 1:
                del vi["image_grid_thw"]
            yield {"id": f"r{rank}-p{i}", "input_ids": torch.zeros(1, 8), "visual_inputs": vi}

    out = {}
    for overlap in (True, False):
        got = []
        with BalancedDataIterator(source(), num_microbatches=G, cost_fn=QwenVLCost(2), timeout=20,
                                  overlap=overlap, name=f"qwen{int(overlap)}") as it:
            res = _outcome(lambda: [got.append(next(it)["id"]) for _ in range(10 * G)])
        res["delivered"] = len(got)
        out[f"overlap={overlap}"] = res
    return out


def _mm_pack(rank: int, i: int, tiles=(2, 1), length: int = 100, placeholders=None):
    """An examples/multimodal-form pack (image placeholder: token 7) of two keyed samples."""
    import torch
    n = len(tiles) if placeholders is None else placeholders
    return {"__key__": [f"r{rank}-s{i}a,r{rank}-s{i}b"], "tokens": torch.tensor([[7] * n + [1] * 5]),
            "imgs": torch.zeros(sum(tiles), 3, 4, 4), "num_tiles": torch.tensor(tiles, dtype=torch.int32),
            "cu_lengths": torch.tensor([[0, length // 2, length]], dtype=torch.int32)}


def _failure(fn, delivered: list) -> dict:
    """What ``fn`` raised (type, message, the runtime's context) and how many packs came out."""
    out = _outcome(fn)
    out["delivered"] = len(delivered)
    return out


def scenario_bad_input(rank, world, G=2):
    """Bad input at global batch 1, micro-step 1 (iteration 6: ``first_iteration=5``), one
    case per iterator: a pack whose num_tiles contradicts imgs (rank 1), one with a surplus
    image placeholder (rank 2), one longer than the sequence (rank 0), a NaN cost (rank 1), a
    negative cost (rank 2). Each must stop every rank before anything of batch 1 is delivered.
    Then, in the same launch, :func:`scenario_faults`' injected faults."""
    import math
    import torch
    from megatron_mm_balance.cost.pack import ImageTokenCost
    from megatron_mm_balance.cost.pack_check import PackCheck
    from megatron_mm_balance.runtime import BalancedDataIterator

    bad_at = G + 1

    def with_tiles(i):
        p = _mm_pack(rank, i)
        p["num_tiles"] = torch.tensor([3, 1], dtype=torch.int32)
        return p
    cases = {"tiles": (1, with_tiles, None), "placeholders": (2, lambda i: _mm_pack(rank, i, placeholders=3), None),
             "too_long": (0, lambda i: _mm_pack(rank, i, length=5000), None),
             "nan_cost": (1, None, math.nan), "negative_cost": (2, None, -5.0)}
    out = {}
    for name, (victim, bad_pack, bad_cost) in cases.items():
        bad_key = f"r{victim}-s{bad_at}a"
        base = ImageTokenCost(4)

        def cost(p, bad_cost=bad_cost, bad_key=bad_key):
            return bad_cost if bad_cost is not None and bad_key in p["__key__"][0] else base(p)

        def source(victim=victim, bad_pack=bad_pack):
            for i in range(50):
                yield bad_pack(i) if bad_pack and rank == victim and i == bad_at else _mm_pack(rank, i)
        got = []
        it = BalancedDataIterator(source(), num_microbatches=G, cost_fn=cost, timeout=20, name=name,
                                  check_fn=PackCheck(max_length=1024, image_token_id=7), first_iteration=5)
        with it:
            out[name] = _failure(lambda: [got.append(next(it)) for _ in range(10 * G)], got)
    out.update(scenario_faults(rank, world, G))
    return out


def scenario_faults(rank, world, G=2):
    """``MM_BALANCE_FAULT`` raise / end / corrupt on rank 1 at iteration 6 (global batch 1 with
    ``first_iteration=5``), micro-step 1: what every rank raises, and how much was delivered."""
    from megatron_mm_balance.cost.pack import ImageTokenCost
    from megatron_mm_balance.cost.pack_check import PackCheck
    from megatron_mm_balance.runtime import BalancedDataIterator

    out = {}
    for kind in ("raise", "end", "corrupt"):
        os.environ["MM_BALANCE_FAULT"] = f"{kind}:rank=1:iteration=6:microstep=1"
        got = []
        it = BalancedDataIterator((_mm_pack(rank, i) for i in range(50)), num_microbatches=G,
                                  cost_fn=ImageTokenCost(4), timeout=20, name=kind,
                                  check_fn=PackCheck(max_length=1024, image_token_id=7), first_iteration=5)
        del os.environ["MM_BALANCE_FAULT"]
        with it:
            out[kind] = _failure(lambda: [got.append(next(it)) for _ in range(10 * G)], got)
    return out


def scenario_fault_kill(rank, world, G=2, timeout=5.0):
    """``MM_BALANCE_FAULT=kill:rank=2:iteration=2:microstep=1``: rank 2 SIGKILLs itself when
    its exchange of global batch 1's micro-step 1 starts; what its peers raise, how fast."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    os.environ["MM_BALANCE_FAULT"] = f"kill:rank={world - 1}:iteration=2:microstep=1"
    it = BalancedDataIterator(recording_source(rank, 1000, []), num_microbatches=G, timeout=timeout)
    t0 = time.monotonic()
    res = _outcome(lambda: [next(it) for _ in range(10 * G)])
    res["elapsed"] = time.monotonic() - t0
    it.close()
    res["skip_teardown"] = True
    return res


def scenario_post_to_a_dead_peer(rank, world, timeout=5.0):
    """Rank 1 exits after a first collective; rank 0 then posts a send, a receive and an
    all-gather. gloo refuses each post itself ("Connection closed by peer"), before any
    wait: what the transport raises for each."""
    import torch
    import torch.distributed as dist
    from megatron_mm_balance.runtime.transport import PackTransport
    dist.all_reduce(torch.zeros(1))
    if rank == 1:
        os._exit(0)
    time.sleep(1.0)                                  # the peer's socket is closed by now
    tr = PackTransport(dist.group.WORLD, list(range(world)), rank, timeout=timeout)
    res = {"skip_teardown": True}
    res["send"] = _outcome(lambda: tr.finish(tr.send(make_pack(0, 0), 1, 3, 1), 3, 1))
    res["receive"] = _outcome(lambda: tr.receive(1, 3, 1))
    res["all_gather"] = _outcome(lambda: tr.all_gather(torch.zeros(2, dtype=torch.int64), "all-gather of pack costs", 3).tolist())
    return res


def scenario_die(rank, world, G=4, timeout=5.0):
    """Rank ``world-1`` exits abruptly in the middle of global batch 1."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    victim = world - 1
    it = BalancedDataIterator(recording_source(rank, 1000, []), num_microbatches=G, timeout=timeout)
    t0 = time.monotonic()
    try:
        for step in range(10 * G):
            next(it)
            if rank == victim and step == G + 1:
                os._exit(3)
        res = {"type": "none"}
    except BaseException as e:
        res = {"type": type(e).__name__, "msg": str(e)}
    res["elapsed"] = time.monotonic() - t0
    it.close()
    res["skip_teardown"] = True
    return res


def scenario_stall(rank, world, G=4, timeout=4.0, stall=12.0):
    """Rank ``world-1`` stops calling next() for ``stall`` seconds in global batch 1."""
    from megatron_mm_balance.runtime import BalancedDataIterator
    victim = world - 1
    it = BalancedDataIterator(recording_source(rank, 1000, []), num_microbatches=G, timeout=timeout)
    t0 = time.monotonic()
    res = {"type": "none"}
    try:
        for step in range(10 * G):
            next(it)
            if rank == victim and step == G + 1:
                time.sleep(stall)
    except BaseException as e:
        res = {"type": type(e).__name__, "msg": str(e)}
    res["elapsed"] = time.monotonic() - t0
    it.close()
    res["skip_teardown"] = True
    return res


def scenario_thread_device(rank, world, G=2, batches=3, overlap=True, delivery_batches=24):
    """With a fake CUDA (:mod:`megatron_mm_balance.testing.fake_cuda`) on every rank: the
    training thread selects device ``rank`` (as a launcher's LOCAL_RANK does); the iterator's
    exchange thread must run on it too, from its first call on, and the source (the train
    loader, whose first ``next()`` may start a pin-memory thread) must see it."""
    import threading
    from megatron_mm_balance.runtime import BalancedDataIterator
    from megatron_mm_balance.runtime.device import set_cuda_api
    from megatron_mm_balance.testing.fake_cuda import FakeCuda

    fake = FakeCuda(device_count=world)
    set_cuda_api(fake)
    fake.set_device(rank)
    pulls = []

    def source():
        i = 0
        while True:
            pulls.append((threading.current_thread().name, fake.current_device()))
            yield make_pack(rank, i)
            i += 1

    with BalancedDataIterator(source(), num_microbatches=G, overlap=overlap, timeout=30) as it:
        for _ in range(G * batches):
            next(it)
        moved = sum(s.packs_moved for s in it.stats)
    thread = "mm-balance-exchange" if overlap else "MainThread"
    calls = fake.by_thread(thread)
    out = {"first_call": [calls[0].name, calls[0].arg] if calls else None,
           "set_device": [c.arg for c in fake.calls_named("set_device")],
           "pull_threads": sorted({t for t, _ in pulls}), "pull_devices": sorted({d for _, d in pulls}),
           "moved": moved}
    out.update(_cuda_delivery(rank, fake, G, delivery_batches))
    out["mesh_error"] = _descriptor_shortage(rank, world)
    return out


def _descriptor_shortage(rank, world):
    """The last rank's descriptor limit is cut below what one more exchange group needs:
    creating the group must fail on every rank with the same one-line error (none hangs)."""
    import resource
    from megatron_mm_balance.runtime.groups import new_exchange_groups
    from megatron_mm_balance.runtime.mesh import DescriptorBudgetError
    if rank == world - 1:
        n = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, n + 64))
    try:
        new_exchange_groups([list(range(world))], timeout=30)
    except DescriptorBudgetError as e:
        return str(e)
    return None


def _cuda_delivery(rank, fake, G, batches):
    """Delivery to the (fake) device: which thread and stream do what, per delivered pack;
    the pinned pool's size after warm-up and at the end; what arrived (checksums)."""
    import threading
    import torch
    from megatron_mm_balance.runtime import BalancedDataIterator, wire
    fake.calls.clear()

    def source():
        i = 0
        while True:
            pack = make_pack(rank, i)
            if i % 2:                                   # a loader with pin_memory: no staging copy
                pack = wire._map(pack, fake.pin, torch.Tensor)
            yield pack
            i += 1

    def expected(pack_id):                              # "r<rank>-p<i>": its owner's draw
        r, i = pack_id[1:].split("-p")
        return checksum(make_pack(int(r), int(i)))

    got, protocol, pools = [], [], []
    with BalancedDataIterator(source(), num_microbatches=G, device="cuda", timeout=30) as it:
        for b in range(batches):
            for _ in range(G):
                before = len(fake.calls)
                pack = next(it)
                mine = [c for c in fake.calls[before:] if c.thread == threading.current_thread().name]
                protocol.append([[c.name, c.stream] for c in mine])
                got.append([pack["id"], checksum(pack), type(pack["tokens"]).__name__])
            if b in (batches // 2, batches - 1):
                pools.append(it.pinned_pool().__dict__)
        moved = sum(s.packs_moved for s in it.stats)
    copies = [[c.name, c.thread, c.device, c.stream] for c in fake.calls
              if c.name in ("to_device", "copy_async", "device_empty", "record_event")]
    ranges = {}
    for c in fake.calls:
        if c.name in ("range_push", "range_pop"):
            ranges.setdefault(c.thread, []).append(c.arg if c.name == "range_push" else None)
    return {"delivered_ok": all(expected(i) == h for i, h, _ in got),
            "delivered_types": sorted({t for _, _, t in got}), "protocol": protocol, "copies": copies,
            "ranges": ranges, "pools": pools, "cuda_moved": moved,
            "pinned_allocations": fake.pinned_allocations}


def run_rank(scenario, rank, world, port, outdir, kw):
    import datetime
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        res = globals()[f"scenario_{scenario}"](rank, world, **kw)
    except BaseException as e:                     # reported, not hidden
        import traceback
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(res, f)
    os.replace(os.path.join(outdir, f"rank{rank}.json.tmp"), os.path.join(outdir, f"rank{rank}.json"))
    if res.get("skip_teardown") and rank == 0:
        time.sleep(3.0)             # rank 0 hosts the store peers read to name a failed rank
    if not res.get("skip_teardown"):
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    scenario, rank, world, port, outdir, kw = sys.argv[1:]
    run_rank(scenario, int(rank), int(world), int(port), outdir, json.loads(kw))
