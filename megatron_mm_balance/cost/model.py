"""What a pack costs the step, as an integer every rank agrees on: the one cost estimator.

Every pack has about the same length, so the language model's dense work is about
the same for all of them; what differs is (a) the vision encoder, whose work follows
the pack's image tokens, and (b) attention inside the language model, which for
variable-length packed sequences follows the sum of squared sample lengths.

* the default, the pack's image tokens, is
  :class:`megatron_mm_balance.cost.pack.ImageTokenCost` (:func:`image_token_costs`
  here, for many packs at once);
* :class:`CostModel` — milliseconds per phase:

  - vision forward ``a*sum(n_i) + b*sum(n_i**2) + u*units + g*images + f*[pack has images]``
    over the pack's attention units ``n_i`` (an image for tiled inputs; a frame, ``h*w``
    patches, for Qwen-VL's native-resolution grids, :mod:`.frames`), with ``b``: attention
    inside each unit; ``u``, ``g``: per-unit and per-image constants; ``f``: a per-pack
    launch cost,
  - language-model forward ``t*positions + c*sum(len_j**2) + const`` over its
    samples (``positions``: the tokens the model computes, the pack's own or the
    fixed sequence length when padding is computed),
  - each backward = its phase's ratio x that phase's forward
    (``vision_backward_ratio``, ``llm_backward_ratio``: the one meaning of a
    backward ratio, shared with the simulator's timing model).

  :meth:`CostModel.integer_costs` turns the phases into the solver's input:
  ``two-phase`` gives ``(vision, language)`` integer microseconds of forward +
  backward per pack, ``time`` one integer, their sum. The runtime's cost functions
  (:mod:`.pack`), the online calibration (:mod:`.calibration`) and the simulator
  (``sim/``, whose :class:`~megatron_mm_balance.sim.timing.TimingModel` converts to a
  :class:`CostModel`) all call it.
* cost files (JSON) carry the coefficients between a calibration and the
  ``--mm-balance-cost model`` flag (``mm-balance-cost/v2``; a model with per-unit or
  per-image terms is written as ``v3``, so a reader that does not know those terms refuses
  it instead of dropping them; ``v1`` files, with one ``backward_ratio`` for both phases,
  are read too).

Costs are integers (microseconds) so that the placement solver, which every rank
runs on the same all-gathered costs, is exact.
"""
from __future__ import annotations

import json
import math
from dataclasses import InitVar, asdict, dataclass, fields
from typing import Iterable, Optional, Sequence

import numpy as np

COST_FILE_FORMAT = "mm-balance-cost/v2"
#: the format of a model that uses the per-unit / per-image terms (:data:`UNIT_TERMS`)
COST_FILE_FORMAT_UNITS = "mm-balance-cost/v3"
COST_FILE_FORMATS = ("mm-balance-cost/v1", COST_FILE_FORMAT, COST_FILE_FORMAT_UNITS)
#: the terms ``v3`` added (a ``v2`` file has none of them: they are 0)
UNIT_TERMS = ("vision_ms_per_unit", "vision_ms_per_image")
COST_KINDS = ("two-phase", "time")


@dataclass(frozen=True)
class PackFeatures:
    """What the model looks at: the token count of each attention unit (``images``: one
    per image for tiled inputs, one per frame for Qwen-VL grids), per-sample lengths, the
    positions the language model computes (default: the samples' tokens) and the number
    of images (default: one per unit)."""

    images: tuple[int, ...]
    lengths: tuple[int, ...] = ()
    positions: Optional[int] = None
    num_images: Optional[int] = None

    @property
    def image_count(self) -> int:
        return len(self.images) if self.num_images is None else int(self.num_images)

    def vector(self) -> np.ndarray:
        """``[sum(n), sum(n^2), sum(len^2), 1]``: the terms of the forward fit."""
        n = np.asarray(self.images, dtype=np.float64)
        ln = np.asarray(self.lengths, dtype=np.float64)
        return np.array([n.sum(), (n * n).sum(), (ln * ln).sum(), 1.0])

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths)) if self.positions is None else int(self.positions)


@dataclass(frozen=True)
class FeatureArrays:
    """The features of many packs as flat arrays (the simulator's pools, a batch of packs)."""

    image_tokens: np.ndarray      # [P] sum of n_i
    image_sq: np.ndarray          # [P] sum of n_i^2
    has_images: np.ndarray        # [P] bool
    positions: np.ndarray         # [P] positions the language model computes
    len_sq: np.ndarray            # [P] sum of len_j^2
    units: Optional[np.ndarray] = None       # [P] attention units (frames); None: no unit term
    num_images: Optional[np.ndarray] = None  # [P] images (a video is one); None: no image term

    @staticmethod
    def of(packs: Sequence[PackFeatures]) -> "FeatureArrays":
        img = [np.asarray(p.images, dtype=np.float64) for p in packs]
        ln = [np.asarray(p.lengths, dtype=np.float64) for p in packs]
        return FeatureArrays(
            image_tokens=np.array([v.sum() for v in img]),
            image_sq=np.array([(v * v).sum() for v in img]),
            has_images=np.array([len(p.images) > 0 for p in packs]),
            positions=np.array([float(p.tokens) for p in packs]),
            len_sq=np.array([(v * v).sum() for v in ln]),
            units=np.array([float(len(p.images)) for p in packs]),
            num_images=np.array([float(p.image_count) for p in packs]))


@dataclass(frozen=True)
class PhaseTimes:
    """Milliseconds per pack: vision forward and backward, language forward, and the
    whole language phase (forward + backward), as arrays over packs."""

    vision_forward: np.ndarray
    vision_backward: np.ndarray
    llm_forward: np.ndarray
    llm: np.ndarray

    @property
    def vision(self) -> np.ndarray:
        return self.vision_forward + self.vision_backward


@dataclass(frozen=True)
class CostModel:
    """Forward milliseconds of each phase's terms and each phase's backward/forward ratio."""

    vision_ms_per_token: float = 1.0e-3
    vision_ms_per_token_sq: float = 0.0
    llm_ms_per_len_sq: float = 0.0
    const_ms: float = 0.0
    vision_backward_ratio: float = 2.0
    llm_backward_ratio: float = 2.0
    vision_ms_per_pack: float = 0.0
    llm_ms_per_token: float = 0.0
    vision_ms_per_unit: float = 0.0
    vision_ms_per_image: float = 0.0
    #: both ratios at once (the single ratio of ``mm-balance-cost/v1`` files)
    backward_ratio: InitVar[Optional[float]] = None

    def __post_init__(self, backward_ratio):
        if backward_ratio is not None:
            object.__setattr__(self, "vision_backward_ratio", backward_ratio)
            object.__setattr__(self, "llm_backward_ratio", backward_ratio)
        for name, value in asdict(self).items():
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"cost model: {name} must be a finite number >= 0, got {value!r}")

    # -- many packs ------------------------------------------------------------------
    def phase_ms(self, f: FeatureArrays) -> PhaseTimes:
        """Milliseconds per phase for every pack of ``f``."""
        vf = (self.vision_ms_per_token * f.image_tokens + self.vision_ms_per_token_sq * f.image_sq
              + self.vision_ms_per_pack * f.has_images)
        vf = vf + self._count_terms(f)
        lf = self.llm_ms_per_token * f.positions + self.llm_ms_per_len_sq * f.len_sq
        if self.const_ms:
            lf = lf + self.const_ms
        lf = np.broadcast_to(np.asarray(lf, dtype=np.float64), np.shape(vf))
        return PhaseTimes(np.asarray(vf, dtype=np.float64), np.asarray(vf * self.vision_backward_ratio),
                          lf, lf * (1.0 + self.llm_backward_ratio))

    def unit_forward_ms(self, tokens) -> np.ndarray:
        """Vision forward milliseconds of attention units (images, or Qwen-VL frames) encoded
        each on its own, from their token counts: ``a*n + b*n**2 + u``. The per-image and
        per-pack constants belong to whole images and packs, not to one unit."""
        n = np.asarray(tokens, dtype=np.float64)
        ms = self.vision_ms_per_token * n + self.vision_ms_per_token_sq * n * n
        return ms + self.vision_ms_per_unit if self.vision_ms_per_unit else ms

    def _count_terms(self, f: FeatureArrays):
        """``u*units + g*images`` (0 when the terms are 0 or ``f`` does not count them)."""
        out = 0.0
        for coef, counts, name in ((self.vision_ms_per_unit, f.units, "units"),
                                   (self.vision_ms_per_image, f.num_images, "num_images")):
            if coef:
                if counts is None:
                    raise ValueError(f"cost model: a {name} term needs features that count {name}")
                out = out + coef * np.asarray(counts, dtype=np.float64)
        return out

    def integer_costs(self, f: Optional[FeatureArrays], kind: str = "time", *, llm_divisor: int = 1,
                      phases: Optional[PhaseTimes] = None) -> np.ndarray:
        """The solver's input: ``two-phase`` ``[P, 2]`` (vision forward + backward, language
        phase), ``time`` ``[P]`` (their sum), integer microseconds. ``llm_divisor``: the
        language phase is split over that many pipeline stages (the vision encoder's stage
        computes one share). ``phases``: :meth:`phase_ms` of ``f``, if already computed."""
        ph = self.phase_ms(f) if phases is None else phases
        lm = ph.llm / llm_divisor if llm_divisor != 1 else ph.llm
        if kind == "two-phase":
            return np.stack([np.rint((ph.vision_forward + ph.vision_backward) * 1000.0),
                             np.rint(lm * 1000.0)], axis=1).astype(np.int64)
        if kind == "time":
            return np.rint((ph.vision_forward + lm + ph.vision_backward) * 1000.0).astype(np.int64)
        raise ValueError(f"cost kind must be one of {COST_KINDS}, got {kind!r}")

    # -- one pack --------------------------------------------------------------------
    def forward_ms(self, f: PackFeatures) -> float:
        """Vision + language forward milliseconds of one pack."""
        ph = self.phase_ms(FeatureArrays.of([f]))
        return float(ph.vision_forward[0] + ph.llm_forward[0])

    def step_ms(self, f: PackFeatures) -> float:
        """Forward + backward milliseconds this pack adds to a micro-step."""
        ph = self.phase_ms(FeatureArrays.of([f]))
        return float(ph.vision[0] + ph.llm[0])

    def cost(self, f: PackFeatures) -> int:
        """Integer microseconds of forward + backward: the scalar solver's input."""
        return int(self.integer_costs(FeatureArrays.of([f]), "time")[0])

    def phase_costs(self, f: PackFeatures) -> tuple[int, int]:
        """``(vision, language)`` integer microseconds of forward + backward: the
        two-phase solver's input."""
        v, lang = self.integer_costs(FeatureArrays.of([f]), "two-phase")[0]
        return int(v), int(lang)

    # -- fitting and files -----------------------------------------------------------
    @staticmethod
    def fit(records: Iterable[dict], *, backward_ratio: float | None = None) -> "CostModel":
        """Least-squares calibration of the forward terms from measured records.

        Each record: ``{"images": [n_i...], "lengths": [len_j...] (optional),
        "forward_ms": float, "backward_ms": float (optional)}``. Coefficients are
        constrained to be >= 0 (a term that would fit negative is dropped and the
        rest refitted). The backward ratio (both phases) is ``sum(backward) /
        sum(forward)`` when backward times are given, else ``backward_ratio``
        (default 2.0). The two-phase fit from a training job's timings is
        :func:`megatron_mm_balance.cost.calibration.fit_phases`.
        """
        recs = list(records)
        if len(recs) < 2:
            raise ValueError("cost model fit needs at least 2 records")
        X, y, bwd = [], [], []
        for i, r in enumerate(recs):
            if "forward_ms" not in r:
                raise ValueError(f"record {i}: missing 'forward_ms'")
            X.append(PackFeatures(tuple(r.get("images", ())), tuple(r.get("lengths", ()))).vector())
            y.append(float(r["forward_ms"]))
            if r.get("backward_ms") is not None:
                bwd.append(float(r["backward_ms"]))
        coef = nonnegative_lstsq(np.asarray(X), np.asarray(y))
        y = np.asarray(y)
        if backward_ratio is None:
            backward_ratio = (sum(bwd) / float(y.sum())) if len(bwd) == len(recs) and y.sum() > 0 else 2.0
        return CostModel(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]),
                         backward_ratio=float(backward_ratio))

    def to_json(self) -> dict:
        """The cost file's content: ``v2`` when the per-unit / per-image terms are 0 (what
        every reader of ``v2`` understands), else ``v3`` with them."""
        data = asdict(self)
        if not any(data[k] for k in UNIT_TERMS):
            return {"format": COST_FILE_FORMAT, **{k: v for k, v in data.items() if k not in UNIT_TERMS}}
        return {"format": COST_FILE_FORMAT_UNITS, **data}

    @staticmethod
    def from_json(data: dict, where: str = "cost model") -> "CostModel":
        """A model from :meth:`to_json` output (``v2``) or a ``v1`` cost file's fields."""
        if not isinstance(data, dict) or data.get("format") not in COST_FILE_FORMATS:
            raise ValueError(f"{where}: not a cost file (expected \"format\": \"{COST_FILE_FORMAT}\")")
        fields_ = {k: v for k, v in data.items() if k != "format"}
        known = {f.name for f in fields(CostModel)}
        if data["format"] == "mm-balance-cost/v1":
            known = {"vision_ms_per_token", "vision_ms_per_token_sq", "llm_ms_per_len_sq", "const_ms",
                     "backward_ratio"}
        elif data["format"] == COST_FILE_FORMAT:
            known -= set(UNIT_TERMS)
        unknown = set(fields_) - known
        if unknown:
            raise ValueError(f"{where}: unknown cost-file fields {sorted(unknown)}")
        return CostModel(**fields_)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")


def nonnegative_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: columns that are all zero are left out,
    and a term that would fit negative is dropped and the rest refitted."""
    active = [j for j in range(X.shape[1]) if np.any(X[:, j] != 0)]
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def image_token_costs(f: FeatureArrays) -> np.ndarray:
    """The default cost for many packs: image tokens, as integers."""
    return np.asarray(f.image_tokens).astype(np.int64)


def load_cost_file(path: str) -> CostModel:
    """Read a cost file written by :meth:`CostModel.save` (or by scripts/gpu_check.sh)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such cost file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
    return CostModel.from_json(data, where=path)
