"""Whole-sample packing into fixed-length sequences.

``pack_greedy`` is streaming best-fit-decreasing: samples enter a bounded buffer
in stream order; each pack starts with the longest buffered sample and then
repeatedly takes the longest buffered sample that still fits, until nothing
fits. Samples are never split, so an image is never cut at a sequence boundary.

``pack_budget`` is the seed's "2D packing" baseline: the same packer, but a pack
also has an image-token budget and a sample whose images would overflow it is
skipped. It balances image tokens across packs and, as the seed found, leaves
sequences half empty at budgets that balance.

Complexity: O(S log B + S * B) for S samples and buffer size B in the worst case
(list insertion), O(S log B) typical; with a budget, each pick bisects once per
distinct image-token count in the buffer. Deterministic: ties go to the earlier sample.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .traces import Sample

DEFAULT_BUFFER = 1024


class OverlongSampleError(ValueError):
    """A sample is longer than the sequence and ``on_overlong='error'`` was asked for."""


@dataclass(frozen=True)
class Pack:
    """One fixed-length sequence: whole samples, in order."""

    samples: tuple[int, ...]      # indices into the trace
    tokens: int                   # real tokens (<= seq_len)
    images: tuple[int, ...]       # image-token count of every image, in order

    @property
    def image_tokens(self) -> int:
        return sum(self.images)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "image_tokens": self.image_tokens,
                "images": list(self.images), "samples": list(self.samples)}


@dataclass
class PackingResult:
    packs: list[Pack]
    seq_len: int
    samples: int                  # samples read
    dropped: list[int] = field(default_factory=list)   # indices of overlong samples

    @property
    def efficiency(self) -> float:
        """Real tokens / (packs x seq_len)."""
        if not self.packs:
            return 0.0
        return sum(p.tokens for p in self.packs) / (len(self.packs) * self.seq_len)

    def report(self) -> dict:
        img = [p.image_tokens for p in self.packs]
        mean = sum(img) / len(img) if img else 0.0
        return {
            "samples": self.samples,
            "packs": len(self.packs),
            "seq_len": self.seq_len,
            "efficiency": self.efficiency,
            "dropped": len(self.dropped),
            "dropped_indices": self.dropped[:20],
            "samples_per_pack": (self.samples - len(self.dropped)) / len(self.packs) if self.packs else 0.0,
            "image_tokens_per_pack_mean": mean,
            "image_tokens_per_pack_max": max(img, default=0),
            "image_tokens_per_pack_min": min(img, default=0),
        }


def _check_args(seq_len: int, buffer_size: int, on_overlong: str) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if buffer_size < 1:
        raise ValueError(f"buffer size must be >= 1, got {buffer_size}")
    if on_overlong not in ("drop", "error"):
        raise ValueError(f"on_overlong must be 'drop' or 'error', got {on_overlong!r}")


class _ByImageTokens:
    """The buffer's keys grouped by the samples' image tokens, each group sorted: the
    budget packer's query, the longest sample within both a token and an image-token
    room, is a bisection per distinct image-token count (a few dozen on real traces:
    tile multiples) instead of a scan down the whole buffer."""

    def __init__(self):
        self.keys: dict[int, list[tuple[int, int]]] = {}     # image tokens -> sorted keys
        self.values: list[int] = []                          # image-token counts present, ascending

    def add(self, key: tuple[int, int], image_tokens: int) -> None:
        group = self.keys.get(image_tokens)
        if group is None:
            group = self.keys[image_tokens] = []
            bisect.insort(self.values, image_tokens)
        bisect.insort(group, key)

    def remove(self, key: tuple[int, int], image_tokens: int) -> None:
        group = self.keys[image_tokens]
        group.pop(bisect.bisect_left(group, key))
        if not group:
            del self.keys[image_tokens]
            self.values.pop(bisect.bisect_left(self.values, image_tokens))

    def longest_fitting(self, room: int, img_room: int) -> tuple[int, int] | None:
        """Removes and returns the largest key with at most ``room`` tokens and
        ``img_room`` image tokens (None if there is none): the sample a scan down the
        sorted buffer would find first."""
        best, where = None, None
        for value in self.values:
            if value > img_room:
                break
            group = self.keys[value]
            pos = bisect.bisect_right(group, (room, 1)) - 1
            if pos >= 0 and (best is None or group[pos] > best):
                best, where = group[pos], value
        if best is not None:
            self.remove(best, where)
        return best


def pack_greedy(samples: Sequence[Sample] | Iterable[Sample], seq_len: int, *,
                buffer_size: int = DEFAULT_BUFFER, image_budget: int | None = None,
                on_overlong: str = "drop") -> PackingResult:
    """Pack whole samples into sequences of ``seq_len`` tokens (best-fit-decreasing).

    ``image_budget`` (optional) caps each pack's image tokens: the seed's 2D packing.
    A pack always takes its first sample, even one over the budget, so no sample
    is ever lost to the budget. Overlong samples are dropped and reported
    (``on_overlong='drop'``) or raise :class:`OverlongSampleError` naming the index.
    """
    _check_args(seq_len, buffer_size, on_overlong)
    if image_budget is not None and image_budget < 0:
        raise ValueError(f"image budget must be >= 0, got {image_budget}")
    # Buffer sorted ascending by (tokens, -index): the last element is the longest
    # and, among equals, the earliest sample.
    keys: list[tuple[int, int]] = []
    items: dict[tuple[int, int], Sample] = {}
    by_images = None if image_budget is None else _ByImageTokens()
    packs: list[Pack] = []
    dropped: list[int] = []
    n_read = 0

    def emit_one() -> None:
        key = keys.pop()
        first = items.pop(key)
        if by_images is not None:
            by_images.remove(key, first.image_tokens)
        chosen = [-key[1]]
        images = list(first.images)
        room = seq_len - first.tokens
        img_room = None if image_budget is None else image_budget - first.image_tokens
        while room > 0 and keys:
            if by_images is None:
                pos = bisect.bisect_right(keys, (room, 1)) - 1
                if pos < 0:
                    break
                k = keys.pop(pos)
            else:
                k = by_images.longest_fitting(room, img_room)
                if k is None:
                    break
                keys.pop(bisect.bisect_left(keys, k))
            s = items.pop(k)
            chosen.append(-k[1])
            images.extend(s.images)
            room -= s.tokens
            if img_room is not None:
                img_room -= s.image_tokens
        packs.append(Pack(tuple(chosen), seq_len - room, tuple(images)))

    for idx, s in enumerate(samples):
        n_read += 1
        if s.tokens > seq_len:
            if on_overlong == "error":
                raise OverlongSampleError(
                    f"sample {idx} has {s.tokens} tokens, more than the sequence length {seq_len}"
                )
            dropped.append(idx)
            continue
        key = (s.tokens, -idx)
        bisect.insort(keys, key)
        items[key] = s
        if by_images is not None:
            by_images.add(key, s.image_tokens)
        if len(keys) >= buffer_size:
            emit_one()
    while keys:
        emit_one()
    return PackingResult(packs, seq_len, n_read, dropped)


def pack_budget(samples, seq_len: int, image_budget: int, **kw) -> PackingResult:
    """The seed's 2D packing baseline: :func:`pack_greedy` with an image-token budget."""
    return pack_greedy(samples, seq_len, image_budget=image_budget, **kw)
