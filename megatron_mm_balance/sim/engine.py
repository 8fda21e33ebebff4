"""Run every strategy on the same simulated global batches and summarise them.

For each DP size (and each LLM size of a sweep) the engine draws ``B`` global
batches of ``D x G`` packs from the 1D pool (``none``, ``local``, both
``redistribute`` runs see exactly the same packs) and from each 2D-budget pool
(``budget``, same seed), orders them per strategy, times them with
:func:`.timeline.simulate_timeline`, and reports per run:

* ``efficiency``: the packer's efficiency (real tokens / (packs x seq_len));
* ``time_per_batch_ms``: mean step time;
* ``wait_share``: rank-time spent waiting for other ranks / (D x step time);
* ``exchange_share``: rank-time in exposed pack exchange / (D x step time);
* ``slowdown``: step time / the perfectly balanced, free-exchange step - 1
  (the waste expressed relative to useful work);
* ``throughput_rel``: real tokens per second / that of ``none`` at the same DP;
* ``bytes_moved_per_step``: bytes of packs that change rank per global batch,
  summed over ranks (0 unless redistributing).

Pipeline parallelism (``pp > 1``) is simplified: the vision encoder sits on the
first stage together with 1/pp of the LLM layers; the first stage is therefore
the slowest and sets the steady-state pace, so a pipeline replica is simulated
as its first stage (LM phase / pp), and the fill/drain bubble adds
``(pp - 1) x`` the mean LM time of one micro-batch on one stage per step.
Replicas meet as ``sync`` says (EP all-to-alls within stage 0, or the all-reduce).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..cost.model import FeatureArrays, image_token_costs
from ..solver.floors import batch_floors
from .pool import PackPool, draw_indices
from .strategies import (DEFAULT_STRATEGIES, exchange_times, inter_node_mask, local_order,
                         redistribute_order)
from .timeline import check_ep, simulate_timeline
from .timing import TimingModel
from .vision_balance import all_to_all_ms, balanced_vision, frame_terms, simulate_images_timeline

BALANCE_COSTS = ("auto", "two-phase", "time", "image-tokens")
# Work per chunk of batches: keeps the [B, D, G] arrays near 8 MB each.
CHUNK_ELEMENTS = 1 << 20


@dataclass
class SimConfig:
    dps: list[int]
    ga: int
    seq_len: int
    sync: str = "microstep"
    pp: int = 1
    batches: int = 10
    seed: int = 0
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    balance_cost: str = "auto"
    draw: str = "iid"
    heatmap_ranks: int = 64
    ranks_per_node: int | None = 8
    prefetch: bool = False
    #: report the bounds (perfect balance, the floors of whole packs and of whole frames)
    floors: bool = True
    #: ``microstep`` sync: ranks meet per micro-step in groups of this many consecutive
    #: data-parallel ranks (the expert-parallel group); None: all of them (EP = DP)
    ep: int | None = None
    #: the frame planner's time per micro-step and group (ms): planned ahead on the exchange
    #: thread with the micro-step's transfers (``redistribute-images``/``-frames``)
    frame_plan_ms: float = 0.0


@dataclass
class PackPhases:
    """Per-pool-pack phase times (ms, stage 0), exchange bytes, placement cost, tokens.

    ``cost`` is ``[P]`` for a scalar balance cost, ``[P, 2]`` (vision, language
    microseconds) for ``two-phase``."""
    vf: np.ndarray
    lm: np.ndarray
    vb: np.ndarray
    nbytes: np.ndarray
    cost: np.ndarray
    tokens: np.ndarray
    bubble: float


def resolve_balance_cost(balance_cost: str, t: TimingModel) -> str:
    """``auto``: ``two-phase`` when the timing model has both a vision and a
    language-model term (the two phases ranks meet between), else ``time``."""
    if balance_cost != "auto":
        return balance_cost
    vision = t.vision_ms_per_token or t.vision_ms_per_token_sq or t.vision_ms_per_pack
    llm = t.llm_ms_per_token or t.llm_ms_per_token_sq
    return "two-phase" if vision and llm else "time"


def pool_features(pool: PackPool, t: TimingModel) -> FeatureArrays:
    """The cost estimator's features of every pack in ``pool`` (positions: the sequence
    length when the timing model computes padding, else each pack's own tokens)."""
    positions = np.broadcast_to(np.asarray(pool.seq_len if t.llm_compute_padding else pool.tokens,
                                           dtype=np.float64), pool.tokens.shape)
    return FeatureArrays(image_tokens=pool.image_tokens, image_sq=pool.image_sq,
                         has_images=pool.num_images > 0, positions=positions,
                         len_sq=pool.sample_len_sq)


def pack_phases(pool: PackPool, t: TimingModel, *, pp: int = 1,
                balance_cost: str = "time") -> PackPhases:
    """Timing of every pack in ``pool`` under timing model ``t``, through the project's cost
    estimator (:class:`~megatron_mm_balance.cost.model.CostModel`, which also gives the
    placement's integer costs: the runtime's own ``--mm-balance-cost model`` arithmetic)."""
    balance_cost = resolve_balance_cost(balance_cost, t)
    if balance_cost not in BALANCE_COSTS:
        raise ValueError(f"balance cost must be one of {BALANCE_COSTS}, got {balance_cost!r}")
    model, feats = t.cost_model(), pool_features(pool, t)
    ph = model.phase_ms(feats)
    vf, vb = ph.vision_forward, ph.vision_backward
    lm = ph.llm / pp
    nbytes = (t.bytes_per_image_token * pool.image_tokens
              + t.bytes_per_text_token * pool.text_tokens).astype(np.float64)
    if balance_cost == "image-tokens":
        cost = image_token_costs(feats)
    else:        # two-phase: (vision, language) microseconds; time: their sum
        cost = model.integer_costs(feats, balance_cost, llm_divisor=pp, phases=ph)
    bubble = (pp - 1) * float(lm.mean()) if pp > 1 else 0.0
    return PackPhases(vf.astype(np.float64), lm.astype(np.float64), vb.astype(np.float64),
                      nbytes, cost, pool.tokens.astype(np.float64), bubble)


@dataclass
class _Acc:
    """Sums over batches for one run."""
    time: float = 0.0
    ideal: float = 0.0
    tokens: float = 0.0
    wait: float = 0.0
    exch: float = 0.0
    bytes: float = 0.0
    inter_bytes: float = 0.0
    inter_moved: int = 0
    inter_group: int = 0            # packs computed in another step group (with ep)
    moved: int = 0
    slots: int = 0
    batches: int = 0
    objective: float = 0.0          # the placements' objective, summed over batches
    perfect: float = 0.0            # the perfectly even one, likewise
    vision: dict = field(default_factory=dict)   # image balancing: what the planner did
    solver_ms: list = field(default_factory=list)

    def add(self, res: dict, tokens: np.ndarray, D: int, overhead: float,
            moved_bytes=None, moved=0, inter_bytes=0.0, inter_moved=0):
        self.time += float(res["time"].sum())
        self.ideal += float((res["busy"].mean(axis=1) + res["bubble"] + overhead).sum())
        self.tokens += float(tokens.sum())
        self.wait += float(res["wait"].sum()) / D
        self.exch += float(res["exchange"].sum()) / D
        self.batches += len(res["time"])
        self.slots += int(tokens.size)
        if moved_bytes is not None:
            self.bytes += float(moved_bytes)
            self.moved += int(moved)
            self.inter_bytes += float(inter_bytes)
            self.inter_moved += int(inter_moved)

    def add_objective(self, v, lm, sync: str, ep: int | None = None) -> None:
        """The placement's objective (module :mod:`megatron_mm_balance.solver.floors`) of
        ``[B, D, G]`` vision (forward + backward) and language times in compute order;
        ``ep``: per-micro-step groups of ``ep`` consecutive ranks, the slowest group's."""
        if sync == "microstep" and ep is not None:
            B, D, G = v.shape
            gv = v.reshape(B, D // ep, ep, G).max(axis=2)
            gl = lm.reshape(B, D // ep, ep, G).max(axis=2)
            j = (gv + gl).sum(axis=2).max(axis=1)
        elif sync == "microstep":
            j = v.max(axis=1).sum(axis=1) + lm.max(axis=1).sum(axis=1)
        else:
            j = (v + lm).sum(axis=2).max(axis=1)
        self.objective += float(j.sum())
        self.perfect += float((v + lm).sum(axis=(1, 2)).sum()) / v.shape[1]

    def summary(self) -> dict:
        extra = {"objective_over_perfect": self.objective / self.perfect} if self.perfect else {}
        if self.vision.get("vision_ms"):
            extra["vision_moved_share"] = self.vision["moved_ms"] / self.vision["vision_ms"]
            extra["vision_max_over_floor"] = self.vision["max_ms"] / self.vision["floor_ms"]
        return {**extra,
            "time_per_batch_ms": self.time / self.batches,
            "wait_share": self.wait / self.time,
            "exchange_share": self.exch / self.time,
            "slowdown": self.time / self.ideal - 1.0,
            "tokens_per_s": self.tokens / (self.time / 1000.0),
            "bytes_moved_per_step": self.bytes / self.batches,
            "moved_fraction": self.moved / self.slots if self.slots else 0.0,
            "inter_node_bytes_per_step": self.inter_bytes / self.batches,
            "inter_node_moved_fraction": self.inter_moved / self.slots if self.slots else 0.0,
            "inter_group_moved_fraction": self.inter_group / self.slots if self.slots else 0.0,
        }


def _inter_group(order: np.ndarray, ep: int | None) -> int:
    """Slots of gather index ``order`` ``[B, D, G]`` whose pack comes from another step group
    (groups of ``ep`` consecutive ranks; None: one group, 0)."""
    if ep is None:
        return 0
    B, D, G = order.shape
    return int(((order // G) // ep != (np.arange(D) // ep)[None, :, None]).sum())


def _gather(ph: PackPhases, idx: np.ndarray):
    return ph.vf[idx], ph.lm[idx], ph.vb[idx]


def _noise_field(timing: TimingModel, shape, seed: int, b0: int):
    """Per timeline slot factors ``(vision [B, D, G], language [B, 1, G])`` of the timing
    model's compute noise, the same for every strategy at the same slot; None without."""
    if not (timing.vision_noise_cv or timing.llm_noise_cv):
        return None
    B, D, G = shape
    rng = np.random.default_rng([seed, D, G, b0, 7919])
    zv = np.maximum(0.0, 1.0 + timing.vision_noise_cv * rng.standard_normal((B, D, G)))
    zl = np.maximum(0.0, 1.0 + timing.llm_noise_cv * rng.standard_normal((B, 1, G)))
    return zv, zl


def _timeline(vf, lm, vb, noise, **kw):
    """:func:`.timeline.simulate_timeline` of phases in compute order, with the noise field."""
    if noise is not None:
        zv, zl = noise
        vf, lm, vb = vf * zv, lm * zl, vb * zv
    return simulate_timeline(vf, lm, vb, **kw)


def _reorder(arrs, order):
    B, D, G = order.shape
    flat = order.reshape(B, -1)
    return [np.take_along_axis(a.reshape(B, -1), flat, axis=1).reshape(B, D, G) for a in arrs]


def step_group_labels(D: int, ep: int | None):
    """The step-group label of each of ``D`` data-parallel ranks for groups of ``ep``
    consecutive ranks (None: no labels, every rank meets every micro-step)."""
    return None if ep is None else tuple(r // ep for r in range(D))


def simulate_dp(cfg: SimConfig, D: int, timing: TimingModel, pool: PackPool,
                budget_pools: dict[int, PackPool], *, progress=None,
                keep_heatmap: bool = False, indices: np.ndarray | None = None
                ) -> tuple[list[dict], dict | None]:
    """All strategies at one DP size; returns (runs, heat maps of batch 0 or None).

    ``indices`` ``[B, D, G]`` (pool indices): the global batches as a run laid them out
    (``mm-balance simulate RUN_DIR``) instead of the seeded resampling of the pool."""
    G, B, sync = cfg.ga, cfg.batches, cfg.sync
    ep = check_ep(cfg.ep, D)
    if ep is not None and sync != "microstep":
        raise ValueError(f"--ep needs --sync microstep (expert parallelism), got {sync!r}")
    want = set(cfg.strategies)
    ph = pack_phases(pool, timing, pp=cfg.pp, balance_cost=cfg.balance_cost)
    ov = timing.step_overhead_ms
    if ov <= 0 and not (ph.vf.any() or ph.lm.any()):
        raise ValueError(f"timing model {timing.name!r} gives every pack zero time")
    if indices is None:
        idx_all = draw_indices(len(pool), B, D, G, seed=cfg.seed, mode=cfg.draw)
    else:
        idx_all = np.asarray(indices, dtype=np.int64)
        if idx_all.shape != (B, D, G):
            raise ValueError(f"layout indices have shape {idx_all.shape}, expected {(B, D, G)}")
    acc = {s: _Acc() for s in ("none", "local", "redistribute-sync", "redistribute-overlap",
                               "redistribute-groups", "redistribute-images", "redistribute-frames")}
    bounds = {"perfect": 0.0, "floor-packs": 0.0, "floor-frames": 0.0, "exact": True}
    frames = frame_terms(pool, timing) if cfg.floors else None
    heat = {} if keep_heatmap else None
    chunk = max(1, CHUNK_ELEMENTS // (D * G))

    for b0 in range(0, B, chunk):
        idx = idx_all[b0:b0 + chunk]
        nb = len(idx)
        vf, lm, vb = _gather(ph, idx)
        tok = ph.tokens[idx]
        noise = _noise_field(timing, (nb, D, G), cfg.seed, b0)
        res = _timeline(vf, lm, vb, noise, sync=sync, bubble=ph.bubble, overhead=ov, ep=ep)
        acc["none"].add(res, tok, D, ov)
        acc["none"].add_objective(vf + vb, lm, sync, ep)
        if cfg.floors:
            _add_floors(bounds, ph, frames, idx, D, sync, timing, ep)
        if heat is not None and b0 == 0:
            heat["none"] = (vf + lm + vb)[0]
        if "local" in want:
            lc = ph.cost[idx]
            order = local_order(lc.sum(axis=-1) if lc.ndim == 4 else lc)
            lvf, llm, lvb = _reorder((vf, lm, vb), order)
            acc["local"].add(_timeline(lvf, llm, lvb, noise, sync=sync, bubble=ph.bubble,
                                               overhead=ov, ep=ep), tok, D, ov)
            acc["local"].add_objective(lvf + lvb, llm, sync, ep)
            if heat is not None and b0 == 0:
                heat["local"] = (lvf + llm + lvb)[0]
        plans = [("today", ("redistribute-sync", "redistribute-overlap"), None),
                 ("groups", ("redistribute-groups",), step_group_labels(D, ep))]
        for key, names, labels in plans:
            if not want & set(names):
                continue
            cost = ph.cost[idx]
            order = np.empty((nb, D, G), dtype=np.int64)
            for i in range(nb):
                t0 = time.perf_counter()
                order[i] = redistribute_order(cost[i], sync=sync, ranks_per_node=cfg.ranks_per_node,
                                              step_groups=labels)
                acc[names[-1]].solver_ms.append((time.perf_counter() - t0) * 1e3)
                if progress is not None and key == "today":
                    progress.update(1)
            rvf, rlm, rvb = _reorder((vf, lm, vb), order)
            x, b_in = exchange_times(order, ph.nbytes[idx].reshape(nb, -1),
                                     link_gbps=timing.link_gbps, latency_ms=timing.latency_ms)
            moved_bytes, moved = b_in.sum(), int((b_in > 0).sum())
            inter = inter_node_mask(order, cfg.ranks_per_node)
            inter_bytes, inter_moved = float(b_in[inter].sum()), int(inter.sum())
            for name in names:
                if name not in want:
                    continue
                mode = "sync" if name == "redistribute-sync" else "overlap"
                # the synchronous balancer also waits for each batch's pull, all-gather
                # and solve (the overlapped one hides them)
                r = _timeline(rvf, rlm, rvb, noise, sync=sync, exchange=mode, x=x,
                              bubble=ph.bubble,
                              overhead=ov + (timing.sync_batch_ms if mode == "sync" else 0.0),
                              prefetch=cfg.prefetch and mode == "overlap", ep=ep)
                acc[name].add(r, tok, D, ov, moved_bytes, moved, inter_bytes, inter_moved)
                acc[name].add_objective(rvf + rvb, rlm, sync, ep)
                acc[name].inter_group += _inter_group(order, ep)
            if heat is not None and b0 == 0 and key == "today":
                heat["redistribute"] = (rvf + rlm + rvb)[0]
        if not want & {"redistribute-sync", "redistribute-overlap"} and progress is not None:
            progress.update(nb)
        for name, planner in (("redistribute-images", "images"), ("redistribute-frames", "frames")):
            if name in want:
                _images_run(acc[name], cfg, timing, pool, ph, idx, tok, ov, planner)

    base = acc["none"].summary()
    common = {"dp": D, "ep": D if ep is None else ep, "ga": G, "seq_len": cfg.seq_len,
              "sync": cfg.sync, "pp": cfg.pp,
              "batches": B, "timing": timing.name, "llm_params_b": timing.llm_params_b,
              "balance_cost": resolve_balance_cost(cfg.balance_cost, timing),
              "ranks_per_node": cfg.ranks_per_node, "prefetch": cfg.prefetch}
    runs = []

    def emit(name, a: _Acc, pl: PackPool, base_tps, **extra):
        s = a.summary()
        run = {**common, "strategy": name, "budget": pl.budget, "efficiency": pl.efficiency,
               **s, "throughput_rel": s["tokens_per_s"] / base_tps}
        if a.solver_ms:
            run["solver_ms_p50"] = float(np.median(a.solver_ms))
            run["solver_ms_max"] = float(np.max(a.solver_ms))
        run.update(extra)
        runs.append(run)

    if "none" in want:
        emit("none", acc["none"], pool, base["tokens_per_s"])
    if "budget" in want:
        for budget, bpool in sorted(budget_pools.items()):
            bph = pack_phases(bpool, timing, pp=cfg.pp, balance_cost=cfg.balance_cost)
            bidx = draw_indices(len(bpool), B, D, G, seed=cfg.seed, mode=cfg.draw)
            a = _Acc()
            for b0 in range(0, B, chunk):
                idx = bidx[b0:b0 + chunk]
                vf, lm, vb = _gather(bph, idx)
                a.add(simulate_timeline(vf, lm, vb, sync=sync, bubble=bph.bubble, overhead=ov),
                      bph.tokens[idx], D, ov)
            emit("budget", a, bpool, base["tokens_per_s"])
    for name in ("local", "redistribute-sync", "redistribute-overlap", "redistribute-groups",
                 "redistribute-images", "redistribute-frames"):
        if name in want:
            a = acc[name]
            if name == "redistribute-sync":
                a.solver_ms = acc["redistribute-overlap"].solver_ms
            emit(name, a, pool, base["tokens_per_s"])
    if cfg.floors:
        runs.extend(_bound_runs(bounds, acc["none"], {**common, "efficiency": pool.efficiency},
                                ph.bubble + ov, base["tokens_per_s"]))
    perfect = next((r["tokens_per_s"] for r in runs if r["strategy"] == "perfect"), None)
    for r in runs:
        if perfect and r.get("budget") is None:
            r["perfect_share"] = r["tokens_per_s"] / perfect
    return runs, heat


def _add_floors(bounds: dict, ph: PackPhases, frames, idx: np.ndarray, D: int, sync: str,
                timing: TimingModel, ep: int | None = None) -> None:
    """Add one chunk of batches' perfect balance and floors (:func:`batch_floors`: whole
    packs, and whole frames) to ``bounds``."""
    ratio = 1.0 + timing.vision_bwd_fwd_ratio
    fvision, heaviest = frames
    for b in idx:
        fl = batch_floors(ph.vf[b] + ph.vb[b], ph.lm[b], heaviest[b] * ratio, D, sync=sync,
                          frame_vision=fvision[b] * ratio, ep=ep)
        bounds["perfect"] += fl.perfect
        bounds["floor-packs"] += fl.packs
        bounds["floor-frames"] += fl.frames
        bounds["exact"] &= fl.packs_exact


def _bound_runs(bounds: dict, none: _Acc, common: dict, per_batch_ms: float, base_tps: float) -> list:
    """The report rows of the bounds: what no placement of whole units beats on the same
    global batches, with the same bubble and step overhead; waiting, exchange and
    movement ``None``."""
    out = []
    ideal = none.ideal / none.batches
    for name in ("perfect", "floor-packs", "floor-frames"):
        ms = bounds[name] / none.batches + per_batch_ms
        tps = none.tokens / (ms * none.batches / 1000.0)
        out.append({**common, "strategy": name, "bound": True, "budget": None,
                    "time_per_batch_ms": ms, "wait_share": None,
                    "exchange_share": None, "slowdown": ms / ideal - 1.0, "tokens_per_s": tps,
                    "bytes_moved_per_step": None, "moved_fraction": None,
                    "throughput_rel": tps / base_tps,
                    "objective_over_perfect": bounds[name] / bounds["perfect"] if bounds["perfect"] else 1.0,
                    "exact": True if name == "perfect" else bounds["exact"] if name == "floor-packs"
                    else False})
    return out


def _images_run(a: _Acc, cfg: SimConfig, timing: TimingModel, pool: PackPool, ph: PackPhases,
                idx: np.ndarray, tok: np.ndarray, ov: float, planner: str = "images") -> None:
    """``redistribute-images`` / ``redistribute-frames`` on one chunk of batches
    (:mod:`.vision_balance`): packs placed on their language-phase cost, images (frames)
    balanced per micro-step by ``planner``."""
    nb, D, G = idx.shape
    ep = check_ep(cfg.ep, D)
    lang = np.rint(ph.lm * 1000.0).astype(np.int64)          # integer microseconds
    order = np.empty((nb, D, G), dtype=np.int64)
    for i in range(nb):
        t0 = time.perf_counter()
        order[i] = redistribute_order(lang[idx[i]], sync=cfg.sync, ranks_per_node=cfg.ranks_per_node,
                                      step_groups=step_group_labels(D, ep))
        a.solver_ms.append((time.perf_counter() - t0) * 1e3)
    placed = np.take_along_axis(idx.reshape(nb, -1), order.reshape(nb, -1), axis=1).reshape(nb, D, G)
    vf, img_out, img_in, stats = balanced_vision(pool, timing, placed, planner, ep=ep)
    for k, v in stats.items():
        a.vision[k] = a.vision.get(k, 0.0) + v
    lm = ph.lm[placed]
    vb = vf * timing.vision_bwd_fwd_ratio
    x, b_in = exchange_times(order, ph.nbytes[idx].reshape(nb, -1), link_gbps=timing.link_gbps,
                             latency_ms=timing.latency_ms)
    x = x + np.maximum(img_in, img_out) * timing.bytes_per_image_token / (timing.link_gbps * 1e6)
    # the frame plan of micro-step m runs on the exchange thread before its transfers
    x = x + cfg.frame_plan_ms
    a2a = all_to_all_ms(img_in, img_out, timing.bytes_per_embedding_token, timing, ep=ep)
    res = simulate_images_timeline(vf, lm, vb, x=x, a2a_fwd=a2a, a2a_bwd=a2a, sync=cfg.sync,
                                   bubble=ph.bubble, overhead=ov, ep=ep)
    inter = inter_node_mask(order, cfg.ranks_per_node)
    img_bytes = float(img_in.sum()) * timing.bytes_per_image_token
    a.add(res, tok, D, ov, b_in.sum() + img_bytes, int((b_in > 0).sum()),
          float(b_in[inter].sum()), int(inter.sum()))
    a.add_objective(vf + vb, lm, cfg.sync, ep)
    a.inter_group += _inter_group(order, ep)
