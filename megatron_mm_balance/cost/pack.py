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

#: where a Qwen-VL micro-batch carries its grids: top level, or inside ``visual_inputs``
#: (Megatron-Bridge's ``GenericVisualInputs``, an object with these attributes, or a dict)
QWEN_VL_GRID_KEYS = ("image_grid_thw", "video_grid_thw")


def _grid_rows(value, key: str) -> list:
    """``[[t, h, w], ...]`` from a tensor / nested list of any leading shape (None: [])."""
    flat = flatten_ints(value, key)
    if len(flat) % 3:
        raise ValueError(f"{key} must hold (t, h, w) triples, got {len(flat)} numbers")
    rows = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    if any(v < 0 for row in rows for v in row):
        raise ValueError(f"{key} must hold non-negative (t, h, w), got {rows}")
    return rows


class QwenVLGridFeatures:
    """Per-image features of a Qwen-VL micro-batch, from its ``image_grid_thw`` / ``video_grid_thw``.

    Qwen-VL encoders see each image (and video) at its native resolution: a grid of
    ``t x h x w`` patches, all of which go through the vision transformer, whose
    attention is over each image's patches (the quadratic term), and
    ``spatial_merge_size**2`` patches are merged into one language-model token.
    ``encoder_tokens`` are ``t*h*w`` per image/video (what the encoder computes on);
    ``lm_tokens`` are ``t*h*w // merge**2`` (what the language model sees). A
    micro-batch without grids (text only) has none.
    """

    def __init__(self, spatial_merge_size: int = 2):
        self.merge = check_tokens_per_tile(spatial_merge_size)

    def grids(self, pack) -> list:
        if not isinstance(pack, Mapping):
            return []
        holder = pack.get("visual_inputs")
        rows = []
        for key in QWEN_VL_GRID_KEYS:
            value = pack.get(key)
            if value is None and holder is not None:
                value = holder.get(key) if isinstance(holder, Mapping) else getattr(holder, key, None)
            rows.extend(_grid_rows(value, key))
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


class QwenVLCost:
    """Callable ``micro-batch -> cost`` for Qwen-VL batches (grids, not tiles).

    Without a cost model: the vision encoder's tokens, ``sum(t*h*w)`` over the
    micro-batch's images and videos (the image-token cost of this convention).
    With one (a :class:`~megatron_mm_balance.cost.CostModel`, ``--mm-balance-cost model``):
    the model on per-image encoder tokens, so its quadratic term is attention within
    each image, and on the per-sample lengths; ``phases=True`` gives ``(vision,
    language)`` for the two-phase solver, as :class:`ModelCost` does.
    """

    def __init__(self, spatial_merge_size: int = 2, *, model=None, phases: bool = False):
        self.features = QwenVLGridFeatures(spatial_merge_size)
        self.model = model
        self.phases = bool(phases) and model is not None
        self.components = 2 if self.phases else 1

    @classmethod
    def from_file(cls, path: str, spatial_merge_size: int = 2, *, phases: bool = False) -> "QwenVLCost":
        from .model import load_cost_file
        return cls(spatial_merge_size, model=load_cost_file(path), phases=phases)

    @property
    def identity(self) -> str:
        model = "" if self.model is None else f", model={self.model.to_json()}"
        return (f"megatron_mm_balance.qwen_vl_cost(merge={self.features.merge}{model}"
                + (", phases)" if self.phases else ")"))

    def __call__(self, pack):
        if not isinstance(pack, Mapping):
            return (0, 0) if self.phases else 0
        encoder = self.features.encoder_tokens(pack)
        if self.model is None:
            return int(sum(encoder))
        from .model import PackFeatures
        f = PackFeatures(tuple(encoder), self.features.lengths(pack))
        return self.model.phase_costs(f) if self.phases else self.model.cost(f)
