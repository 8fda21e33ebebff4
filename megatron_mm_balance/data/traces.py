"""Samples and trace files: the data model every other module consumes.

A *sample* is what one training example costs the model: its total LLM tokens
(text + image tokens) and the image-token count of each of its images. Two file
formats are read:

* JSON Lines, one sample per line: ``{"tokens": int, "images": [int, ...]}``
  (``images`` optional, empty or absent for text-only samples);
* the per-sample JSON arrays published with OmniBal (``../shared/traces/``):
  ``[{"vit_num": tiles, "token_num": total_tokens, ...}, ...]`` where every tile
  becomes ``tokens_per_tile`` image tokens.

Errors name the file, the line (or array index) and the problem, so that a bad
trace never produces a traceback in the CLI.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Iterable, Sequence

# The one image-token convention (tokens per tile of an OmniBal trace's ``vit_num``).
from ..cost.pack import DEFAULT_TOKENS_PER_TILE
from .jsonl import json_lines


class TraceError(ValueError):
    """A trace file (or an in-memory sample) is malformed."""


@dataclass(frozen=True)
class Sample:
    """One training example: total LLM tokens and the image tokens of each image."""

    tokens: int
    images: tuple[int, ...] = field(default_factory=tuple)

    @property
    def image_tokens(self) -> int:
        return sum(self.images)

    @property
    def text_tokens(self) -> int:
        return self.tokens - self.image_tokens


def make_sample(tokens, images=(), *, where: str = "sample") -> Sample:
    """Validate and build a :class:`Sample`; ``where`` names it in error messages."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TraceError(f"{where}: 'tokens' must be an integer, got {tokens!r}")
    if tokens < 0:
        raise TraceError(f"{where}: 'tokens' must be >= 0, got {tokens}")
    if images is None:
        images = ()
    if not isinstance(images, (list, tuple)):
        raise TraceError(f"{where}: 'images' must be a list of integers, got {images!r}")
    for n in images:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TraceError(f"{where}: image token counts must be integers, got {n!r}")
        if n < 0:
            raise TraceError(f"{where}: image token counts must be >= 0, got {n}")
    images = tuple(images)
    if sum(images) > tokens:
        raise TraceError(
            f"{where}: image tokens ({sum(images)}) exceed total tokens ({tokens})"
        )
    return Sample(tokens, images)


def _from_tiles(vit_num, token_num, tokens_per_tile: int, where: str) -> Sample:
    if isinstance(vit_num, bool) or not isinstance(vit_num, int) or vit_num < 0:
        raise TraceError(f"{where}: 'vit_num' must be a non-negative integer, got {vit_num!r}")
    images = (tokens_per_tile,) * vit_num
    return make_sample(token_num, images, where=where)


def _parse_record(rec, tokens_per_tile: int, where: str) -> Sample:
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "tokens" in rec:
        return make_sample(rec["tokens"], rec.get("images", ()), where=where)
    if "token_num" in rec:
        return _from_tiles(rec.get("vit_num", 0), rec["token_num"], tokens_per_tile, where)
    raise TraceError(f"{where}: missing 'tokens' (or 'token_num')")


def parse_trace_text(text: str, *, name: str = "<trace>",
                     tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE) -> list[Sample]:
    """Parse trace text in either supported format (detected from the first character)."""
    if tokens_per_tile < 1:
        raise TraceError(f"tokens per tile must be >= 1, got {tokens_per_tile}")
    stripped = text.lstrip()
    if not stripped:
        raise TraceError(f"{name}: trace is empty")
    if stripped[0] == "[":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return [_parse_record(r, tokens_per_tile, f"{name}[{i}]") for i, r in enumerate(rows)]
    samples = []
    for lineno, rec in json_lines(text.splitlines(), name, TraceError):
        samples.append(_parse_record(rec, tokens_per_tile, f"{name}:{lineno}"))
    if not samples:
        raise TraceError(f"{name}: trace has no samples")
    return samples


def load_trace(path: str, *, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE) -> list[Sample]:
    """Read a trace file (JSON Lines or an OmniBal-style JSON array)."""
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such file")
    if os.path.isdir(path):
        raise TraceError(f"{path}: is a directory, expected a trace file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a UTF-8 text file") from None
    return parse_trace_text(text, name=path, tokens_per_tile=tokens_per_tile)


def write_trace(path: str, samples: Iterable[Sample]) -> None:
    """Write samples as JSON Lines (the native trace format)."""
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            rec = {"tokens": s.tokens}
            if s.images:
                rec["images"] = list(s.images)
            f.write(json.dumps(rec) + "\n")


BUNDLED_TRACES = {"ai2d": "ai2d_tiles.json", "chartqa": "chartqa_tiles.json"}


def load_bundled(name: str, *, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE) -> list[Sample]:
    """One of the real traces shipped with the package (``ai2d`` or ``chartqa``).

    They are compact copies of the OmniBal per-sample statistics (Apache-2.0):
    AI2D (12,413 samples, 1/3/5 tiles) and ChartQA (18,317 samples, mostly 5 tiles).
    """
    if name not in BUNDLED_TRACES:
        raise TraceError(f"unknown bundled trace {name!r}; choose from {sorted(BUNDLED_TRACES)}")
    data = json.loads(
        resources.files("megatron_mm_balance").joinpath("data", BUNDLED_TRACES[name]).read_text()
    )
    return [_from_tiles(v, t, tokens_per_tile, f"{name}[{i}]") for i, (v, t) in enumerate(data["rows"])]


def summarize(samples: Sequence[Sample]) -> dict:
    """Counts that describe a trace: samples, tokens, image share, text-only share."""
    n = len(samples)
    tokens = sum(s.tokens for s in samples)
    image = sum(s.image_tokens for s in samples)
    return {
        "samples": n,
        "tokens": tokens,
        "image_tokens": image,
        "image_token_share": image / tokens if tokens else 0.0,
        "text_only_share": sum(1 for s in samples if not s.images) / n if n else 0.0,
        "max_tokens": max((s.tokens for s in samples), default=0),
    }
