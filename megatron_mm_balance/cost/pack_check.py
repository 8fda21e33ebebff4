"""Bad input refused before anything moves: does a pack's image metadata agree with its
tensors, and does the pack fit the sequence?

The balancer reads each pack's image metadata to cost it (:mod:`.pack`); a pack whose
metadata contradicts its tensors would be balanced on a wrong cost and then fail, or be
silently cut, on whichever rank computes it. Megatron-LM's examples/multimodal shows both:

* its LLaVA model splits ``num_tiles`` by the image placeholders it counts in ``tokens``
  (a caption that itself contains ``<image>`` gives one more placeholder than images, and
  ``split_with_sizes`` fails inside the forward pass of the rank that got the pack);
* it truncates the combined text and image embeddings to the language model's sequence
  length without a word, so a pack longer than ``--decoder-seq-length`` (say, packed to a
  longer ``--packing-seq-length``) loses its last samples' tokens.

:func:`pack_problems` lists what is wrong with one pack, in the examples/multimodal batch
form (``tokens``, ``imgs`` ``[tiles, C, H, W]``, ``num_tiles`` per image, ``cu_lengths`` of a
packed sample; a text-only batch carries the dummies ``imgs`` ``[[0]]`` and ``num_tiles``
``[[0]]``); keys a pack does not have are not checked. :class:`PackCheck` is the runtime's
``check_fn``: it raises :class:`BadPack` naming the pack's sample keys. Pure: no torch
import (tensors are read by duck typing, as in :mod:`.pack`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import List, Optional

from .pack import flatten_ints


class BadPack(ValueError):
    """A pack whose image metadata contradicts its tensors, or that does not fit the sequence."""


def _shape(value) -> Optional[tuple]:
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(int(d) for d in shape)


def image_tiles(pack: Mapping) -> Optional[List[int]]:
    """Tiles per image from ``num_tiles`` ([] for a text-only pack: ``num_tiles`` ``[[0]]``
    with Megatron's dummy ``imgs`` of shape ``(1, 1)``, none, or a tensor of no tiles;
    None without the key)."""
    if pack.get("num_tiles") is None:
        return None
    tiles = flatten_ints(pack["num_tiles"], "num_tiles")
    imgs = _shape(pack.get("imgs"))
    no_tiles = imgs is None or imgs == (1, 1) or (len(imgs) > 0 and imgs[0] == 0)
    return [] if tiles == [0] and no_tiles else tiles


def packed_length(pack: Mapping) -> Optional[int]:
    """A packed sample's length in positions (text and image embeddings): the last of its
    ``cu_lengths``; None when it is not packed (no ``cu_lengths``, or the dummy ``[[0]]``)."""
    if pack.get("cu_lengths") is None:
        return None
    cu = flatten_ints(pack["cu_lengths"], "cu_lengths")
    return max(cu) if len(cu) > 1 else None


def pack_problems(pack, *, max_length: Optional[int] = None,
                  image_token_id: Optional[int] = None) -> List[str]:
    """What contradicts itself in ``pack`` (one phrase each; [] when nothing does):

    * a ``num_tiles`` entry below 1 for an image;
    * ``num_tiles`` summing to another count than the tiles ``imgs`` holds;
    * with ``image_token_id``: image placeholders in ``tokens`` other than one per image;
    * with ``max_length``: a packed sample (``cu_lengths``) longer than ``max_length``.
    """
    if not isinstance(pack, Mapping):
        return []
    out = []
    tiles = image_tiles(pack)
    imgs = _shape(pack.get("imgs"))
    if tiles is not None:
        if any(t < 1 for t in tiles):
            out.append(f"num_tiles {tiles} gives an image fewer than 1 tile")
        real_imgs = imgs is not None and len(imgs) == 4
        if real_imgs and sum(tiles) != imgs[0]:
            out.append(f"num_tiles {tiles} sums to {sum(tiles)} tiles but imgs holds {imgs[0]}")
        elif not real_imgs and tiles and imgs is not None:
            out.append(f"num_tiles {tiles} lists {len(tiles)} images but imgs (shape {list(imgs)}) "
                       f"holds no image tiles")
    if image_token_id is not None and tiles is not None and pack.get("tokens") is not None:
        placeholders = sum(1 for t in flatten_ints(pack["tokens"], "tokens") if t == image_token_id)
        if placeholders != len(tiles):
            out.append(f"tokens hold {placeholders} image placeholders (token {image_token_id}) but "
                       f"num_tiles lists {len(tiles)} images")
    length = packed_length(pack)
    if max_length is not None and length is not None and length > max_length:
        out.append(f"the packed sample is {length} positions long (cu_lengths: text and image "
                   f"embeddings), longer than the sequence length {max_length}")
    return out


def sample_keys(pack) -> List[str]:
    """A pack's sample keys from ``__key__`` (a packed sample's keys are joined by commas)."""
    keys = pack.get("__key__") if isinstance(pack, Mapping) else None
    if keys is None:
        return []
    keys = keys if isinstance(keys, (list, tuple)) else [keys]
    return [k for key in keys for k in str(key).split(",") if k]


@dataclass(frozen=True)
class PackCheck:
    """The runtime's ``check_fn`` for examples/multimodal packs: raises :class:`BadPack`
    naming the pack's sample keys and every problem :func:`pack_problems` finds.

    ``max_length``: the language model's sequence length (``--decoder-seq-length``, else
    ``--seq-length``); ``image_token_id``: the tokenizer's id of the image placeholder
    (None: placeholders are not counted)."""

    max_length: Optional[int] = None
    image_token_id: Optional[int] = None

    def __post_init__(self):
        for name in ("max_length", "image_token_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0 or
                                  (name == "max_length" and v == 0)):
                raise ValueError(f"PackCheck: {name} must be a positive int or None, got {v!r}")

    def __call__(self, pack) -> None:
        problems = pack_problems(pack, max_length=self.max_length, image_token_id=self.image_token_id)
        if problems:
            keys = sample_keys(pack)
            raise BadPack(f"mm-balance refuses a pack of samples [{', '.join(keys) or 'no __key__'}]: "
                          + "; ".join(problems))
