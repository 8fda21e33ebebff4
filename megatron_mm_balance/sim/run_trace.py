"""A training job's own per-pack timings as a simulator input: its layout and a timing model.

``--mm-balance-timing-dir DIR`` makes every rank write ``DIR/timing-rank<R>.jsonl`` (or one
file per node, :mod:`~megatron_mm_balance.cost.timing_files`), one record per micro-batch: the iteration, the micro-batch index, the pack's per-image
tokens and sample lengths, and the measured vision / language-model forward and
backward milliseconds (:mod:`megatron_mm_balance.megatron.timing`). This module reads
such a directory into :class:`RunTrace` (arrays ``[iterations, ranks, micro-steps]``
in the order the job computed them) and derives from it:

* :func:`measured_phases`: each micro-step's measured phases, the language-model phase
  taken from the rank that reached it last (under expert parallelism the others'
  language time includes waiting for it inside the all-to-alls),
  and the host-side gap before each micro-batch (data, loss) folded into the rank's
  pre-meeting work;
* :func:`predicted_times`: per iteration, what the measured packs would cost in the
  simulator's micro-step timeline (:func:`~.timeline.simulate_timeline`): as laid out,
  and perfectly balanced (every micro-step's maximum equal to its mean), plus the
  measured per-iteration tail (optimizer step, logging);
* :func:`objective_ms` and :func:`predicted_floors`: per iteration, the objective a placement
  decides (each micro-step's vision and language maxima) on the measured packs, as laid out
  or placed on any costs (image tokens, :func:`model_costs`, :func:`measured_costs`), and
  the floors of whole packs and of whole frames below it;
* :func:`fit_timing_model`: a :class:`~.timing.TimingModel` fitted from the timings
  (vision and language terms by the project's cost calibration, step overhead and
  per-micro-batch gaps measured), for ``mm-balance simulate DIR --timing run``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost.calibration import fit_phases
from ..cost.model import FeatureArrays, PackFeatures
from ..cost.timing_files import TimingFileError, read_timing_records
from .pool import PackPool
from .timeline import simulate_timeline
from .timing import TimingModel

#: Bytes a pack's tensors take per image token and per text token in the example's batches:
#: float32 pixels (3 x 14 x 14 per patch token) and int64 tokens + labels.
PIXEL_BYTES_PER_IMAGE_TOKEN = 3 * 14 * 14 * 4
BYTES_PER_TEXT_TOKEN = 16


class RunTraceError(ValueError):
    """A timing directory that cannot be read as a run's layout: one line for the user."""


@dataclass
class RunTrace:
    """A job's timed micro-batches in compute order: arrays ``[I, D, G]``."""

    iterations: list            # Megatron's iteration numbers, one per row
    ranks: list                 # the ranks, one per column (data-parallel order)
    records: list               # records[i][d][g]: the JSON record
    vf: np.ndarray
    vb: np.ndarray
    lf: np.ndarray
    lb: np.ndarray
    start: np.ndarray           # seconds on the rank's own clock
    end: np.ndarray

    @property
    def shape(self):
        return self.vf.shape

    def image_tokens(self) -> np.ndarray:
        return self._map(lambda r: sum(r["images"]))

    def _map(self, fn) -> np.ndarray:
        return np.array([[[fn(r) for r in row] for row in rank_rows] for rank_rows in self.records],
                        dtype=np.float64)


def read_records(directory: str) -> list:
    """Every record of ``directory``, per rank or per node files alike
    (:func:`~megatron_mm_balance.cost.timing_files.read_timing_records`); one-line errors."""
    try:
        return read_timing_records(directory)
    except TimingFileError as exc:
        raise RunTraceError(str(exc)) from None


def frames_view(rec: dict) -> dict:
    """A Qwen-VL record (its ``grids``) with ``images`` = the patches of every frame (``h*w``
    once per temporal patch): the units the tower attends within, so that a fitted
    ``tokens^2`` term is per frame, not per whole video. Records without grids unchanged."""
    grids = rec.get("grids")
    if not grids:
        return rec
    return dict(rec, images=[int(h) * int(w) for t, h, w in grids for _ in range(int(t))])


def load_run(directory: str, *, skip_iterations: int = 2, last_iteration: int | None = None,
             frames: bool = False) -> RunTrace:
    """The run's layout: iterations after the first ``skip_iterations`` (warm-up) in which
    every rank timed the same number of micro-batches; ranks in rank order. ``frames``:
    each record's images as its frames (:func:`frames_view`)."""
    recs = read_records(directory)
    if frames:
        recs = [frames_view(r) for r in recs]
    ranks = sorted({r["rank"] for r in recs})
    by = {}
    for r in recs:
        by.setdefault(r["iteration"], {}).setdefault(r["rank"], {})[r["microbatch"]] = r
    first = min(by) + skip_iterations
    its = [i for i in sorted(by) if i >= first and (last_iteration is None or i <= last_iteration)]
    full = []
    G = None
    for i in its:
        per = by[i]
        if set(per) != set(ranks):
            continue
        sizes = {len(per[d]) for d in ranks}
        if len(sizes) != 1 or any(sorted(per[d]) != list(range(len(per[d]))) for d in ranks):
            continue
        g = sizes.pop()
        if G is None:
            G = g
        if g == G:
            full.append(i)
    if not full:
        raise RunTraceError(f"{directory}: no complete iteration after the first {skip_iterations} "
                            f"(every rank with the same micro-batches)")
    rows = [[[by[i][d][m] for m in range(G)] for d in ranks] for i in full]

    def arr(key):
        return np.array([[[float(r.get(key, 0.0)) for r in rr] for rr in row] for row in rows])

    return RunTrace(full, ranks, rows, arr("vision_forward_ms"), arr("vision_backward_ms"),
                    arr("lm_forward_ms"), arr("lm_backward_ms"), arr("start_s"), arr("end_s"))


@dataclass
class MeasuredPhases:
    """Per micro-step phases for the timeline: ``vf`` (with the host gap before the
    micro-batch), ``lm`` (the language phase, the same on every rank), ``vb``; and the
    per-iteration tail (last micro-batch's end to the next iteration's first start)."""

    vf: np.ndarray
    lm: np.ndarray
    vb: np.ndarray
    gap: np.ndarray
    tail_ms: np.ndarray          # [I - 1]


def measured_phases(run: RunTrace) -> MeasuredPhases:
    I, D, G = run.shape
    gap = np.zeros_like(run.vf)
    gap[:, :, 1:] = np.maximum(run.start[:, :, 1:] - run.end[:, :, :-1], 0.0) * 1e3
    # The rank that reached the language model last waited least: its time is the compute
    # (the rule of cost.calibration.language_compute_records).
    arrival = run.vf + gap
    arrival[:, :, 1:] += run.vb[:, :, :-1]
    last = arrival.argmax(axis=1)[:, None, :]                        # [I, 1, G]
    lm = (np.take_along_axis(run.lf, last, 1) + np.take_along_axis(run.lb, last, 1))
    lm = np.broadcast_to(lm, run.vf.shape).copy()
    consecutive = [k for k in range(I - 1) if run.iterations[k + 1] == run.iterations[k] + 1]
    tail = np.array([(run.start[k + 1, :, 0].min() - run.end[k, :, -1].max()) * 1e3 for k in consecutive])
    return MeasuredPhases(run.vf + gap, lm, run.vb.copy(), gap, tail)


def placement_order(run: RunTrace, *, sync: str = "microstep", costs: np.ndarray | None = None) -> np.ndarray:
    """``[I, D, G]`` flat ``d * G + g`` indices: where the runtime's placement
    (:func:`~megatron_mm_balance.solver.placement.plan_placement`) puts each iteration's
    packs, on image-token costs or on ``costs`` (``[I, D, G]`` or ``[I, D, G, 2]`` integers,
    :func:`model_costs`). The balanced jobs computed exactly these layouts of the same
    global batches."""
    from ..solver.placement import plan_placement
    I, D, G = run.shape
    if costs is None:
        costs = run.image_tokens().astype(np.int64)
    elif costs.shape[:3] != (I, D, G):
        raise ValueError(f"costs of shape {costs.shape} for a run of shape {(I, D, G)}")
    order = np.empty((I, D, G), dtype=np.int64)
    for i in range(I):
        pl = plan_placement(costs[i], sync=sync)
        order[i] = pl.src_rank * G + pl.src_index
    return order


def model_costs(run: RunTrace, model, *, sync: str = "microstep") -> np.ndarray:
    """The integer costs ``mm_balance.cost=model`` balances the run's packs with, under
    :class:`~megatron_mm_balance.cost.model.CostModel` ``model``: ``[I, D, G, 2]`` (vision,
    language) under ``microstep`` sync, else ``[I, D, G]``. Needs Qwen-VL records (``grids``)."""
    from ..cost.features import QwenVLFeatures
    from ..cost.model import FeatureArrays
    I, D, G = run.shape
    features = QwenVLFeatures()
    kind = "two-phase" if sync == "microstep" else "time"
    packs = FeatureArrays.of([features.of_record(r) for row in run.records for per_rank in row for r in per_rank])
    costs = model.integer_costs(packs, kind)
    return costs.reshape((I, D, G, 2) if kind == "two-phase" else (I, D, G))


def objective_ms(run: RunTrace, order: np.ndarray | None = None, *, sync: str = "microstep") -> np.ndarray:
    """Per iteration (ms): the objective a placement decides, on the run's measured packs
    (:func:`measured_phases`; every micro-step at the iteration's mean language phase),
    laid out as the run computed them or by ``order`` (:func:`placement_order`), plus the
    measured tail: under ``microstep`` sync the sum over micro-steps of the vision maximum
    (a pack's forward, the gap before it and its backward) and the language maximum; under
    ``step`` the largest rank total. The floors of :func:`predicted_floors` bound it from
    below. (The timeline of :func:`predicted_times` pairs a pack's backward with the next
    micro-step's forward instead, as the job runs.)"""
    ph = measured_phases(run)
    tail = float(np.median(ph.tail_ms)) if len(ph.tail_ms) else 0.0
    vision = ph.vf + ph.vb
    if order is not None:
        vision = _permute(vision, order)
    language = np.broadcast_to(ph.lm.mean(axis=(1, 2), keepdims=True), ph.lm.shape)
    if sync == "microstep":
        return vision.max(axis=1).sum(axis=1) + language.max(axis=1).sum(axis=1) + tail
    return (vision + language).sum(axis=2).max(axis=1) + tail


def measured_costs(run: RunTrace) -> np.ndarray:
    """``[I, D, G, 2]`` integer microseconds: each pack's measured vision (forward, the gap
    before it, backward) and the iteration's mean language phase, as costs for
    :func:`placement_order`: the placement a cost estimate that knew every pack's time
    would give."""
    ph = measured_phases(run)
    vision = np.rint((ph.vf + ph.vb) * 1000.0).astype(np.int64)
    language = np.rint(np.broadcast_to(ph.lm.mean(axis=(1, 2), keepdims=True), ph.lm.shape) * 1000.0)
    return np.stack([vision, language.astype(np.int64)], axis=-1)


def frame_ms_of(model) -> "callable":
    """``p -> ms``: a frame's vision forward under a cost model's per-patch, per-patch-squared
    and per-unit terms (the relative weight of frames within a pack; its per-pack and
    per-image terms do not split between frames)."""
    a, b, c = model.vision_ms_per_token_sq, model.vision_ms_per_token, model.vision_ms_per_unit
    return lambda p: a * p * p + b * p + c


def _heaviest_frame_ms(run: RunTrace, vision: np.ndarray, frame_ms) -> np.ndarray:
    """``[I, D, G]``: each pack's heaviest frame, its share of the pack's measured vision by
    ``frame_ms`` over its frames (the records' grids); a pack without grids is one frame."""
    from ..solver.cp_split import frame_patches
    I, D, G = run.shape
    heaviest = vision.copy()
    for i in range(I):
        for d in range(D):
            for g in range(G):
                costs = [frame_ms(p) for p in frame_patches(run.records[i][d][g].get("grids") or [])]
                if len(costs) > 1 and sum(costs) > 0:
                    heaviest[i, d, g] = vision[i, d, g] * max(costs) / sum(costs)
    return heaviest


def heaviest_frame_costs(run: RunTrace, frame_ms) -> np.ndarray:
    """``[I, D, G]`` integer microseconds: each pack's heaviest frame (measured vision shared
    by ``frame_ms``), the costs ``mm_balance.vision=images`` places packs on by default."""
    ph = measured_phases(run)
    return np.rint(_heaviest_frame_ms(run, ph.vf + ph.vb, frame_ms) * 1000.0).astype(np.int64)


def frames_objective_ms(run: RunTrace, frame_ms, order: np.ndarray | None = None) -> np.ndarray:
    """Per iteration (ms): the least the objective of :func:`objective_ms` can be once the
    frames of every micro-step are spread across the ranks (``mm_balance.vision=images``),
    with the packs as laid out or placed by ``order``: each micro-step's vision at its mean
    or its heaviest frame, whichever is more, plus its language maximum and the tail."""
    ph = measured_phases(run)
    D = run.shape[1]
    tail = float(np.median(ph.tail_ms)) if len(ph.tail_ms) else 0.0
    vision = ph.vf + ph.vb
    heaviest = _heaviest_frame_ms(run, vision, frame_ms)
    if order is not None:
        vision, heaviest = _permute(vision, order), _permute(heaviest, order)
    language = np.broadcast_to(ph.lm.mean(axis=(1, 2), keepdims=True), ph.lm.shape)
    step_vision = np.maximum(vision.sum(axis=1) / D, heaviest.max(axis=1))
    return step_vision.sum(axis=1) + language.max(axis=1).sum(axis=1) + tail


def predicted_floors(run: RunTrace, frame_ms, *, sync: str = "microstep") -> dict:
    """Per iteration (ms), on the run's measured packs (:func:`measured_phases`, every
    micro-step at the iteration's mean language phase, as :func:`predicted_times` lays out a
    placement): perfect balance and what no placement of whole packs, or of whole frames,
    beats (:func:`~megatron_mm_balance.solver.floors.batch_floors`), each with the measured
    tail. A pack's heaviest frame takes its share of the pack's measured vision by
    ``frame_ms`` (``p -> ms``, :func:`frame_ms_of`) over its frames (the records' grids, a
    video's temporal patches apart); a pack without grids is one frame.
    ``packs_exact``: whether every iteration's packs floor is the exact optimum."""
    from ..solver.floors import batch_floors
    ph = measured_phases(run)
    I, D, G = run.shape
    tail = float(np.median(ph.tail_ms)) if len(ph.tail_ms) else 0.0
    out = {"perfect_ms": np.empty(I), "floor_packs_ms": np.empty(I), "floor_frames_ms": np.empty(I),
           "packs_exact": True}
    heaviest_all = _heaviest_frame_ms(run, ph.vf + ph.vb, frame_ms)
    for i in range(I):
        vision = (ph.vf[i] + ph.vb[i]).ravel()
        language = np.full(D * G, ph.lm[i].mean())
        heaviest = heaviest_all[i].ravel()
        fl = batch_floors(vision, language, heaviest, D, sync=sync)
        out["perfect_ms"][i], out["floor_packs_ms"][i], out["floor_frames_ms"][i] = (
            fl.perfect + tail, fl.packs + tail, fl.frames + tail)
        out["packs_exact"] &= fl.packs_exact
    return out


def _permute(a: np.ndarray, order: np.ndarray) -> np.ndarray:
    I = a.shape[0]
    return np.take_along_axis(a.reshape(I, -1), order.reshape(I, -1), axis=1).reshape(a.shape)


def predicted_times(run: RunTrace, *, sync: str = "microstep", order: np.ndarray | None = None) -> dict:
    """Per iteration (ms): the measured packs as laid out in the timeline, perfectly
    balanced (each micro-step's maximum = its mean), both with the median measured tail.

    ``order`` (:func:`placement_order`): lay the same measured packs out as that placement
    does first; each pack keeps its vision times (and the host gap before it), and every
    micro-step gets the iteration's mean language phase (the language work of a pack of
    the fixed length hardly differs; what was measured per micro-step is mostly its
    noise, which a maximum over re-paired micro-steps would inflate)."""
    ph = measured_phases(run)
    tail = float(np.median(ph.tail_ms)) if len(ph.tail_ms) else 0.0
    if order is not None:
        vf, vb = _permute(ph.vf, order), _permute(ph.vb, order)
        lm = np.broadcast_to(ph.lm.mean(axis=(1, 2), keepdims=True), ph.lm.shape).copy()
        ph = MeasuredPhases(vf, lm, vb, ph.gap, ph.tail_ms)
    laid_out = simulate_timeline(ph.vf, ph.lm, ph.vb, sync=sync)["time"] + tail
    if sync == "microstep":
        perfect = ((ph.vf + ph.vb).mean(axis=1) + ph.lm.mean(axis=1)).sum(axis=1) + tail
    else:
        perfect = (ph.vf + ph.lm + ph.vb).sum(axis=2).mean(axis=1) + tail
    span = (run.end[:, :, -1].max(axis=1) - run.start[:, :, 0].min(axis=1)) * 1e3 + tail
    return {"laid_out_ms": laid_out, "perfect_ms": perfect, "measured_span_ms": span,
            "tail_ms": tail, "gap_ms_per_microbatch": float(ph.gap[:, :, 1:].mean()) if ph.gap.shape[2] > 1 else 0.0}


def vision_share(run: RunTrace) -> float:
    """The vision encoder's share of a micro-batch's compute at the mean pack: mean vision
    (forward + backward) over mean vision + the mean language-model compute phase."""
    ph = measured_phases(run)
    vision = float((run.vf + run.vb).mean())
    return vision / (vision + float(ph.lm.mean()))


def fit_timing_model(run: RunTrace, *, seq_len: int | None = None, exchange_latency_ms: float = 0.0,
                     sync_batch_ms: float = 0.0, name: str = "run") -> tuple[TimingModel, dict]:
    """A timing model fitted from the run's own timings; returns it and the fit's report.

    Vision and language terms come from :func:`~megatron_mm_balance.cost.calibration.fit_phases`
    (the per-pack model, ``fit+pack`` among ``--mm-balance-cost auto``'s candidates); the
    language phase is charged per pack as the fitted compute at the run's mean positions plus the measured host gap
    before each micro-batch (``compute_padding``: the same for every pack); the step
    overhead is the measured median tail of an iteration; the spread of the measured
    vision and language times around the fit becomes the model's ``noise_cv``. Exchange:
    the example's bytes per token, ``exchange_latency_ms`` per micro-step with traffic and
    ``sync_batch_ms`` per batch of a synchronous exchange (measure them on a ``sync`` run)."""
    flat = [r for row in run.records for rr in row for r in rr]
    fit = fit_phases(flat, min_records=1, r2_floor=-np.inf)
    if fit.model is None:
        raise RunTraceError(f"cannot fit a timing model from this run: {fit.reason}")
    m = fit.model
    ph = measured_phases(run)
    tokens = np.array([sum(r["lengths"]) for r in flat], dtype=np.float64)
    L = float(seq_len or round(tokens.mean()))
    lm_fwd = m.llm_ms_per_token * float(tokens.mean()) + m.const_ms
    gap = float(ph.gap[:, :, 1:].mean()) if ph.gap.shape[2] > 1 else 0.0
    # forward per position such that the language phase = compute (1 + ratio) + gap
    per_token = (lm_fwd + gap / (1.0 + m.llm_backward_ratio)) / L
    tail = float(np.median(ph.tail_ms)) if len(ph.tail_ms) else 0.0
    # the measured spread around the fit: what no placement on the features can balance
    feats = FeatureArrays.of([PackFeatures(tuple(r["images"]), tuple(r["lengths"])) for r in flat])
    fitted = m.phase_ms(feats).vision_forward
    seen = np.array([r["vision_forward_ms"] for r in flat])
    has = fitted > 0
    v_cv = float(np.std(seen[has] - fitted[has]) / np.mean(fitted[has])) if has.any() else 0.0
    lm_cv = float(np.std(ph.lm[:, 0, :]) / np.mean(ph.lm[:, 0, :])) if ph.lm.size else 0.0
    t = TimingModel(name=name, vision_ms_per_token=m.vision_ms_per_token,
                    vision_ms_per_token_sq=m.vision_ms_per_token_sq,
                    vision_ms_per_pack=m.vision_ms_per_pack,
                    vision_bwd_fwd_ratio=m.vision_backward_ratio,
                    llm_ms_per_token=per_token, llm_ms_per_token_sq=m.llm_ms_per_len_sq,
                    llm_bwd_fwd_ratio=m.llm_backward_ratio, llm_compute_padding=True,
                    step_overhead_ms=tail, bytes_per_image_token=PIXEL_BYTES_PER_IMAGE_TOKEN,
                    bytes_per_text_token=BYTES_PER_TEXT_TOKEN, link_gbps=10.0,
                    latency_ms=float(exchange_latency_ms), sync_batch_ms=float(sync_batch_ms),
                    vision_noise_cv=v_cv, llm_noise_cv=lm_cv)
    report = {"r2_vision": fit.r2_vision, "r2_language": fit.r2_language, "records": fit.records,
              "seq_len": L, "gap_ms": gap, "tail_ms": tail, "vision_noise_cv": v_cv, "llm_noise_cv": lm_cv}
    return t, report


def timing_file(t: TimingModel) -> dict:
    """``t`` in the simulator's timing-file format (``--timing FILE``; explicit coefficients)."""
    return {
        "name": t.name,
        "vision": {"ms_per_token": t.vision_ms_per_token, "ms_per_token_sq": t.vision_ms_per_token_sq,
                   "ms_per_pack": t.vision_ms_per_pack, "bwd_fwd_ratio": t.vision_bwd_fwd_ratio,
                   "noise_cv": t.vision_noise_cv},
        "llm": {"ms_per_token": t.llm_ms_per_token, "ms_per_token_sq": t.llm_ms_per_token_sq,
                "bwd_fwd_ratio": t.llm_bwd_fwd_ratio, "compute_padding": t.llm_compute_padding,
                "noise_cv": t.llm_noise_cv},
        "step": {"overhead_ms": t.step_overhead_ms},
        "exchange": {"bytes_per_image_token": t.bytes_per_image_token,
                     "bytes_per_text_token": t.bytes_per_text_token, "link_gbps": t.link_gbps,
                     "latency_ms": t.latency_ms, "sync_batch_ms": t.sync_batch_ms},
    }


def run_pool(run: RunTrace, seq_len: int | None = None) -> tuple[PackPool, np.ndarray]:
    """The run's packs as a simulator pool, in layout order, and their indices ``[I, D, G]``
    (pack ``(i, d, g)`` is pool entry ``(i * D + d) * G + g``)."""
    flat = [r for row in run.records for rr in row for r in rr]
    n_img = np.array([len(r["images"]) for r in flat], dtype=np.int64)
    n_smp = np.array([len(r["lengths"]) for r in flat], dtype=np.int64)
    img = np.array([n for r in flat for n in r["images"]], dtype=np.int64)
    lens = np.array([n for r in flat for n in r["lengths"]], dtype=np.int64)
    img_off = np.concatenate([[0], np.cumsum(n_img)])
    smp_off = np.concatenate([[0], np.cumsum(n_smp)])

    def seg(values, off):
        c = np.concatenate([[0], np.cumsum(values)])
        return (c[off[1:]] - c[off[:-1]]).astype(np.int64)

    tokens = seg(lens, smp_off)
    L = int(seq_len or max(1, int(tokens.max())))
    pool = PackPool(seq_len=L, budget=None, efficiency=float(tokens.sum() / (len(flat) * L)),
                    samples=int(n_smp.sum()), dropped=0, tokens=tokens,
                    image_tokens=seg(img, img_off), image_sq=seg(img * img, img_off),
                    num_images=n_img, sample_len_sq=seg(lens * lens, smp_off),
                    image_offsets=img_off, image_sizes=img, sample_offsets=smp_off,
                    sample_lengths=lens)
    return pool, np.arange(len(flat), dtype=np.int64).reshape(run.shape)


#: The strategies a run's layout is simulated with (budget packing would re-pack the data).
LAYOUT_STRATEGIES = ("none", "local", "redistribute-sync", "redistribute-overlap")


def simulate_layout(run: RunTrace, timing: TimingModel, *, sync: str = "microstep",
                    balance_cost: str = "image-tokens", strategies=LAYOUT_STRATEGIES,
                    prefetch: bool = True, seq_len: int | None = None,
                    ranks_per_node: int | None = None) -> list:
    """The simulator's runs on the job's own global batches, as the job laid them out:
    ``none`` is the unbalanced job, ``redistribute-*`` the placement the runtime computes
    from the same costs (``prefetch``: the runtime's cross-batch prefetch, which a fixed
    micro-batch count allows)."""
    from .engine import SimConfig, simulate_dp
    I, D, G = run.shape
    pool, idx = run_pool(run, seq_len)
    cfg = SimConfig(dps=[D], ga=G, seq_len=pool.seq_len, sync=sync, batches=I,
                    strategies=tuple(strategies), balance_cost=balance_cost,
                    ranks_per_node=ranks_per_node, prefetch=prefetch, floors=False)
    runs, _ = simulate_dp(cfg, D, timing, pool, {}, indices=idx)
    return runs


def time_breakdown(run: RunTrace) -> dict:
    """Where an iteration's time goes, per rank and iteration (ms): the vision encoder's
    compute (and per 1,000 image tokens), the language-model compute phase (from the rank
    that reached it last), waiting for the other ranks inside the language model (a rank's
    measured language forward minus that compute), the host gaps between micro-batches, and
    the per-iteration tail."""
    ph = measured_phases(run)
    I, D, G = run.shape
    tokens = run.image_tokens()
    vision = run.vf + run.vb
    lm_compute = ph.lm[:, 0, :]                                   # [I, G]
    wait = np.maximum(run.lf + run.lb - ph.lm, 0.0)
    out = {
        "vision_ms": float(vision.sum(axis=2).mean()),
        "vision_ms_per_1k_image_tokens": float(1000.0 * vision.sum() / max(tokens.sum(), 1.0)),
        "lm_compute_ms": float(lm_compute.sum(axis=1).mean()),
        "waiting_ms": float(wait.sum(axis=2).mean()),
        "host_gap_ms": float(ph.gap.sum(axis=2).mean()),
        "tail_ms": float(np.median(ph.tail_ms)) if len(ph.tail_ms) else 0.0,
    }
    out.update(vision_exchange_split(run))
    return out


#: the image-level exchange's split of the vision forward (the records' ``details``)
EXCHANGE_DETAILS = ("vision_gather_ms", "vision_plan_ms", "vision_tower_ms", "vision_exchange_ms",
                    "vision_tower_calls")


def vision_exchange_split(run: RunTrace) -> dict:
    """Where the image-level exchange's vision forward goes, per iteration and rank (ms; the
    records' ``details``, written by ``mm_balance.vision=images`` with the timing hooks):
    the all-gathers (waiting for the group's last rank included), the planning, the tower's
    calls, and the rest of the exchange (transfers, waits and copies); with the tower calls
    per micro-batch. Empty for runs without those details."""
    if not any("details" in r for iteration in run.records for per_rank in iteration for r in per_rank):
        return {}
    d = {k: run._map(lambda r, k=k: float(r.get("details", {}).get(k, 0.0))) for k in EXCHANGE_DETAILS}
    per = lambda a: float(a.sum(axis=2).mean())  # noqa: E731 - per iteration and rank
    rest = d["vision_exchange_ms"] - d["vision_gather_ms"] - d["vision_plan_ms"] - d["vision_tower_ms"]
    return {"exchange_gather_ms": per(d["vision_gather_ms"]), "exchange_plan_ms": per(d["vision_plan_ms"]),
            "exchange_tower_ms": per(d["vision_tower_ms"]), "exchange_rest_ms": per(np.maximum(rest, 0.0)),
            "exchange_ms": per(d["vision_exchange_ms"]),
            "tower_calls_per_microbatch": float(d["vision_tower_calls"].mean())}
