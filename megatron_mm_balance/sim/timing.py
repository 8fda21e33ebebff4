"""Timing model: milliseconds per pack phase, and the cost of moving a pack.

A pack's phases, in the order a rank runs them:

* vision forward  ``a * sum(n_i) + b * sum(n_i^2) + f * [pack has images]``
  (``n_i``: image tokens of image ``i``; ``b`` is attention inside each image,
  ``f`` a fixed per-pack launch cost);
* language-model forward ``llm_a * L + llm_c * sum(len_j^2)`` where ``L`` is the
  sequence length when padding is computed (fixed-length packed tensors, the
  Megatron default) or the pack's real tokens otherwise, and ``len_j`` the
  lengths of the pack's samples (variable-length attention);
* backward of each part = its ``bwd_fwd_ratio`` x its forward;
* optionally ``noise_cv`` (vision, llm): the relative spread of the measured compute
  around these terms (a fit's residual), applied to each timeline slot with a seeded
  normal draw after the placement, which sees only the terms (default 0: none).

These are the terms of the project's one cost estimator,
:class:`megatron_mm_balance.cost.model.CostModel`: :meth:`TimingModel.cost_model`
converts (``bwd_fwd_ratio`` is the cost model's ``*_backward_ratio``, backward
milliseconds = ratio x the same phase's forward milliseconds), and the simulator
computes every pack's phase times and integer costs through it. What the timing
model adds is the cluster around the compute: the fixed per-step overhead, the
exchange link, and whether padding is computed (the positions the language model
processes).

Moving a pack costs ``bytes_per_image_token * image_tokens + bytes_per_text_token
* text_tokens`` bytes over a link of ``link_gbps`` GB/s, plus ``latency_ms`` per
micro-step in which a rank sends or receives anything; a synchronous exchange also
exposes ``sync_batch_ms`` per global batch (pulling the batch, the all-gather, the
solve: what the overlapped one hides). Image-level vision balancing
(:mod:`.vision_balance`) also sends each moved image token's embedding,
``bytes_per_embedding_token`` (default: 2 bytes x ``llm.hidden``), back after the
encoder and its gradient after the language backward, over the same link.

Files are YAML (or JSON) with the sections ``vision``, ``llm``, ``exchange`` and
optional ``gpu`` and ``step``; see ``configs/timing_*.yaml``. Coefficients may be
given directly or derived from FLOPs:

* vision: ``params_b`` (encoder parameters, billions), ``layers``, ``hidden``,
  ``patches_per_token`` (ViT patches behind one LLM image token, 4 after a 2x2
  merge / pixel shuffle) and ``mfu``:
  ``a = 2 * P * ppt / F``, ``b = 4 * layers * hidden * ppt^2 / F``
  (non-causal attention inside an image of ``n * ppt`` patches);
* llm: ``params_b`` (active parameters), ``layers``, ``hidden``, ``mfu``:
  ``llm_a = 2 * N / F``, ``llm_c = 2 * layers * hidden / F`` (causal attention);

with ``F = gpu.peak_tflops * 1e12 * mfu`` FLOP/s and results in milliseconds.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, asdict, replace
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class TimingError(ValueError):
    """A timing file (or override) is missing, malformed or out of range."""


@dataclass(frozen=True)
class TimingModel:
    name: str = "default"
    vision_ms_per_token: float = 0.0
    vision_ms_per_token_sq: float = 0.0
    vision_ms_per_pack: float = 0.0
    vision_bwd_fwd_ratio: float = 2.0
    llm_ms_per_token: float = 0.0
    llm_ms_per_token_sq: float = 0.0
    llm_bwd_fwd_ratio: float = 2.0
    llm_compute_padding: bool = True
    llm_params_b: float | None = None       # active parameters the LLM terms came from
    step_overhead_ms: float = 0.0           # optimizer + exposed all-reduce, per global batch
    bytes_per_image_token: float = 0.0
    bytes_per_text_token: float = 0.0
    bytes_per_embedding_token: float = 0.0  # an image token's LLM embedding (image balancing)
    link_gbps: float = 1.0                  # GB/s per rank for the pack exchange
    latency_ms: float = 0.0                 # per micro-step with any traffic
    sync_batch_ms: float = 0.0              # synchronous exchange: exposed pull + all-gather + solve
    #: relative spread of a pack's compute around the model (machine noise no placement can
    #: see): each slot's vision time x (1 + cv * z), each micro-step's language phase likewise
    vision_noise_cv: float = 0.0
    llm_noise_cv: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def cost_model(self):
        """The compute terms as the project's cost estimator
        (:class:`~megatron_mm_balance.cost.model.CostModel`, same meaning of every term)."""
        from ..cost.model import CostModel
        return CostModel(vision_ms_per_token=self.vision_ms_per_token,
                         vision_ms_per_token_sq=self.vision_ms_per_token_sq,
                         vision_ms_per_pack=self.vision_ms_per_pack,
                         vision_backward_ratio=self.vision_bwd_fwd_ratio,
                         llm_ms_per_token=self.llm_ms_per_token,
                         llm_ms_per_len_sq=self.llm_ms_per_token_sq,
                         llm_backward_ratio=self.llm_bwd_fwd_ratio)

    def with_llm_params(self, params_b: float) -> "TimingModel":
        """The same model with an LLM of ``params_b`` active parameters (billions).

        The per-token term scales with N; the attention term with N^(2/3) (layers x
        hidden grows like N^(2/3) when depth and width grow together).
        """
        if params_b <= 0:
            raise TimingError(f"LLM size must be > 0 billion parameters, got {params_b}")
        if not self.llm_params_b:
            raise TimingError(
                f"timing model {self.name!r} has no llm.params_b, so it cannot be rescaled"
            )
        s = params_b / self.llm_params_b
        return replace(self, llm_ms_per_token=self.llm_ms_per_token * s,
                       llm_ms_per_token_sq=self.llm_ms_per_token_sq * s ** (2 / 3),
                       llm_params_b=params_b)


def _num(section: dict, key: str, where: str, *, default=None, minimum=0.0):
    v = section.get(key, default)
    if v is None:
        raise TimingError(f"{where}: missing '{key}'")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TimingError(f"{where}.{key} must be a number, got {v!r}")
    if not v >= minimum:
        raise TimingError(f"{where}.{key} must be >= {minimum}, got {v}")
    return float(v)


def _flops_rate(cfg: dict, section: dict, where: str) -> float:
    gpu = cfg.get("gpu") or {}
    peak = _num(gpu, "peak_tflops", "gpu", minimum=1e-9)
    mfu = _num(section, "mfu", where, minimum=1e-9)
    if mfu > 1:
        raise TimingError(f"{where}.mfu must be <= 1, got {mfu}")
    return peak * 1e12 * mfu / 1e3          # FLOPs per millisecond


def model_from_dict(cfg: dict, *, name: str = "timing") -> TimingModel:
    """Build a :class:`TimingModel` from the parsed file (derivations included)."""
    if not isinstance(cfg, dict):
        raise TimingError(f"{name}: expected a mapping at the top level")
    for sec in ("vision", "llm", "exchange"):
        if not isinstance(cfg.get(sec), dict):
            raise TimingError(f"{name}: missing section '{sec}'")
    v, l, x = cfg["vision"], cfg["llm"], cfg["exchange"]
    step = cfg.get("step") or {}
    if not isinstance(step, dict):
        raise TimingError(f"{name}: 'step' must be a mapping")

    # Explicit coefficients win, each on its own; missing ones are derived from FLOPs.
    if "ms_per_token" in v:
        va = _num(v, "ms_per_token", "vision")
    else:
        rate = _flops_rate(cfg, v, "vision")
        ppt = _num(v, "patches_per_token", "vision", default=1.0, minimum=1e-9)
        va = 2 * _num(v, "params_b", "vision") * 1e9 * ppt / rate
    if "ms_per_token_sq" in v or "ms_per_token" in v:
        vb = _num(v, "ms_per_token_sq", "vision", default=0.0)
    else:
        rate = _flops_rate(cfg, v, "vision")
        ppt = _num(v, "patches_per_token", "vision", default=1.0, minimum=1e-9)
        vb = 4 * _num(v, "layers", "vision") * _num(v, "hidden", "vision") * ppt ** 2 / rate
    if "ms_per_token" in l:
        la = _num(l, "ms_per_token", "llm")
    else:
        la = 2 * _num(l, "params_b", "llm") * 1e9 / _flops_rate(cfg, l, "llm")
    if "ms_per_token_sq" in l or "ms_per_token" in l:
        lc = _num(l, "ms_per_token_sq", "llm", default=0.0)
    else:
        lc = 2 * _num(l, "layers", "llm") * _num(l, "hidden", "llm") / _flops_rate(cfg, l, "llm")
    params = l.get("params_b")
    if params is not None:
        params = _num(l, "params_b", "llm", minimum=1e-9)
    padding = l.get("compute_padding", True)
    if not isinstance(padding, bool):
        raise TimingError(f"llm.compute_padding must be true or false, got {padding!r}")
    return TimingModel(
        name=str(cfg.get("name", name)),
        vision_ms_per_token=va,
        vision_ms_per_token_sq=vb,
        vision_ms_per_pack=_num(v, "ms_per_pack", "vision", default=0.0),
        vision_bwd_fwd_ratio=_num(v, "bwd_fwd_ratio", "vision", default=2.0),
        vision_noise_cv=_num(v, "noise_cv", "vision", default=0.0),
        llm_noise_cv=_num(l, "noise_cv", "llm", default=0.0),
        llm_ms_per_token=la,
        llm_ms_per_token_sq=lc,
        llm_bwd_fwd_ratio=_num(l, "bwd_fwd_ratio", "llm", default=2.0),
        llm_compute_padding=padding,
        llm_params_b=params,
        step_overhead_ms=_num(step, "overhead_ms", "step", default=0.0),
        bytes_per_image_token=_num(x, "bytes_per_image_token", "exchange"),
        bytes_per_text_token=_num(x, "bytes_per_text_token", "exchange", default=0.0),
        # BF16 embedding of one image token at the LLM's width, unless given.
        bytes_per_embedding_token=_num(x, "bytes_per_embedding_token", "exchange",
                                       default=2.0 * float(l.get("hidden", 0) or 0)),
        link_gbps=_num(x, "link_gbps", "exchange", minimum=1e-9),
        latency_ms=_num(x, "latency_ms", "exchange", default=0.0),
        sync_batch_ms=_num(x, "sync_batch_ms", "exchange", default=0.0),
    )


def _parse_value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return float(text)
    except ValueError:
        raise TimingError(f"override value must be a number or true/false, got {text!r}") from None


def apply_overrides(cfg: dict, overrides: list[str]) -> dict:
    """``["exchange.link_gbps=40", ...]`` applied to a parsed config (a copy)."""
    cfg = copy.deepcopy(cfg)
    for item in overrides or []:
        if "=" not in item:
            raise TimingError(f"timing override {item!r} must look like section.key=value")
        key, val = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise TimingError(f"timing override key {key!r} must look like section.key")
        sec, k = parts
        if sec != "name" and not isinstance(cfg.get(sec, {}), dict):
            raise TimingError(f"timing override {key!r}: '{sec}' is not a section")
        cfg.setdefault(sec, {})[k] = _parse_value(val)
        # An explicit coefficient wins over a derivation; a derivation input given
        # explicitly must re-derive, so drop the stale explicit coefficient.
        if sec in ("vision", "llm") and k in ("params_b", "mfu", "layers", "hidden",
                                               "patches_per_token"):
            cfg[sec].pop("ms_per_token", None)
            cfg[sec].pop("ms_per_token_sq", None)
        if sec == "gpu":
            for s in ("vision", "llm"):
                if "mfu" in cfg.get(s, {}):
                    cfg[s].pop("ms_per_token", None)
                    cfg[s].pop("ms_per_token_sq", None)
    return cfg


# configs/timing_default.yaml, for installs without the repository's configs/
# (tests check that the two agree; the file carries the derivation).
BUILTIN_DEFAULT = {
    "name": "default",
    "vision": {"ms_per_token": 0.28, "ms_per_token_sq": 0.0, "ms_per_pack": 60,
               "bwd_fwd_ratio": 2.0},
    "llm": {"ms_per_token": 0.0404, "ms_per_token_sq": 0.0, "params_b": 8.0,
            "bwd_fwd_ratio": 2.0, "compute_padding": True},
    "step": {"overhead_ms": 0},
    "exchange": {"bytes_per_image_token": 4704, "bytes_per_text_token": 16,
                 "bytes_per_embedding_token": 8192, "link_gbps": 25, "latency_ms": 1.0},
}


def resolve_timing_path(spec: str | None) -> Path:
    """A file path, or a name ``X`` for ``configs/timing_X.yaml`` (default: ``default``)."""
    if spec is None:
        spec = "default"
    p = Path(spec)
    if p.is_file():
        return p
    if p.exists():
        raise TimingError(f"timing file {spec}: is not a regular file")
    named = CONFIG_DIR / f"timing_{spec.replace('-', '_')}.yaml"
    if os.sep not in spec and named.is_file():
        return named
    names = sorted(q.stem[len("timing_"):] for q in CONFIG_DIR.glob("timing_*.yaml"))
    raise TimingError(f"timing file {spec}: no such file or built-in timing model "
                      f"(built-in: {', '.join(names) or 'none found'})")


def read_timing_config(spec: str | None) -> tuple[dict, str]:
    """Parse the timing file named by ``spec``; returns (raw config, path)."""
    if spec in (None, "default") and not (CONFIG_DIR / "timing_default.yaml").is_file():
        return copy.deepcopy(BUILTIN_DEFAULT), "timing_default (built in)"
    path = resolve_timing_path(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TimingError(f"timing file {path}: cannot read ({exc.__class__.__name__})") from None
    if path.suffix == ".json":
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TimingError(f"timing file {path}: not valid JSON "
                              f"({exc.msg}, line {exc.lineno})") from None
    else:
        import yaml
        try:
            cfg = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise TimingError(f"timing file {path}: not valid YAML{where}") from None
    return cfg, str(path)


def load_timing(spec: str | None = None, overrides: list[str] | None = None) -> TimingModel:
    """Load a timing model by file path or built-in name, with ``section.key=value`` overrides."""
    cfg, path = read_timing_config(spec)
    if not isinstance(cfg, dict):
        raise TimingError(f"timing file {path}: expected a mapping at the top level")
    try:
        return model_from_dict(apply_overrides(cfg, overrides or []),
                               name=Path(path).stem.split(" ")[0])
    except TimingError as exc:
        raise TimingError(f"timing file {path}: {exc}") from None
