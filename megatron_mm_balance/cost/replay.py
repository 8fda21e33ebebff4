"""Judge cost models by replay: the placement each candidate cost would have made of a run's
recorded global batches, scored on the packs' own measured times.

A training job's timing records (:mod:`megatron_mm_balance.megatron.timing`, one per
micro-batch per rank) are grouped into global batches (iteration x rank x micro-step,
:func:`global_batches`); each pack keeps its measured vision time (forward + backward)
and language time (forward + backward; under micro-step synchronisation the
language compute of its micro-step, read from the rank that reached the language model
last, :func:`~.timing_records.language_compute_records`, since the others' language time
includes waiting for it). The iterations are split into a fit part and held-out
iterations (:func:`split_iterations`); every candidate (:data:`CANDIDATES`) is built
from the fit part only, and on every held-out global batch the real planner
(:func:`~megatron_mm_balance.solver.placement.plan_placement` with the options the
runtime's ``plan_batch`` gives it: the run's sync mode, tolerance and nodes) places the packs by that candidate's integer costs; the measured times then
say how even the placement was:

* **micro-step max/mean**: per micro-step, the slowest rank's measured time over the
  mean over ranks, averaged over the held-out micro-steps (what expert-parallel
  training waits for);
* **rank-total max/mean**: per global batch, the heaviest rank's total over the mean
  rank total, averaged over the held-out batches (what step-synchronised training
  waits for).

Beside the candidates: ``unbalanced`` (the batches as recorded) and ``perfect`` (the
planner given the held-out packs' own measured times: what no estimate can beat).

The choice (:func:`choose`): the candidate with the lowest held-out figure of the sync
mode (micro-step under ``microstep``, rank total under ``step``); image tokens stay
unless that candidate is lower by at least ``margin`` (:data:`DEFAULT_MARGIN`,
absolute). Everything is deterministic: the same records give the same table and
choice on every rank and every run.

What a record is to a cost model comes from the features object of the options
(:mod:`.features`, the extension point :class:`~.calibration.AutoCost` takes too):
:class:`~.features.TileFeatures` on the Megatron-LM path (a record's per-image tokens),
:class:`~.features.QwenVLFeatures` on Megatron-Bridge's Qwen-VL models (one unit per frame
of the record's ``grids``). Its ``candidates`` are the ones replayed by default.

Candidates are a registry: :func:`register_candidate` adds one (a name, a line saying
what it is, and a builder from the fit part's batches to a :class:`PricedCost` or a
:class:`CandidateRefused`), which both ``mm-balance replay`` and ``--mm-balance-cost
auto`` then consider (a features object lists it). Only candidates with a
:class:`~.model.CostModel` (or image tokens) can be chosen by ``auto``, which saves the
model beside the checkpoint.

Imports no torch and nothing of a training framework.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .timing_records import MIN_RECORDS, R2_FLOOR, language_compute_records
from ..solver.placement import DEFAULT_BALANCE_TOLERANCE, Placement, SolverOptions, plan_placement
from .features import IMAGE_TOKENS, TileFeatures
from .model import CostModel, FeatureArrays, PackFeatures, nonnegative_lstsq

#: Share of the complete iterations held out for scoring (the last ones).
DEFAULT_HOLDOUT = 0.5
#: How much lower (absolute, in max/mean) a candidate's held-out figure must be than
#: image tokens' to replace them: about the spread of repeated replays of one job's
#: timings between its fit and held-out halves; below it a "better" model is noise.
DEFAULT_MARGIN = 0.005
REPLAY_FORMAT = "mm-balance-replay/v1"
#: The FLOP-derived cost model a run writes beside its timing records (Megatron-Bridge's
#: Qwen-VL glue: what ``cost=model`` balances with); ``mm-balance replay`` replays it as ``flops``.
FLOPS_MODEL_FILE = "flops_cost_model.json"
#: Record fields the replay needs (the timing hooks' record format), besides the features'
#: own (``features.needed``: ``images`` and ``lengths`` of tiles, ``grids`` of Qwen-VL).
NEEDED = ("iteration", "microbatch", "rank", "vision_forward_ms", "vision_backward_ms", "lm_forward_ms",
          "lm_backward_ms")


class ReplayError(ValueError):
    """Records that cannot be replayed: one line for the user."""


class CandidateRefused(Exception):
    """A candidate that cannot be built from these records; the message says why."""


# -- global batches ----------------------------------------------------------------------

@dataclass(frozen=True)
class ReplayBatch:
    """One recorded global batch: ``[D, G]`` packs (rank-major, in the run's rank order)
    with their features and measured milliseconds."""

    iteration: int
    features: Tuple[PackFeatures, ...]     # D * G, row-major (rank r's micro-step m at r*G + m)
    vision_ms: np.ndarray                  # [D, G] forward + backward
    language_ms: np.ndarray                # [D, G] forward + backward (compute)
    records: Tuple[dict, ...]              # D * G, the same order (for the fits)
    #: every pack's language features alike (all padded to one length): the language time's
    #: variation is the machine's, not the packs', and it stays with the slot it was measured in
    language_per_slot: bool = False

    @property
    def shape(self) -> Tuple[int, int]:
        return self.vision_ms.shape

    @property
    def time_ms(self) -> np.ndarray:
        return self.vision_ms + self.language_ms

    def placed_ms(self, placement: Placement) -> np.ndarray:
        """``[D, G]`` measured milliseconds of each slot after ``placement``: the packs' vision
        times move with them; their language times too, unless :attr:`language_per_slot`."""
        language = self.language_ms if self.language_per_slot else placement.apply(self.language_ms)
        return placement.apply(self.vision_ms) + language

    def arrays(self) -> FeatureArrays:
        return FeatureArrays.of(list(self.features))


def _check(rec, i, features) -> None:
    if not isinstance(rec, dict):
        raise ReplayError(f"timing record {i}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in NEEDED + tuple(features.needed) if k not in rec]
    if missing:
        raise ReplayError(f"timing record {i} (rank {rec.get('rank')}, iteration {rec.get('iteration')}): "
                          f"missing {missing}")


def global_batches(records: Sequence[dict], *, sync: str = "microstep", skip_iterations: int = 0,
                   features=None) -> Tuple[List[ReplayBatch], List[int]]:
    """The complete global batches of ``records`` (every rank with micro-batches
    ``0..G-1``, the same ``G``), after the first ``skip_iterations`` iterations; and the
    iterations left out as incomplete. ``sync``: where the language time comes from
    (``microstep``: the micro-step's last-arriving rank; ``step``: the pack's own).
    ``features``: what a record is to the cost model (default :class:`~.features.TileFeatures`)."""
    features = TileFeatures() if features is None else features
    for i, r in enumerate(records):
        _check(r, i, features)
    if not records:
        raise ReplayError("no timing records")
    ranks = sorted({int(r["rank"]) for r in records})
    by: Dict[int, Dict[int, Dict[int, dict]]] = {}
    for r in records:
        by.setdefault(int(r["iteration"]), {}).setdefault(int(r["rank"]), {})[int(r["microbatch"])] = r
    its = sorted(by)[skip_iterations:]
    complete, incomplete, G = [], [], None
    for it in its:
        per = by[it]
        sizes = {len(per.get(d, {})) for d in ranks}
        ok = (set(per) == set(ranks) and len(sizes) == 1
              and all(sorted(per[d]) == list(range(len(per[d]))) for d in ranks))
        if ok and G is None:
            G = sizes.pop()
        elif ok:
            ok = sizes.pop() == G
        (complete if ok else incomplete).append(it)
    batches = []
    for it in complete:
        rows = [[by[it][d][m] for m in range(G)] for d in ranks]
        flat = [r for row in rows for r in row]
        vision = np.array([[float(r["vision_forward_ms"]) + float(r["vision_backward_ms"]) for r in row]
                           for row in rows])
        if sync == "microstep":
            last = {rec["microbatch"]: rec for rec in language_compute_records(flat)}
            lang = np.array([[float(last[m]["lm_forward_ms"]) + float(last[m]["lm_backward_ms"])
                              for m in range(G)] for _ in ranks])
        else:
            lang = np.array([[float(r["lm_forward_ms"]) + float(r["lm_backward_ms"]) for r in row]
                             for row in rows])
        feats = tuple(_of_record(features, r) for r in flat)
        alike = len({(f.tokens, tuple(sorted(f.lengths))) for f in feats}) == 1
        batches.append(ReplayBatch(it, feats, vision, lang, tuple(flat), language_per_slot=alike))
    return batches, incomplete


def _of_record(features, record: dict) -> PackFeatures:
    try:
        return features.of_record(record)
    except (ValueError, TypeError) as exc:
        raise ReplayError(f"timing record of iteration {record.get('iteration')}, rank {record.get('rank')}, "
                          f"micro-batch {record.get('microbatch')}: {exc}") from None


def split_iterations(batches: Sequence[ReplayBatch], holdout: float = DEFAULT_HOLDOUT
                     ) -> Tuple[List[ReplayBatch], List[ReplayBatch]]:
    """(fit, held out): the last ``ceil(holdout * n)`` batches are held out; at least one
    of each. Fewer than 2 batches cannot be split."""
    if not 0 < holdout < 1:
        raise ReplayError(f"the held-out share must be in (0, 1), got {holdout!r}")
    n = len(batches)
    if n < 2:
        raise ReplayError(f"{n} complete iteration(s): the replay needs at least 2 (one to fit, "
                          f"one held out)")
    held = min(n - 1, max(1, math.ceil(holdout * n)))
    return list(batches[: n - held]), list(batches[n - held:])


# -- candidates --------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplayOptions:
    """The run's balancing settings (the planner's) and the replay's own."""

    sync: str = "microstep"
    balance_tolerance: Optional[float] = None
    ranks_per_node: Optional[int] = None
    holdout: float = DEFAULT_HOLDOUT
    margin: float = DEFAULT_MARGIN
    min_records: int = MIN_RECORDS
    r2_floor: float = R2_FLOOR
    #: the vision encoder's (layers, hidden, heads, ffn), for the tiles' ``vit-flops`` candidate
    vision_shape: Optional[Tuple[int, int, int, int]] = None
    #: global ranks of the D data-parallel ranks (nodes for ``ranks_per_node``)
    ranks: Optional[Tuple[int, ...]] = None
    #: what a record is to the cost model (:mod:`.features`; None: :class:`~.features.TileFeatures`);
    #: a Qwen-VL features object carries the tower's FLOP-derived model for ``flops``
    features: Any = None

    @property
    def kind(self) -> str:
        """The integer cost kind the run balances with: two phases under ``microstep``."""
        return "two-phase" if self.sync == "microstep" else "time"

    @property
    def feature_reader(self):
        """The features object (the default: tiles)."""
        return TileFeatures() if self.features is None else self.features


@dataclass(frozen=True)
class PricedCost:
    """A built candidate: integer costs of any batch's packs. ``model``: the cost model
    (None: image tokens); ``detail``: coefficients and fit quality, for the table."""

    model: Optional[CostModel]
    detail: str = ""
    r2_vision: float = float("nan")
    r2_language: float = float("nan")
    #: False: scored and shown, never chosen (a model the measured times do not support)
    selectable: bool = True

    def costs(self, batch: ReplayBatch, kind: str) -> np.ndarray:
        """``[D, G]`` (``time``) or ``[D, G, 2]`` (``two-phase``) integer costs."""
        D, G = batch.shape
        f = batch.arrays()
        if self.model is None:
            tokens = f.image_tokens.astype(np.int64)
            c = np.stack([tokens, np.zeros_like(tokens)], axis=1) if kind == "two-phase" else tokens
        else:
            c = self.model.integer_costs(f, kind)
        return c.reshape((D, G, 2) if kind == "two-phase" else (D, G))


@dataclass(frozen=True)
class Candidate:
    """One cost to replay: ``build(fit_batches, options)`` returns a :class:`PricedCost`
    or raises :class:`CandidateRefused`."""

    name: str
    summary: str
    build: Callable[[Sequence[ReplayBatch], ReplayOptions], PricedCost]


#: Every candidate, in the order the table lists them (and ties are broken).
CANDIDATES: Dict[str, Candidate] = {}


def register_candidate(candidate: Candidate) -> Candidate:
    """Add a candidate to :data:`CANDIDATES` (the extension point: a new cost model is
    one call here and its name in a features object's ``candidates``; both the replay and
    ``--mm-balance-cost auto`` then consider it)."""
    if candidate.name in CANDIDATES or candidate.name in ("unbalanced", "perfect"):
        raise ValueError(f"replay candidate {candidate.name!r} is already registered")
    CANDIDATES[candidate.name] = candidate
    return candidate


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss = float(((y - y.mean()) ** 2).sum())
    return float("nan") if ss <= 0 else 1.0 - float(((y - pred) ** 2).sum()) / ss


#: Vision-forward terms a fit may use: the column of each over many packs (a unit is an
#: image of a tiled encoder, a frame of a Qwen-VL grid).
VISION_TERMS = {
    "token": lambda f: f.image_tokens,
    "token_sq": lambda f: f.image_sq,
    "pack": lambda f: f.has_images.astype(np.float64),
    "image": lambda f: f.num_images,
    "unit": lambda f: f.units,
}
_TERM_FIELD = {"token": "vision_ms_per_token", "token_sq": "vision_ms_per_token_sq",
               "pack": "vision_ms_per_pack", "image": "vision_ms_per_image", "unit": "vision_ms_per_unit"}


def _fit_records(batches: Sequence[ReplayBatch]) -> List[dict]:
    return [r for b in batches for r in b.records]


def _features_of(records: Sequence[dict], of_record) -> FeatureArrays:
    return FeatureArrays.of([of_record(r) for r in records])


def fit_vision(records: Sequence[dict], terms: Sequence[str], *, of_record=TileFeatures.of_record,
               min_records: int = MIN_RECORDS, r2_floor: float = R2_FLOOR) -> Tuple[dict, float, float]:
    """Non-negative least squares of ``vision_forward_ms`` on ``terms``
    (:data:`VISION_TERMS` of each record's features, ``of_record``): ``(CostModel fields,
    backward ratio, R^2)``. Refused (the reason) with fewer than ``min_records`` records
    with images, no variation in vision time, or an R^2 below ``r2_floor``."""
    f = _features_of(records, of_record)
    with_images = int(f.has_images.sum())
    if with_images < min_records:
        raise CandidateRefused(f"{with_images} records with images, fewer than {min_records}")
    X = np.stack([VISION_TERMS[t](f) for t in terms], axis=1)
    y = np.array([float(r["vision_forward_ms"]) for r in records])
    coef = nonnegative_lstsq(X, y)
    r2 = _r2(y, X @ coef)
    if math.isnan(r2):
        raise CandidateRefused("no variation in vision time")
    if r2 < r2_floor:
        raise CandidateRefused(f"vision R^2 {r2:.3f} below the floor {r2_floor}")
    vb = sum(float(r["vision_backward_ms"]) for r in records)
    ratio = vb / float(y.sum()) if y.sum() > 0 else 2.0
    return {_TERM_FIELD[t]: float(c) for t, c in zip(terms, coef)}, float(ratio), r2


def fit_language(records: Sequence[dict], *, of_record=TileFeatures.of_record,
                 r2_floor: float = R2_FLOOR) -> Tuple[dict, float, str]:
    """The language phase from each micro-step's compute
    (:func:`~.timing_records.language_compute_records`): ``t*positions + c*sum(len^2) +
    const`` where those features vary and explain the time (R^2 at least ``r2_floor``);
    otherwise only the mean is taken. Fixed-length packs of one sample have constant
    features (a fit of them has no meaning: the R^2 is then NaN); a fit below the floor
    would give each pack a language cost that is noise, and the two-phase planner would
    balance that noise. Returns (CostModel fields, R^2, a note)."""
    lang = language_compute_records(records)
    if not lang:
        return {"llm_backward_ratio": 2.0}, float("nan"), "no language records"
    f = _features_of(lang, of_record)
    y = np.array([float(r["lm_forward_ms"]) for r in lang])
    yb = sum(float(r["lm_backward_ms"]) for r in lang)
    ratio = float(yb / y.sum()) if y.sum() > 0 else 2.0
    mean_only = {"const_ms": float(max(y.mean(), 0.0)), "llm_backward_ratio": ratio}
    varying = [(name, col) for name, col in (("llm_ms_per_token", f.positions),
                                             ("llm_ms_per_len_sq", f.len_sq)) if np.ptp(col) > 0]
    if not varying:
        return mean_only, float("nan"), "language: constant lengths, mean only"
    X = np.stack([col for _, col in varying] + [np.ones(len(lang))], axis=1)
    coef = nonnegative_lstsq(X, y)
    r2 = _r2(y, X @ coef)
    if not r2 >= r2_floor:
        return mean_only, r2, f"language R^2 {r2:.3f} below the floor {r2_floor}: mean only"
    out = {name: float(c) for (name, _), c in zip(varying, coef)}
    out.update(const_ms=float(coef[-1]), llm_backward_ratio=ratio)
    return out, r2, f"language R^2 {r2:.3f}"


def fitted_candidate(terms: Sequence[str]) -> Callable:
    """The builder of a fitted two-phase model with these vision terms."""
    def build(batches: Sequence[ReplayBatch], options: ReplayOptions) -> PricedCost:
        recs = _fit_records(batches)
        of_record = options.feature_reader.of_record
        vision, ratio, r2v = fit_vision(recs, terms, of_record=of_record, min_records=options.min_records,
                                        r2_floor=options.r2_floor)
        lang, r2l, note = fit_language(recs, of_record=of_record, r2_floor=options.r2_floor)
        model = CostModel(**{**{f: 0.0 for f in _TERM_FIELD.values()}, **vision},
                          vision_backward_ratio=ratio, **lang)
        coef = ", ".join(f"{t} {vision[_TERM_FIELD[t]]:.4g}" for t in terms)
        return PricedCost(model, f"vision R^2 {r2v:.3f} ({coef} ms); {note}", r2v, r2l)
    return build


def vit_flops_per_image(shape: Tuple[int, int, int, int]) -> Tuple[float, float]:
    """Forward FLOPs of a ViT body per image token and per squared image token:
    ``layers * (2*h*(4h + 2*ffn))`` (QKV, projection, MLP) and ``layers * 4h`` (the two
    attention matmuls)."""
    layers, hidden, _heads, ffn = shape
    return float(layers * 2 * hidden * (4 * hidden + 2 * ffn)), float(layers * 4 * hidden)


def _flops_build(batches: Sequence[ReplayBatch], options: ReplayOptions) -> PricedCost:
    """The encoder's FLOPs, scaled by one factor fitted to the measured vision time."""
    if options.vision_shape is None:
        raise CandidateRefused("no vision encoder shape given (--vision-shape LAYERS,HIDDEN,HEADS,FFN)")
    per_token, per_sq = vit_flops_per_image(options.vision_shape)
    recs = _fit_records(batches)
    of_record = options.feature_reader.of_record
    f = _features_of(recs, of_record)
    flops = per_token * f.image_tokens + per_sq * f.image_sq
    y = np.array([float(r["vision_forward_ms"]) for r in recs])
    if not np.any(flops > 0):
        raise CandidateRefused("no images in the fit part")
    scale = float(flops @ y / (flops @ flops))
    vb = sum(float(r["vision_backward_ms"]) for r in recs)
    lang, r2l, note = fit_language(recs, of_record=of_record, r2_floor=options.r2_floor)
    model = CostModel(vision_ms_per_token=scale * per_token, vision_ms_per_token_sq=scale * per_sq,
                      vision_backward_ratio=vb / float(y.sum()) if y.sum() > 0 else 2.0, **lang)
    r2v = _r2(y, scale * flops)
    return PricedCost(model, f"vision R^2 {r2v:.3f} ({scale * 1e9:.4g} ms/GFLOP); {note}", r2v, r2l)


def _derived_build(batches: Sequence[ReplayBatch], options: ReplayOptions) -> PricedCost:
    """The features' FLOP-derived model as it is (no timing: what ``cost=model`` balances
    with). Its vision shape is checked against the fit part's measured vision time (R^2 at
    one fitted scale): below the floor the row is scored and shown but never chosen, as a
    fit below it is refused (on times that are noise, a model's "gain" would be noise too)."""
    features = options.feature_reader
    model = getattr(features, "flops_model", None)
    if model is None:
        raise CandidateRefused(f"no FLOP-derived model ({getattr(features, 'flops_note', 'none given')})")
    recs = _fit_records(batches)
    ph = model.phase_ms(_features_of(recs, features.of_record))
    pred = ph.vision_forward + ph.vision_backward
    y = np.array([float(r["vision_forward_ms"]) + float(r["vision_backward_ms"]) for r in recs])
    scale = float(pred @ y / (pred @ pred)) if np.any(pred > 0) else 0.0
    r2v = _r2(y, scale * pred)
    ratio = (f"{model.vision_ms_per_token / model.vision_ms_per_token_sq:.0f}"
             if model.vision_ms_per_token_sq else "inf")
    lang = "language from its config" if (model.llm_ms_per_token or model.llm_ms_per_len_sq) else "no language terms"
    detail = f"no timing: b/a {ratio} patches, {lang}; vision R^2 {r2v:.3f} at one scale"
    able = r2v >= options.r2_floor
    if not able:
        detail += f" (below the floor {options.r2_floor}: not chosen)"
    return PricedCost(model, detail, r2v, selectable=able)


register_candidate(Candidate(IMAGE_TOKENS, "the pack's image tokens (the default; Qwen-VL: the patch count)",
                             lambda batches, options: PricedCost(None, "sum of per-unit tokens")))
register_candidate(Candidate("vit-flops", "the vision encoder's FLOPs (its shape given), one fitted scale",
                             _flops_build))
register_candidate(Candidate("flops", "the FLOP-derived model of the tower's config, as cost=model uses it",
                             _derived_build))
register_candidate(Candidate("fit", "fitted a*tokens + b*sum(unit tokens^2), no per-unit constant",
                             fitted_candidate(("token", "token_sq"))))
register_candidate(Candidate("fit+frame", "fitted, with a per-frame (per-unit) constant",
                             fitted_candidate(("token", "token_sq", "unit"))))
register_candidate(Candidate("fit+pack", "fitted, with a per-pack constant (the original auto model)",
                             fitted_candidate(("token", "token_sq", "pack"))))
register_candidate(Candidate("fit+image", "fitted, with a per-image constant",
                             fitted_candidate(("token", "token_sq", "image"))))
register_candidate(Candidate("fit-linear+pack", "fitted a*tokens + per-pack constant, no quadratic term",
                             fitted_candidate(("token", "pack"))))


# -- scoring -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplayRow:
    """One line of the table: what placing by ``name`` achieved on the held-out batches."""

    name: str
    microstep_max_mean: float = float("nan")
    rank_total_max_mean: float = float("nan")
    moved_fraction: float = float("nan")
    detail: str = ""
    refused: str = ""
    selectable: bool = True
    r2_vision: float = float("nan")
    r2_language: float = float("nan")

    def to_json(self) -> dict:
        """The row with NaN (not measured, not fitted) as None: strict JSON, equal after a round trip."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    def figure(self, sync: str) -> float:
        """The figure the choice compares in this sync mode."""
        return self.microstep_max_mean if sync == "microstep" else self.rank_total_max_mean


def _plan(costs: np.ndarray, options: ReplayOptions):
    """The runtime planner's call (:func:`~megatron_mm_balance.runtime.planner.plan_batch`
    passes exactly these options; nodes from the global ranks when both are known)."""
    nodes = (None if options.ranks is None or not options.ranks_per_node
             else tuple(int(r) // int(options.ranks_per_node) for r in options.ranks))
    return plan_placement(costs, SolverOptions(
        sync=options.sync, ranks_per_node=nodes,
        balance_tolerance=DEFAULT_BALANCE_TOLERANCE if options.balance_tolerance is None
        else options.balance_tolerance))


def score(held: Sequence[ReplayBatch], cost_of: Optional[Callable[[ReplayBatch], np.ndarray]],
          options: ReplayOptions) -> Tuple[float, float, float]:
    """(micro-step max/mean, rank-total max/mean, moved share) of placing every held-out
    batch by ``cost_of(batch)`` (None: as recorded), on the measured times."""
    steps, totals, moved, packs = [], [], 0, 0
    for b in held:
        D, G = b.shape
        pl = Placement.identity(D, G) if cost_of is None else _plan(cost_of(b), options)
        t = b.placed_ms(pl)
        mean = t.mean(axis=0)
        steps.extend(float(x) for x in t.max(axis=0)[mean > 0] / mean[mean > 0])
        tot = t.sum(axis=1)
        totals.append(float(tot.max() / tot.mean()) if tot.mean() > 0 else 1.0)
        moved += int(pl.moved().sum())
        packs += D * G
    return (float(np.mean(steps)) if steps else 1.0, float(np.mean(totals)), moved / packs)


def measured_costs(batch: ReplayBatch, kind: str) -> np.ndarray:
    """The packs' own measured times as integer microseconds (the ``perfect`` row; a language
    time that is the slot's, :attr:`ReplayBatch.language_per_slot`, is the same for every pack)."""
    v = np.rint(batch.vision_ms * 1000.0).astype(np.int64)
    language = np.full_like(batch.language_ms, batch.language_ms.mean()) if batch.language_per_slot \
        else batch.language_ms
    lang = np.rint(language * 1000.0).astype(np.int64)
    return np.stack([v, lang], axis=2) if kind == "two-phase" else v + lang


@dataclass(frozen=True)
class ReplayResult:
    """The replay's table and choice (identical for identical records and options)."""

    choice: str
    reason: str
    rows: Tuple[ReplayRow, ...]
    sync: str
    margin: float
    fit_iterations: Tuple[int, ...]
    held_iterations: Tuple[int, ...]
    records: int
    models: Dict[str, Optional[CostModel]] = field(default_factory=dict, compare=False)
    #: what the costs were computed on (the features' ``identity``)
    features: str = ""

    def row(self, name: str) -> ReplayRow:
        return next(r for r in self.rows if r.name == name)

    @property
    def model(self) -> Optional[CostModel]:
        """The chosen candidate's cost model (None: image tokens)."""
        return self.models.get(self.choice)

    def excess_share(self, name: str) -> float:
        """``name``'s held-out figure of the sync mode, its excess over 1.0 as a share of
        image tokens' (NaN when refused, or image tokens' is 0): below 1, better than them."""
        row, base = self.row(name), self.row(IMAGE_TOKENS)
        if row.refused or base.refused or not base.figure(self.sync) > 1.0:
            return float("nan")
        return (row.figure(self.sync) - 1.0) / (base.figure(self.sync) - 1.0)

    def to_json(self) -> dict:
        return {"format": REPLAY_FORMAT, "choice": self.choice, "reason": self.reason, "sync": self.sync,
                "features": self.features, "margin": self.margin, "fit_iterations": list(self.fit_iterations),
                "held_iterations": list(self.held_iterations), "records": self.records,
                "rows": [r.to_json() for r in self.rows],
                "excess_vs_image_tokens": {r.name: _or_none(self.excess_share(r.name)) for r in self.rows},
                "models": {k: (None if m is None else m.to_json()) for k, m in self.models.items()}}

    def table(self) -> List[str]:
        """The table as lines: one row per candidate, its held-out figures and its fit."""
        fit = _span(self.fit_iterations)
        held = _span(self.held_iterations)
        def its(n):
            return "iteration" if len(n) == 1 else "iterations"
        on = f", features {self.features}" if self.features else ""
        out = [f"replay of {self.records} records: fit on {its(self.fit_iterations)} {fit}, scored on "
               f"held-out {its(self.held_iterations)} {held} (sync {self.sync}{on})",
               f"{'cost':<16} {'micro-step max/mean':>19} {'rank-total max/mean':>19} {'excess':>7} "
               f"{'moved':>6}  fit"]
        for r in self.rows:
            if r.refused:
                out.append(f"{r.name:<16} {'-':>19} {'-':>19} {'-':>7} {'-':>6}  refused: {r.refused}")
                continue
            mark = "  <- chosen" if r.name == self.choice else ""
            share = self.excess_share(r.name)
            excess = "-" if math.isnan(share) else f"{100 * share:.0f}%"
            out.append(f"{r.name:<16} {r.microstep_max_mean:>19.4f} {r.rank_total_max_mean:>19.4f} {excess:>7} "
                       f"{100 * r.moved_fraction:>5.1f}%  {r.detail}{mark}")
        out.append(f"excess: the {'micro-step' if self.sync == 'microstep' else 'rank-total'} max/mean's "
                   f"excess over 1.0 as a share of image tokens'")
        out.append(f"choice: {self.choice} ({self.reason})")
        return out


def _or_none(x: float) -> Optional[float]:
    return None if math.isnan(x) else x


def _span(its: Sequence[int]) -> str:
    its = list(its)
    if not its:
        return "-"
    if its == list(range(its[0], its[-1] + 1)):
        return f"{its[0]}-{its[-1]}" if len(its) > 1 else str(its[0])
    return ",".join(map(str, its))


def choose(rows: Sequence[ReplayRow], sync: str, margin: float) -> Tuple[str, str]:
    """(choice, reason): the selectable candidate with the lowest figure of the sync mode;
    image tokens unless it is lower than theirs by at least ``margin``."""
    base = next(r for r in rows if r.name == IMAGE_TOKENS)
    able = [r for r in rows if r.selectable and not r.refused and not math.isnan(r.figure(sync))]
    best = min(able, key=lambda r: r.figure(sync))             # min keeps the first of ties
    what = "micro-step" if sync == "microstep" else "rank-total"
    if best.name == IMAGE_TOKENS:
        return IMAGE_TOKENS, f"no candidate below image tokens' held-out {what} max/mean"
    gain = base.figure(sync) - best.figure(sync)
    if gain < margin:
        return IMAGE_TOKENS, (f"the best, {best.name}, is {gain:.4f} below image tokens' held-out "
                              f"{what} max/mean, less than the margin {margin}")
    return best.name, (f"{gain:.4f} below image tokens' held-out {what} max/mean "
                       f"(margin {margin})")


def replay(records: Sequence[dict], options: ReplayOptions = ReplayOptions(), *,
           skip_iterations: int = 0, candidates: Optional[Sequence[str]] = None,
           batches: Optional[Sequence[ReplayBatch]] = None) -> ReplayResult:
    """Replay ``records`` (every rank's): split, build every candidate on the fit part,
    score it on the held-out part, and choose (module docstring). ``candidates``: default
    the features' own (``options.features.candidates``)."""
    if options.margin < 0 or not math.isfinite(options.margin):
        raise ReplayError(f"the margin must be a number >= 0, got {options.margin!r}")
    features = options.feature_reader
    if batches is None:
        batches, _ = global_batches(records, sync=options.sync, skip_iterations=skip_iterations,
                                    features=features)
    fit, held = split_iterations(batches, options.holdout)
    names = list(features.candidates) if candidates is None else list(candidates)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise ReplayError(f"unknown replay candidate(s) {unknown} (known: {', '.join(CANDIDATES)})")
    if IMAGE_TOKENS not in names:
        names.insert(0, IMAGE_TOKENS)
    kind = options.kind
    rows = [ReplayRow("unbalanced", *score(held, None, options), detail="as recorded", selectable=False)]
    models: Dict[str, Optional[CostModel]] = {}
    for name in names:
        try:
            priced = CANDIDATES[name].build(fit, options)
        except CandidateRefused as exc:
            rows.append(ReplayRow(name, refused=str(exc)))
            continue
        models[name] = priced.model
        rows.append(ReplayRow(name, *score(held, lambda b, p=priced: p.costs(b, kind), options),
                              detail=priced.detail, selectable=priced.selectable, r2_vision=priced.r2_vision,
                              r2_language=priced.r2_language))
    rows.append(ReplayRow("perfect", *score(held, lambda b: measured_costs(b, kind), options),
                          detail="the held-out packs' own measured times", selectable=False))
    choice, reason = choose(rows, options.sync, options.margin)
    return ReplayResult(choice, reason, tuple(rows), options.sync, options.margin,
                        tuple(b.iteration for b in fit), tuple(b.iteration for b in held),
                        sum(len(b.records) for b in batches), models, features=features.identity)
