"""What a pack costs the step, as an integer every rank agrees on.

Every pack has the same length, so the language model's dense work is the same
for all of them; what differs is (a) the vision encoder, whose work follows the
pack's image tokens, and (b) attention inside the language model, which for
variable-length packed sequences follows the sum of squared sample lengths.

* the default, the pack's image tokens, is
  :class:`megatron_mm_balance.cost.pack.ImageTokenCost`;
* :class:`CostModel` — vision ``a*sum(n_i) + b*sum(n_i**2)`` over the pack's images
  (the quadratic term is attention inside each image), language model
  ``c*sum(len_j**2)`` over its samples, a constant, and a backward/forward ratio.
  :meth:`CostModel.fit` calibrates it by least squares from measured records;
  cost files (JSON) carry the coefficients between the calibration script and
  the ``--mm-balance-cost model`` flag.

Costs are integers (microseconds for the model) so that the placement solver,
which every rank runs on the same all-gathered costs, is exact.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np

COST_FILE_FORMAT = "mm-balance-cost/v1"


@dataclass(frozen=True)
class PackFeatures:
    """What the richer model looks at: per-image token counts and per-sample lengths."""

    images: tuple[int, ...]
    lengths: tuple[int, ...] = ()

    def vector(self) -> np.ndarray:
        n = np.asarray(self.images, dtype=np.float64)
        ln = np.asarray(self.lengths, dtype=np.float64)
        return np.array([n.sum(), (n * n).sum(), (ln * ln).sum(), 1.0])


@dataclass(frozen=True)
class CostModel:
    """Forward milliseconds of the parts that vary between packs, and the backward ratio."""

    vision_ms_per_token: float = 1.0e-3
    vision_ms_per_token_sq: float = 0.0
    llm_ms_per_len_sq: float = 0.0
    const_ms: float = 0.0
    backward_ratio: float = 2.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model: {name} must be a finite number >= 0, got {value!r}")

    def forward_ms(self, f: PackFeatures) -> float:
        a, b, c, d = self._coef()
        return float(f.vector() @ np.array([a, b, c, d]))

    def step_ms(self, f: PackFeatures) -> float:
        """Forward + backward milliseconds this pack adds to a micro-step."""
        return self.forward_ms(f) * (1.0 + self.backward_ratio)

    def cost(self, f: PackFeatures) -> int:
        """Integer microseconds of forward + backward: the solver's input."""
        return int(round(1000.0 * self.step_ms(f)))

    def phase_costs(self, f: PackFeatures) -> tuple[int, int]:
        """``(vision, language)`` integer microseconds of forward + backward: the
        two-phase solver's input. Vision: the image terms; language: the sample
        attention term and the per-pack constant."""
        n, n2, l2, one = f.vector()
        scale = 1000.0 * (1.0 + self.backward_ratio)
        vision = (self.vision_ms_per_token * n + self.vision_ms_per_token_sq * n2) * scale
        language = (self.llm_ms_per_len_sq * l2 + self.const_ms * one) * scale
        return int(round(vision)), int(round(language))

    def _coef(self):
        return (self.vision_ms_per_token, self.vision_ms_per_token_sq,
                self.llm_ms_per_len_sq, self.const_ms)

    @staticmethod
    def fit(records: Iterable[dict], *, backward_ratio: float | None = None) -> "CostModel":
        """Least-squares calibration from measured records.

        Each record: ``{"images": [n_i...], "lengths": [len_j...] (optional),
        "forward_ms": float, "backward_ms": float (optional)}``. Coefficients are
        constrained to be >= 0 (a term that would fit negative is dropped and the
        rest refitted). The backward ratio is ``sum(backward) / sum(forward)`` when
        backward times are given, else ``backward_ratio`` (default 2.0).
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
        X, y = np.asarray(X), np.asarray(y)
        active = [j for j in range(4) if np.any(X[:, j] != 0)]
        coef = np.zeros(4)
        while active:
            sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
            if np.all(sol >= 0):
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        if backward_ratio is None:
            backward_ratio = (sum(bwd) / float(y.sum())) if len(bwd) == len(recs) and y.sum() > 0 else 2.0
        return CostModel(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]),
                         float(backward_ratio))

    def to_json(self) -> dict:
        return {"format": COST_FILE_FORMAT, **asdict(self)}

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")


def load_cost_file(path: str) -> CostModel:
    """Read a cost file written by :meth:`CostModel.save` (or by scripts/gpu_check.sh)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such cost file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict) or data.get("format") != COST_FILE_FORMAT:
        raise ValueError(f"{path}: not a cost file (expected \"format\": \"{COST_FILE_FORMAT}\")")
    fields = {k: v for k, v in data.items() if k != "format"}
    unknown = set(fields) - set(CostModel.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{path}: unknown cost-file fields {sorted(unknown)}")
    return CostModel(**fields)
