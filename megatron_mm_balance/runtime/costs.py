"""The default per-pack cost: the pack's image-token count.

:func:`default_cost_fn` looks, in order, for

1. ``image_tokens``: an int, or a 0-d / 1-element tensor (the energon packer
   records it per pack);
2. ``num_image_tokens``: same forms;
3. ``num_tiles``: an int, or a tensor of per-image tile counts that is summed,
   times ``tokens_per_tile`` (default 256);
4. ``imgs``: a tensor whose first dimension counts tiles, times
   ``tokens_per_tile``.

A pack with none of these keys (text only, or not a dict) costs 0. Costs are
converted to non-negative integers so every rank computes the identical
placement from the all-gathered matrix.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch

DEFAULT_TOKENS_PER_TILE = 256


def _scalar(value, key: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"cost key {key!r} must be a scalar or 1-element tensor, "
                             f"got shape {tuple(value.shape)}")
        return value.reshape(-1)[0].item()
    if isinstance(value, numbers.Number):
        return value
    raise ValueError(f"cost key {key!r} must be a number or tensor, got {type(value).__name__}")


class ImageTokenCost:
    """Callable ``pack -> int``: the image-token count (see module docstring)."""

    def __init__(self, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE):
        if int(tokens_per_tile) <= 0:
            raise ValueError(f"tokens_per_tile must be > 0, got {tokens_per_tile}")
        self.tokens_per_tile = int(tokens_per_tile)

    @property
    def identity(self) -> str:
        """A string every rank must agree on (part of the settings hash)."""
        return f"megatron_mm_balance.image_tokens(tokens_per_tile={self.tokens_per_tile})"

    def __call__(self, pack) -> float:
        if not isinstance(pack, Mapping):
            return 0
        for key in ("image_tokens", "num_image_tokens"):
            if key in pack and pack[key] is not None:
                return _scalar(pack[key], key)
        if "num_tiles" in pack and pack["num_tiles"] is not None:
            tiles = pack["num_tiles"]
            if isinstance(tiles, torch.Tensor):
                tiles = tiles.sum().item()
            elif isinstance(tiles, (list, tuple)):
                tiles = sum(tiles)
            return _scalar(tiles, "num_tiles") * self.tokens_per_tile
        if "imgs" in pack and isinstance(pack["imgs"], torch.Tensor):
            imgs = pack["imgs"]
            return (imgs.shape[0] if imgs.dim() else 0) * self.tokens_per_tile
        return 0


default_cost_fn = ImageTokenCost()


def cost_fn_identity(cost_fn) -> str:
    """Name of a cost function for the cross-rank consistency check."""
    ident = getattr(cost_fn, "identity", None)
    if isinstance(ident, str):
        return ident
    mod = getattr(cost_fn, "__module__", None) or type(cost_fn).__module__
    name = getattr(cost_fn, "__qualname__", None) or type(cost_fn).__qualname__
    return f"{mod}.{name}"


def to_int_cost(value, rank_hint: str = "") -> int:
    """Round a cost to a non-negative int; a clear error for NaN / negative / non-numbers."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"cost_fn returned {value!r}{rank_hint}; expected a number") from None
    if v != v or v in (float("inf"), float("-inf")) or v < 0:
        raise ValueError(f"cost_fn returned {value!r}{rank_hint}; costs must be finite and >= 0")
    return int(round(v))
