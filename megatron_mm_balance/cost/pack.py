"""What a pack costs: the one image-token convention, shared by the runtime and the glue.

:func:`image_counts` reads the per-image token counts of a pack (or of a
micro-batch of several packs), looking, in order, for

1. ``image_token_counts``: one count per image (our energon task encoder
   records it);
2. ``image_tokens``: one count per pack (the same encoder), or a scalar;
3. ``num_image_tokens``: same forms;
4. ``num_tiles``: tiles per image, times ``tokens_per_tile`` (stock
   examples/multimodal batches carry only this);
5. ``imgs``: a tensor whose first dimension counts tiles, times
   ``tokens_per_tile``.

Every value may be a number, a tensor of any shape, or a (nested) list/tuple:
all of it is summed, so a micro-batch of several packs costs the sum of its
packs. A pack with none of these keys (text only) has no images.

:class:`ImageTokenCost` is the default cost (their sum, as an int);
:class:`ModelCost` feeds the same counts, and the per-sample lengths, to a
calibrated :class:`~megatron_mm_balance.cost.model.CostModel`. Costs are converted to
non-negative integers so every rank computes the identical placement from the
all-gathered matrix.

This module imports no torch: tensors are read by duck typing (``tolist``,
``shape``), so the energon task encoder and the pure CLI can use it.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Optional

DEFAULT_TOKENS_PER_TILE = 256

#: keys holding token counts directly, most detailed first (then num_tiles, imgs)
_COUNT_KEYS = ("image_token_counts", "image_tokens", "num_image_tokens")


def flatten_ints(value, key: str = "value") -> list:
    """A scalar, tensor or nested list/tuple of counts as a flat list of ints (None: [])."""
    if value is None:
        return []
    if hasattr(value, "tolist"):          # torch / numpy, any shape (0-d gives a scalar)
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(flatten_ints(v, key))
        return out
    if isinstance(value, numbers.Number) and not isinstance(value, complex):
        return [int(round(value))]
    raise ValueError(f"cost key {key!r} must hold numbers, got {type(value).__name__}")


def check_tokens_per_tile(tokens_per_tile) -> int:
    """``tokens_per_tile`` as an int > 0; a one-line error otherwise."""
    try:
        tpt = int(tokens_per_tile)
    except (TypeError, ValueError):
        tpt = 0
    if tpt <= 0 or tpt != tokens_per_tile:
        raise ValueError(f"tokens_per_tile must be an int > 0, got {tokens_per_tile!r}")
    return tpt


def image_counts(pack, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE) -> list:
    """Per-image token counts of a pack or micro-batch (see module docstring); [] if it has none."""
    if not isinstance(pack, Mapping):
        raise TypeError(f"mm-balance: micro-batch is a {type(pack).__name__}, expected a dict")
    for key in _COUNT_KEYS:
        if pack.get(key) is not None:
            return flatten_ints(pack[key], key)
    if pack.get("num_tiles") is not None:
        return [t * tokens_per_tile for t in flatten_ints(pack["num_tiles"], "num_tiles")]
    shape = getattr(pack.get("imgs"), "shape", None)
    if shape is not None:
        return [int(shape[0]) * tokens_per_tile] if len(shape) else []
    return []


class ImageTokenCost:
    """Callable ``pack -> int``: the pack's image tokens (see module docstring).

    ``--mm-balance-cost image-tokens`` and the runtime's default. A pack that is
    not a dict, or has no image keys (text only), costs 0.
    """

    def __init__(self, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE):
        self.tokens_per_tile = check_tokens_per_tile(tokens_per_tile)

    @property
    def identity(self) -> str:
        """A string every rank must agree on (part of the settings hash)."""
        return f"megatron_mm_balance.image_tokens(tokens_per_tile={self.tokens_per_tile})"

    def __call__(self, pack) -> int:
        if not isinstance(pack, Mapping):
            return 0
        return int(sum(image_counts(pack, self.tokens_per_tile)))


class ModelCost:
    """``--mm-balance-cost model``: a calibrated :class:`~megatron_mm_balance.cost.model.CostModel`
    on per-image tokens (:func:`image_counts`) and per-sample lengths (from ``cu_lengths``)."""

    def __init__(self, path: str, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE, *,
                 phases: bool = False):
        from .model import load_cost_file
        self.model = load_cost_file(path)
        self.tokens_per_tile = check_tokens_per_tile(tokens_per_tile)
        #: True: ``(vision, language)`` microseconds per pack, for the two-phase solver
        self.phases = bool(phases)
        self.components = 2 if self.phases else 1

    @property
    def identity(self) -> str:
        return (f"megatron_mm_balance.model_cost({self.model.to_json()}, {self.tokens_per_tile}"
                + (", phases)" if self.phases else ")"))

    def __call__(self, pack) -> int:
        if not isinstance(pack, Mapping):
            return (0, 0) if self.phases else 0
        f = pack_features(pack, self.tokens_per_tile)
        if self.phases:
            return self.model.phase_costs(f)
        return self.model.cost(f)


def pack_features(pack, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE):
    """The cost model's features of a pack: per-image tokens (:func:`image_counts`) and
    per-sample lengths (from ``cu_lengths``; the pack's positions are their sum)."""
    from .model import PackFeatures
    images = tuple(image_counts(pack, tokens_per_tile))
    cu = flatten_ints(pack.get("cu_lengths"), "cu_lengths")
    lengths = tuple(b - a for a, b in zip(cu, cu[1:]) if b > a)
    return PackFeatures(images, lengths)


default_cost_fn = ImageTokenCost()


def cost_fn_identity(cost_fn) -> str:
    """Name of a cost function for the cross-rank consistency check."""
    ident = getattr(cost_fn, "identity", None)
    if isinstance(ident, str):
        return ident
    mod = getattr(cost_fn, "__module__", None) or type(cost_fn).__module__
    name = getattr(cost_fn, "__qualname__", None) or type(cost_fn).__qualname__
    return f"{mod}.{name}"


def to_int_costs(value, components: int, rank_hint: str = "") -> list:
    """A cost of ``components`` numbers (1: a scalar; 2: ``(vision, language)``) as a
    list of non-negative ints; a clear error for the wrong count."""
    if components == 1:
        return [to_int_cost(value, rank_hint)]
    if not isinstance(value, (list, tuple)) or len(value) != components:
        raise ValueError(f"cost_fn returned {value!r}{rank_hint}; expected {components} numbers")
    return [to_int_cost(v, rank_hint) for v in value]


def to_int_cost(value, rank_hint: str = "") -> int:
    """Round a cost to a non-negative int; a clear error for NaN / negative / non-numbers."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"cost_fn returned {value!r}{rank_hint}; expected a number") from None
    if v != v or v in (float("inf"), float("-inf")) or v < 0:
        raise ValueError(f"cost_fn returned {value!r}{rank_hint}; costs must be finite and >= 0")
    return int(round(v))


# --------------------------------------------------------------------------- Qwen-VL grids

#: the visual fields of a Megatron-Bridge 0.6.x Qwen-VL micro-batch, at its top level or
#: inside ``visual_inputs`` (``GenericVisualInputs``, or a dict): grid key -> its pixels' key
QWEN_VL_GRID_KEYS = {"image_grid_thw": "pixel_values", "video_grid_thw": "pixel_values_videos"}
QWEN_VL_RELEASE = ("Megatron-Bridge 0.6.x: visual_inputs = GenericVisualInputs(pixel_values, "
                   "pixel_values_videos, image_grid_thw, video_grid_thw)")


class QwenVLBatchError(ValueError):
    """A Qwen-VL micro-batch whose vision input cannot be read (never costed as 0)."""


def _grid_rows(value, key: str) -> list:
    """``[[t, h, w], ...]`` from a tensor / nested list of any leading shape (None: [])."""
    try:
        flat = flatten_ints(value, key)
    except ValueError as exc:
        raise QwenVLBatchError(f"mm-balance: {exc} ({QWEN_VL_RELEASE})") from None
    if len(flat) % 3:
        raise QwenVLBatchError(f"mm-balance: {key} must hold (t, h, w) triples, got {len(flat)} numbers")
    rows = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    if any(v < 0 for row in rows for v in row):
        raise QwenVLBatchError(f"mm-balance: {key} must hold non-negative (t, h, w), got {rows}")
    return rows


def _pixel_rows(value, key: str):
    """Patch rows of a Qwen-VL pixel tensor (``[patches, C*T*P*P]``, or ``[B, patches, D]``)."""
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) not in (2, 3):
        raise QwenVLBatchError(f"mm-balance: {key} has shape {None if shape is None else tuple(shape)}; "
                               f"expected patch rows [patches, channels*patch volume] ({QWEN_VL_RELEASE})")
    return int(shape[0]) * (int(shape[1]) if len(shape) == 3 else 1)


def _found(pack, holder) -> str:
    """The keys a micro-batch has (and its ``visual_inputs``' non-empty fields), for errors."""
    keys = sorted(str(k) for k in pack)
    if holder is None:
        return f"keys {keys}"
    if isinstance(holder, Mapping):
        inner = sorted(str(k) for k, v in holder.items() if v is not None)
    else:
        inner = sorted(k for k, v in vars(holder).items() if v is not None) if hasattr(holder, "__dict__") else []
    return f"keys {keys}, visual_inputs ({type(holder).__name__}) with {inner}"


class QwenVLGridFeatures:
    """What a Qwen-VL micro-batch's vision input is, from its ``image_grid_thw`` / ``video_grid_thw``.

    Qwen-VL encoders see each image (and video) at its native resolution: a grid of
    ``t x h x w`` patches, all of which go through the vision transformer, attention
    inside each frame (:mod:`.frames`), and ``spatial_merge_size**2`` patches merged
    into one language-model token. ``encoder_tokens`` are ``t*h*w`` per image/video
    (what the encoder computes on); ``lm_tokens`` are ``t*h*w // merge**2`` (what the
    language model sees). A micro-batch with neither pixels nor grids (text only) has
    none; one whose vision input cannot be read is a :class:`QwenVLBatchError` naming the
    keys it has: a grid that is not numbers, pixels without their grid, or pixel rows
    that are not the grids' ``sum(t*h*w)``.
    """

    def __init__(self, spatial_merge_size: int = 2):
        self.merge = check_tokens_per_tile(spatial_merge_size)

    @staticmethod
    def _get(pack, holder, key):
        value = pack.get(key)
        if value is None and holder is not None:
            value = holder.get(key) if isinstance(holder, Mapping) else getattr(holder, key, None)
        return value

    def grids(self, pack) -> list:
        """Every image's and video's ``[t, h, w]`` (images first); [] for text only."""
        if not isinstance(pack, Mapping):
            raise QwenVLBatchError(f"mm-balance: a Qwen-VL micro-batch is a {type(pack).__name__}, expected "
                                   f"a dict ({QWEN_VL_RELEASE})")
        holder = pack.get("visual_inputs")
        if holder is not None and not isinstance(holder, Mapping) and not any(
                hasattr(holder, k) for kv in QWEN_VL_GRID_KEYS.items() for k in kv):
            raise QwenVLBatchError(f"mm-balance: cannot read the Qwen-VL grids of a micro-batch with "
                                   f"{_found(pack, holder)}; expected {QWEN_VL_RELEASE}")
        rows = []
        for grid_key, pixel_key in QWEN_VL_GRID_KEYS.items():
            grid, pixels = self._get(pack, holder, grid_key), self._get(pack, holder, pixel_key)
            these = _grid_rows(grid, grid_key)
            if pixels is not None:
                if grid is None:
                    raise QwenVLBatchError(f"mm-balance: {pixel_key} without {grid_key} in a micro-batch with "
                                           f"{_found(pack, holder)}; expected {QWEN_VL_RELEASE}")
                patches = sum(t * h * w for t, h, w in these)
                if _pixel_rows(pixels, pixel_key) != patches:
                    raise QwenVLBatchError(
                        f"mm-balance: {pixel_key} has {_pixel_rows(pixels, pixel_key)} patch rows but "
                        f"{grid_key} sums to {patches} (t*h*w) in a micro-batch with {_found(pack, holder)}")
            rows.extend(these)
        return rows

    def encoder_tokens(self, pack) -> list:
        return [t * h * w for t, h, w in self.grids(pack)]

    def lm_tokens(self, pack) -> list:
        return [t * h * w // (self.merge * self.merge) for t, h, w in self.grids(pack)]

    @staticmethod
    def lengths(pack) -> tuple:
        """Per-sample token counts: the rows of ``attention_mask`` (else of ``input_ids``)."""
        if not isinstance(pack, Mapping):
            return ()
        mask = pack.get("attention_mask")
        if mask is not None and hasattr(mask, "sum") and getattr(mask, "dim", lambda: 0)() == 2:
            return tuple(int(v) for v in mask.sum(-1).tolist())
        ids = pack.get("input_ids", pack.get("tokens"))
        shape = getattr(ids, "shape", None)
        return tuple([int(shape[1])] * int(shape[0])) if shape is not None and len(shape) == 2 else ()

    @staticmethod
    def positions(pack) -> Optional[int]:
        """The tokens the language model computes (``input_ids``' size, padding included)."""
        ids = pack.get("input_ids", pack.get("tokens")) if isinstance(pack, Mapping) else None
        shape = getattr(ids, "shape", None)
        return int(shape[0]) * int(shape[1]) if shape is not None and len(shape) == 2 else None

    def pack_features(self, pack):
        """The per-frame :class:`~megatron_mm_balance.cost.model.PackFeatures` of a micro-batch."""
        from .frames import grid_pack_features
        return grid_pack_features(self.grids(pack), self.lengths(pack), self.positions(pack))


class QwenVLCost:
    """Callable ``micro-batch -> cost`` for Qwen-VL batches (grids, not tiles).

    Without a cost model: the vision encoder's tokens, ``sum(t*h*w)`` over the
    micro-batch's images and videos (the image-token cost of this convention, the
    default). With one (a :class:`~megatron_mm_balance.cost.CostModel`: a calibrated cost
    file, or the FLOP-derived model of :func:`~megatron_mm_balance.cost.flops.vision_cost_model`):
    the model on the per-frame features (:mod:`.frames`: its quadratic term is attention
    inside each frame) and the per-sample lengths; ``phases=True`` gives ``(vision,
    language)`` for the two-phase solver, as :class:`ModelCost` does. A micro-batch whose
    vision input cannot be read raises :class:`QwenVLBatchError` (the runtime stops every
    rank with it); text only costs 0 (plus its language terms).
    """

    def __init__(self, spatial_merge_size: int = 2, *, model=None, phases: bool = False, source: str = ""):
        self.features = QwenVLGridFeatures(spatial_merge_size)
        self.model = model
        self.phases = bool(phases) and model is not None
        self.components = 2 if self.phases else 1
        #: where the model came from (``flops``: derived from the configs), for the identity
        self.source = source

    @classmethod
    def from_file(cls, path: str, spatial_merge_size: int = 2, *, phases: bool = False) -> "QwenVLCost":
        from .model import load_cost_file
        return cls(spatial_merge_size, model=load_cost_file(path), phases=phases)

    @property
    def identity(self) -> str:
        model = "" if self.model is None else f", model={self.model.to_json()}"
        source = f", {self.source}" if self.source else ""
        return (f"megatron_mm_balance.qwen_vl_cost(merge={self.features.merge}{model}{source}"
                + (", phases)" if self.phases else ")"))

    def __call__(self, pack):
        if self.model is None:
            return int(sum(self.features.encoder_tokens(pack)))
        f = self.features.pack_features(pack)
        return self.model.phase_costs(f) if self.phases else self.model.cost(f)


class QwenVLHeaviestFrameCost:
    """Callable ``micro-batch -> cost``: the cost of its heaviest frame, ``frame_cost(h*w)``
    over every frame of its grids (a video's temporal patches apart); 0 for text only.

    The pack cost of ``mm_balance.vision=images`` (``image_pack_cost=heaviest-frame``): the
    frames of a micro-step are spread across the data-parallel group afterwards, so what a
    micro-step's vision phase cannot go below is its mean or its heaviest frame, and only the
    second depends on where the packs go. Placing packs on their heaviest frame puts the big
    frames of a global batch into the same micro-steps, where they balance one another, and
    leaves the frame exchange the rest (docs/notes/2026-12-03-whole-packs-floor.md)."""

    components = 1

    def __init__(self, spatial_merge_size: int, frame_cost, *, name: str = ""):
        self.features = QwenVLGridFeatures(spatial_merge_size)
        self.frame_cost = frame_cost
        #: what ``frame_cost`` is (``alpha=...``), for the identity every rank shares
        self.name = name

    @property
    def identity(self) -> str:
        return f"megatron_mm_balance.qwen_vl_heaviest_frame(merge={self.features.merge}, {self.name})"

    def __call__(self, pack) -> int:
        from .frames import grid_frames
        return int(max((self.frame_cost(p) for p in grid_frames(self.features.grids(pack))), default=0))
