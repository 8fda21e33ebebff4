"""Calibrate the cost model: online, from a training job's own per-pack timings
(``--mm-balance-cost auto``), or offline, by timing a vision encoder against image tokens.

Online (:func:`choose_by_replay`, :class:`AutoCost`): the timing hooks
(:mod:`megatron_mm_balance.megatron.timing`) record every micro-batch's vision and
language-model forward and backward time with the pack's features; after the first
K iterations the records of every rank are replayed (:mod:`.replay`): the candidate
cost models are fitted on the first part of those iterations and judged by the
balance their placements reach on the measured times of the held-out rest; a model
replaces image tokens only where it beats them there by the margin. The decision is
made on one rank, agreed on by all, and the balancer switches to it at a global-batch
boundary (two-phase costs under micro-step synchronisation). :func:`fit_phases` is
the two-phase fit the simulator's run traces use; degenerate fits are refused.

Offline (:func:`calibrate`):

A CLIP ViT-L/14-sized encoder (24 layers, hidden 1024, 16 heads, MLP 4096) runs
forward and backward on packs of images of different sizes and counts; medians of
repeated timings (CUDA events on a GPU, ``perf_counter`` on CPU) become records
for :meth:`megatron_mm_balance.cost.model.CostModel.fit`, and the fitted model is
written as a cost file that ``--mm-balance-cost model`` accepts.

The encoder is megatron-core's ``CLIPViTModel`` when megatron-core (and, for its
fused kernels, transformer-engine) is importable and a GPU is present; otherwise
a plain PyTorch encoder of the same shape, attention computed per image with
``scaled_dot_product_attention``. Which one ran is recorded in the results.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from .features import QwenVLFeatures, TileFeatures  # noqa: F401  (QwenVLFeatures: re-exported)
from .model import CostModel, FeatureArrays, nonnegative_lstsq
from .pack import DEFAULT_TOKENS_PER_TILE, check_tokens_per_tile
from .replay import (DEFAULT_HOLDOUT, DEFAULT_MARGIN, IMAGE_TOKENS, ReplayError, ReplayOptions,
                     replay)
from .timing_records import MIN_RECORDS, R2_FLOOR, language_compute_records

#: Cost-fit file beside the checkpoints (``--save``), read back on ``--load``.
FIT_FILE = "mm_balance_cost_fit.json"
FIT_FORMAT = "mm-balance-cost-fit/v2"
#: Readable fit files: v1 (no replay, no choice) and v2.
FIT_FORMATS = ("mm-balance-cost-fit/v1", FIT_FORMAT)
DEFAULT_CALIBRATION_ITERS = 10


@dataclass(frozen=True)
class EncoderShape:
    layers: int = 24
    hidden: int = 1024
    heads: int = 16
    ffn: int = 4096

    @staticmethod
    def tiny() -> "EncoderShape":
        return EncoderShape(layers=2, hidden=64, heads=4, ffn=256)


def build_torch_encoder(shape: EncoderShape, device, dtype):
    """A pre-norm transformer encoder over patch tokens: the ViT-L/14 body."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(shape.hidden)
            self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
            self.proj = nn.Linear(shape.hidden, shape.hidden)
            self.ln2 = nn.LayerNorm(shape.hidden)
            self.fc1 = nn.Linear(shape.hidden, shape.ffn)
            self.fc2 = nn.Linear(shape.ffn, shape.hidden)

        def forward(self, x):                       # x: [images, tokens, hidden]
            b, t, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, shape.heads, h // shape.heads).unbind(2)
            a = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    model = nn.Sequential(*[Block() for _ in range(shape.layers)])
    return model.to(device=device, dtype=dtype)


def pack_configurations(max_tokens: int = 8192, *, quick: bool = False):
    """(image count, tokens per image) pairs: single large images and many small ones,
    from 0 up to ``max_tokens`` image tokens per pack."""
    sizes = (256, 576, 1024) if not quick else (16, 64)
    out = [(0, 0)]
    for size in sizes:
        n = 1
        while n * size <= max_tokens:
            out.append((n, size))
            n *= 2
    return out


def time_pack(model, images: int, tokens: int, shape: EncoderShape, device, dtype,
              repeats: int, warmup: int) -> tuple[float, float]:
    """Median forward and backward milliseconds for one pack of ``images`` x ``tokens``."""
    import torch

    if images == 0:
        return 0.0, 0.0
    cuda = torch.device(device).type == "cuda"
    x = torch.randn(images, tokens, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    fwd, bwd = [], []
    for it in range(warmup + repeats):
        if cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            y = model(x)
            e1.record()
            y.float().sum().backward()
            e2.record()
            torch.cuda.synchronize()
            f, b = e0.elapsed_time(e1), e1.elapsed_time(e2)
        else:
            t0 = time.perf_counter()
            y = model(x)
            t1 = time.perf_counter()
            y.float().sum().backward()
            t2 = time.perf_counter()
            f, b = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        x.grad = None
        model.zero_grad(set_to_none=True)
        if it >= warmup:
            fwd.append(f)
            bwd.append(b)
    return statistics.median(fwd), statistics.median(bwd)


def calibrate(*, device="cpu", dtype=None, shape: EncoderShape | None = None,
              max_tokens: int = 8192, repeats: int = 5, warmup: int = 2, quick: bool = False,
              log=print) -> dict:
    """Time the encoder over :func:`pack_configurations` and fit the cost model.

    Returns ``{"encoder": ..., "device": ..., "records": [...], "cost_model": {...}}``.
    """
    import torch

    shape = shape or (EncoderShape.tiny() if quick else EncoderShape())
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = build_torch_encoder(shape, device, dtype)
    records = []
    for images, tokens in pack_configurations(max_tokens, quick=quick):
        f, b = time_pack(model, images, tokens, shape, device, dtype, repeats, warmup)
        records.append({"images": [tokens] * images, "forward_ms": f, "backward_ms": b})
        log(f"  {images:>3} x {tokens:>5} image tokens: forward {f:8.3f} ms, backward {b:8.3f} ms")
    fitted = CostModel.fit(records)
    return {
        "encoder": f"torch ViT body {shape}",
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "records": records,
        "cost_model": fitted.to_json(),
    }


def save_results(results: dict, cost_path: str, records_path: str | None = None) -> CostModel:
    model = CostModel(**{k: v for k, v in results["cost_model"].items() if k != "format"})
    model.save(cost_path)
    if records_path:
        with open(records_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return model


# ---------------------------------------------------------------------------------------
# online calibration from a training job's timings

@dataclass(frozen=True)
class FitResult:
    """The outcome of one calibration, identical on every rank (decided on one, broadcast).

    ``ok``: the balancer uses ``model`` (the ``choice`` the replay made) from global batch
    ``effective_iteration`` on; otherwise image tokens stay the cost and ``reason`` says
    why. ``replay``: the replay's table (:meth:`~.replay.ReplayResult.to_json`, without the
    models), None for fits made without one (``mm-balance-cost-fit/v1`` files).
    ``features``: the identity of the features the model prices (a resumed job checks it)."""

    ok: bool
    model: Optional[CostModel]
    r2_vision: float
    r2_language: float
    records: int
    first_iteration: int
    last_iteration: int
    effective_iteration: int
    reason: str = ""
    choice: str = IMAGE_TOKENS
    replay: Optional[dict] = None
    #: what the model's features are (:mod:`.features` ``identity``; "" in older files)
    features: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["model"] = None if self.model is None else self.model.to_json()
        return {"format": FIT_FORMAT, **d}

    @staticmethod
    def from_json(data: dict, where: str = "cost fit") -> "FitResult":
        """A fit from :meth:`to_json` (``v2``), or a ``v1`` file (no replay: its accepted
        fit was the per-pack model, ``fit+pack``)."""
        if not isinstance(data, dict) or data.get("format") not in FIT_FORMATS:
            raise ValueError(f"{where}: not a cost-fit file (expected \"format\": \"{FIT_FORMAT}\")")
        d = {k: v for k, v in data.items() if k != "format"}
        if data["format"] == FIT_FORMATS[0]:
            d.setdefault("choice", "fit+pack" if d.get("ok") else IMAGE_TOKENS)
        try:
            d["model"] = None if d.get("model") is None else CostModel.from_json(d["model"], where)
            return FitResult(**d)
        except TypeError as exc:
            raise ValueError(f"{where}: malformed cost fit ({exc})") from None

    def line(self) -> str:
        """One log line: the choice, its coefficients, R^2, records used, and from when."""
        span = f"{self.records} records of iterations {self.first_iteration}-{self.last_iteration}"
        if not self.ok:
            how = "kept image tokens by replay" if self.replay is not None else "fit refused"
            return (f"[mm-balance] cost auto: {how} ({self.reason}; {span}): "
                    f"balancing with image tokens")
        m = self.model
        how = f"chose {self.choice} by replay ({self.reason}), " if self.replay is not None else ""
        return (f"[mm-balance] cost auto: {how}fitted from {span} (R^2 vision {self.r2_vision:.3f}, "
                f"language {self.r2_language:.3f}): vision {m.vision_ms_per_token:.4g} ms/token + "
                f"{m.vision_ms_per_token_sq:.3g} ms/token^2 + {m.vision_ms_per_pack:.3g} ms/pack + "
                f"{m.vision_ms_per_image:.3g} ms/image"
                + (f" + {m.vision_ms_per_unit:.3g} ms/unit" if m.vision_ms_per_unit else "") + ", "
                f"backward x{m.vision_backward_ratio:.3f}; language {m.llm_ms_per_token:.4g} ms/token + "
                f"{m.llm_ms_per_len_sq:.3g} ms/len^2 + {m.const_ms:.4g} ms, backward "
                f"x{m.llm_backward_ratio:.3f}; balancing with it from iteration {self.effective_iteration}")

    def lines(self) -> List[str]:
        """:meth:`line` and, after a replay, its table (``[mm-balance] cost auto replay | ...``)."""
        table = self.replay.get("table", []) if self.replay else []
        return [self.line()] + [f"[mm-balance] cost auto replay | {t}" for t in table]


def choose_by_replay(records: Sequence[dict], options: ReplayOptions, *, first_iteration: int = 0,
                     last_iteration: int = 0, effective_iteration: int = 0) -> FitResult:
    """``--mm-balance-cost auto``'s decision: replay the calibration iterations' records
    (:func:`~.replay.replay`: fit on the first part, score on the held-out rest, on
    ``options.features``' units and candidates) and take its choice: a fitted or derived
    cost model only where it beat image tokens on the held-out iterations by the margin;
    image tokens otherwise, or when the records cannot be replayed (the reason says which)."""
    recs = list(records)
    span = dict(first_iteration=first_iteration, last_iteration=last_iteration,
                effective_iteration=effective_iteration, features=options.feature_reader.identity)
    try:
        result = replay(recs, options)
    except ReplayError as exc:
        return FitResult(False, None, float("nan"), float("nan"), len(recs), reason=str(exc), **span)
    table = {k: v for k, v in result.to_json().items() if k != "models"}
    table["table"] = result.table()
    row = result.row(result.choice)
    ok = result.choice != IMAGE_TOKENS
    return FitResult(ok, result.model if ok else None, row.r2_vision, row.r2_language, len(recs),
                     reason=result.reason, choice=result.choice, replay=table, **span)


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if ss_tot <= 0:
        return float("nan")
    return 1.0 - float(((y - pred) ** 2).sum()) / ss_tot


def fit_phases(records: Sequence[dict], *, first_iteration: int = 0, last_iteration: int = 0,
               effective_iteration: int = 0, min_records: int = MIN_RECORDS,
               r2_floor: float = R2_FLOOR, features=None) -> FitResult:
    """Fit the two-phase :class:`~.model.CostModel` from timing records (all ranks').

    Vision: ``vision_forward_ms ~ a*sum(n) + b*sum(n^2) + f*[has images]`` over every
    record (text-only packs pin ``f``), backward ratio ``sum(backward) / sum(forward)``;
    language: ``lm_forward_ms ~ t*tokens + c*sum(len^2) + const`` over
    :func:`language_compute_records`, its own backward ratio. Coefficients >= 0.
    Refused (``ok=False``, a reason) with fewer than ``min_records`` records with images,
    no variation in vision time, or a vision R^2 below ``r2_floor``. ``features``: a
    record's :class:`~.model.PackFeatures` (default :meth:`TileFeatures.of_record`: its
    ``images`` and ``lengths``; :meth:`QwenVLFeatures.of_record` derives them from grids)."""
    recs = list(records)
    of_record = features or TileFeatures.of_record
    span = dict(first_iteration=first_iteration, last_iteration=last_iteration,
                effective_iteration=effective_iteration)
    with_images = [r for r in recs if r["images"]]

    def refuse(reason, r2v=float("nan"), r2l=float("nan")):
        return FitResult(False, None, r2v, r2l, len(recs), reason=reason, **span)

    if len(with_images) < min_records:
        return refuse(f"{len(with_images)} records with images, fewer than {min_records}")
    f = FeatureArrays.of([of_record(r) for r in recs])
    Xv = np.stack([f.image_tokens, f.image_sq, f.has_images.astype(np.float64)], axis=1)
    yv = np.array([float(r["vision_forward_ms"]) for r in recs])
    a, b, fix = nonnegative_lstsq(Xv, yv)
    r2v = _r2(yv, Xv @ np.array([a, b, fix]))
    if math.isnan(r2v):
        return refuse("no variation in vision time")
    vb = sum(float(r["vision_backward_ms"]) for r in recs)
    rv = vb / float(yv.sum()) if yv.sum() > 0 else 2.0

    lang = language_compute_records(recs)
    fl = FeatureArrays.of([of_record(r) for r in lang])
    Xl = np.stack([fl.positions, fl.len_sq, np.ones(len(lang))], axis=1)
    yl = np.array([float(r["lm_forward_ms"]) for r in lang])
    t, c, const = nonnegative_lstsq(Xl, yl)
    r2l = _r2(yl, Xl @ np.array([t, c, const]))
    lb = sum(float(r["lm_backward_ms"]) for r in lang)
    rl = lb / float(yl.sum()) if yl.sum() > 0 else 2.0
    if r2v < r2_floor:
        return refuse(f"R^2 of the vision fit {r2v:.3f} below the floor {r2_floor}", r2v, r2l)
    model = CostModel(vision_ms_per_token=float(a), vision_ms_per_token_sq=float(b),
                      vision_ms_per_pack=float(fix), vision_backward_ratio=float(rv),
                      llm_ms_per_token=float(t), llm_ms_per_len_sq=float(c), const_ms=float(const),
                      llm_backward_ratio=float(rl))
    return FitResult(True, model, r2v, r2l, len(recs), choice="fit+pack", **span)


@dataclass(frozen=True)
class CalibrationConfig:
    """``--mm-balance-cost auto``: calibrate on the job's first ``iterations`` iterations
    (its very first dropped: start-up costs), then balance with the fit."""

    iterations: int = DEFAULT_CALIBRATION_ITERS
    phases: bool = True
    tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE
    min_records: int = MIN_RECORDS
    r2_floor: float = R2_FLOOR
    wait_s: float = 300.0
    #: the replay's held-out share of the calibration iterations and its margin
    holdout: float = DEFAULT_HOLDOUT
    margin: float = DEFAULT_MARGIN
    #: the balancer's own planner settings, which the replay plans with
    balance_tolerance: Optional[float] = None
    ranks_per_node: Optional[int] = None
    group_ranks: Optional[tuple] = None

    def __post_init__(self):
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or self.iterations < 2:
            raise ValueError(f"calibration iterations must be an int >= 2, got {self.iterations!r}")
        check_tokens_per_tile(self.tokens_per_tile)
        if not 0 < self.holdout < 1:
            raise ValueError(f"calibration held-out share must be in (0, 1), got {self.holdout!r}")
        if not (self.margin >= 0 and math.isfinite(self.margin)):
            raise ValueError(f"calibration margin must be a number >= 0, got {self.margin!r}")

    def replay_options(self, features=None) -> ReplayOptions:
        """The replay the calibration runs: the balancer's sync mode and planner settings, on
        ``features`` (:mod:`.features`; None: the tiles')."""
        return ReplayOptions(sync="microstep" if self.phases else "step", features=features,
                             balance_tolerance=self.balance_tolerance, ranks_per_node=self.ranks_per_node,
                             ranks=None if self.group_ranks is None else tuple(sorted(self.group_ranks)),
                             holdout=self.holdout, margin=self.margin, min_records=self.min_records,
                             r2_floor=self.r2_floor)


class AutoCost:
    """The balancer's cost function under ``--mm-balance-cost auto``.

    The engine calls :meth:`for_batch` with each global batch's job-local index on the
    thread that drives it (the exchange thread), before computing that batch's costs,
    so the switch is keyed on the global batch, identical on every rank whatever the
    prefetch. Global batch ``gb`` is Megatron's iteration ``start_iteration + gb + 1``.

    * Until the fit, packs cost their image tokens (``(tokens, 0)`` when two-phase).
    * At iteration ``start + K + 2`` (``K`` = ``config.iterations``): ``collect(first,
      last)`` returns this rank's records of iterations ``start + 2 .. start + K`` (waiting
      until they are complete), ``agree(records, fit)`` gathers every rank's records,
      decides on one rank (:func:`choose_by_replay`) and returns that :class:`FitResult`
      on all (the glue does the collectives), ``on_fit(result)`` logs and saves it. From
      that batch on the chosen model's integer costs are used, or image tokens if the
      replay kept them.
    * A ``saved`` fit (restored beside the checkpoint) is used as is from its
      ``effective_iteration``: a resumed job balances exactly as the job that saved it. A
      saved model made on other features (units) than this job's is refused in one line.
    * ``features`` (:mod:`.features`; default :class:`TileFeatures` of ``config.tokens_per_tile``):
      what the replay reads from a record and which candidates it weighs, the cost of a pack
      (:class:`QwenVLFeatures` on Qwen-VL: one unit per frame, its FLOP-derived model a candidate),
      and the cost before the fit.
    """

    def __init__(self, config: CalibrationConfig, *, start_iteration: int = 0,
                 collect: Callable[[int, int], list], agree: Callable[[list, Callable], FitResult],
                 on_fit: Optional[Callable[[FitResult], None]] = None,
                 saved: Optional[FitResult] = None, features=None):
        self.config = config
        self.start_iteration = int(start_iteration)
        self.collect, self.agree, self.on_fit = collect, agree, on_fit
        self.fit: Optional[FitResult] = saved
        self.components = 2 if config.phases else 1
        self.features = features if features is not None else TileFeatures(config.tokens_per_tile)
        if saved is not None and saved.ok and saved.features and saved.features != self.features.identity:
            raise ValueError(f"the saved cost fit ({FIT_FILE}) prices {saved.features}, this job's costs are "
                             f"{self.features.identity}: remove the file to calibrate again")
        self.switch_iteration = (saved.effective_iteration if saved is not None
                                 else self.start_iteration + config.iterations + 2)

    @property
    def identity(self) -> str:
        c = self.config
        return (f"megatron_mm_balance.auto_cost(iterations={c.iterations}, tokens_per_tile="
                f"{c.tokens_per_tile}, min_records={c.min_records}, r2_floor={c.r2_floor}, "
                f"holdout={c.holdout}, margin={c.margin}"
                + (f", features={self.features.identity}" if not isinstance(self.features, TileFeatures) else "")
                + (", phases)" if c.phases else ")"))

    def iteration_of(self, gb: int) -> int:
        return self.start_iteration + int(gb) + 1

    def for_batch(self, gb: int) -> Callable:
        """The cost function of job-local global batch ``gb`` (may calibrate first)."""
        it = self.iteration_of(gb)
        if self.fit is None and it >= self.switch_iteration:
            self._calibrate(it)
        if self.fit is not None and self.fit.ok and it >= self.fit.effective_iteration:
            return self._model_cost
        return self._token_cost

    def _calibrate(self, it: int) -> None:
        first, last = self.start_iteration + 2, it - 2
        local = self.collect(first, last)
        c = self.config

        def fit(records):
            return choose_by_replay(records, c.replay_options(self.features), first_iteration=first,
                                    last_iteration=last, effective_iteration=it)

        self.fit = self.agree(local, fit)
        if self.on_fit is not None:
            self.on_fit(self.fit)

    def _token_cost(self, pack):
        n = self.features.tokens(pack)
        return (n, 0) if self.components == 2 else n

    def _model_cost(self, pack):
        f = self.features.of_pack(pack)
        c = self.fit.model.integer_costs(FeatureArrays.of([f]), "two-phase" if self.components == 2
                                         else "time")[0]
        return (int(c[0]), int(c[1])) if self.components == 2 else int(c)

    def __call__(self, pack):
        """Outside the engine's per-batch protocol: the cost the latest decision gives."""
        if self.fit is not None and self.fit.ok:
            return self._model_cost(pack)
        return self._token_cost(pack)


def read_fit(path: str) -> FitResult:
    """A fit written by :func:`write_fit`; one-line errors."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such cost-fit file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
    return FitResult.from_json(data, where=path)


def write_fit(result: FitResult, path: str) -> None:
    """Write atomically (a resumed job must never read half a file)."""
    import os
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result.to_json(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
