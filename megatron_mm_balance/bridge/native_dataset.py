"""``mm-balance make-dataset --format bridge-qwen-vl --mix native-res``: the native-resolution
mix (:mod:`megatron_mm_balance.data.native_res`) as an energon ChatML dataset that
Megatron-Bridge's Qwen-VL task encoder reads.

Every sample's grids come from :func:`~megatron_mm_balance.data.native_res.draw` (a numpy
Generator seeded with ``--seed``); this module draws the pixels and the words:

* an image of grid ``(1, h, w)`` is a synthetic picture of ``16w x 16h`` pixels (JPEG:
  flat colours and a few shapes, a few kilobytes, fast to encode), which the processor
  cuts into exactly that grid (its bounds, :data:`MIN_PIXELS` .. :data:`MAX_PIXELS`,
  keep every size of the mix; the collate's ``qwen_vl_utils`` rounds to 28 px first, which
  returns to the same multiple of 32 px);
* a video of grid ``(t, h, w)`` is ``2t`` frames of ``16w x 16h`` pixels, the part
  ``videos`` of the sample (Bridge's ``ChatMLWebdataset`` field ``videos``: a pickled list of
  videos, each a list of encoded frames; the conversation marks it ``<video>``). Bridge
  0.6's Qwen-VL path reads it: ``QwenVLTaskEncoder`` hands the frames to the processor's
  video processor (``do_sample_frames=False``), which gives ``video_grid_thw = (t, h, w)``
  and one timestamp per temporal patch in the prompt, and ``Qwen3VLModel`` encodes them
  (``pixel_values_videos``);
* text-only samples have no image and no video (empty ``jpgs`` and ``videos`` parts);
* the words: captions, questions and answers about the pictures, and filler sentences, as
  many as the sample's ``text_tokens`` allow.

After the tokenizer is trained, every sample's tokens (text, template, vision tokens, the
videos' timestamps) are counted and checked against the mix's ``max_tokens``, so no sample
is truncated by the step (which would cut image tokens from their features).
"""
from __future__ import annotations

import json
import pickle
import random
import shutil
from dataclasses import replace
from typing import List

import numpy as np

from ..data import make_dataset as md
from ..data import native_res as nr
from . import dataset as bd

#: Processor bounds (pixels): the smallest image of the mix (64 patches) up, and above the
#: largest video (12 frames of 42 x 42 patches), so that no size of the mix is resized.
MIN_PIXELS = 32 * 32
MAX_PIXELS = 6 * 1024 * 1024
#: Sentences of ``_paragraph`` run about this many tokens.
TOKENS_PER_SENTENCE = 13


def _picture(rng: random.Random, h: int, w: int) -> "md.SyntheticImage":
    """A synthetic picture of ``h x w`` patches (``w/2 x h/2`` merge units of 32 px)."""
    img = md._random_image_up_to_12(rng, 1)
    return replace(img, tiles_w=w // nr.MERGE, tiles_h=h // nr.MERGE)


def _jpeg(img: "md.SyntheticImage") -> bytes:
    return md._render_png(img, bd.UNIT, image_format="JPEG")


def _words(rng: random.Random, tokens: int) -> str:
    return md._paragraph(rng, max(1, tokens // TOKENS_PER_SENTENCE))


def _video(rng: random.Random, t: int, h: int, w: int):
    """``2t`` frames of one picture whose shape moves from place to place."""
    base = _picture(rng, h, w)
    frames = []
    for k in range(nr.TEMPORAL_PATCH * t):
        place = md._PLACES[k % len(md._PLACES)]
        shapes = [replace(base.shapes[0], place=place)] + list(base.shapes[1:])
        frames.append(_jpeg(replace(base, shapes=shapes)))
    return base, frames


def render(rng: random.Random, sample: "nr.NativeResSample"):
    """(JPEG bytes of the images, frames of the videos, conversation turns) of one sample."""
    images, videos, marks, about = [], [], [], []
    for (t, h, w), is_video in zip(sample.grids, sample.videos):
        if is_video:
            pic, frames = _video(rng, t, h, w)
            videos.append(frames)
            marks.append("<video>\n")
        else:
            pic = _picture(rng, h, w)
            images.append(_jpeg(pic))
            marks.append("<image>\n")
        about.append(pic)
    budget = sample.text_tokens
    if sample.kind == "text":
        question = f"Tell me about the {rng.choice(md._COLORS)} {rng.choice(md._SHAPES)}."
        answer = _words(rng, budget - 8)
    else:
        question = {"image": "Describe the image.", "document": "Compare the images.",
                    "video": "What happens in the video?"}[sample.kind]
        answer = " ".join(md._describe(p, rng, 2) for p in about)
        room = budget - 4 - len(answer.split()) * 2
        if room >= TOKENS_PER_SENTENCE:
            answer += " " + _words(rng, room)
    turns = [{"from": "human", "value": "".join(marks) + question}, {"from": "gpt", "value": answer}]
    return images, videos, turns


def _count_tokens(tok, sample: "nr.NativeResSample", turns) -> int:
    """The sample's tokens as the processor lays them out (an upper bound: the template's
    role lines and the timestamp of every temporal patch counted generously)."""
    text = sum(len(tok.encode(_plain(t["value"])).ids) for t in turns)
    temporal = sum(t for (t, _, _), v in zip(sample.grids, sample.videos) if v)
    return sample.vision_tokens + text + 16 + 4 * len(sample.grids) + 8 * temporal


def _trim(tok, sample: "nr.NativeResSample", turns, max_tokens: int):
    """Drop the answer's last sentences until the sample fits ``max_tokens``."""
    while _count_tokens(tok, sample, turns) > max_tokens:
        answer = turns[-1]["value"]
        cut = answer.rstrip(".").rfind(". ")
        if cut < 0:
            raise md.MakeDatasetError(f"native-res: a {sample.kind} sample of grids {list(sample.grids)} does "
                                      f"not fit max_tokens {max_tokens} (the step would truncate it)")
        turns = turns[:-1] + [dict(turns[-1], value=answer[:cut + 1])]
    return turns


def make_native_res_dataset(out_dir, samples: int, seed: int, mix: "nr.NativeResMix" = nr.NativeResMix()) -> List[str]:
    """Write the dataset and its processor under ``out_dir``; return the summary lines."""
    out = bd.check_output(out_dir, samples, seed)
    if out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    grids_rng, words = np.random.default_rng(seed), random.Random(seed)
    rendered = {}
    texts: List[str] = []
    for split, n in (("train", samples), ("val", max(md.MIN_SAMPLES, samples // 8))):
        rendered[split] = []
        for s in nr.draw(grids_rng, n, mix):
            images, videos, turns = render(words, s)
            rendered[split].append((s, images, videos, turns))
            texts.extend(_plain(t["value"]) for t in turns)
    # the tokenizer first (trained on every word), then each sample cut to the mix's length
    tok = bd._write_processor(out / "processor", md._tokenizer_corpus(texts) + list(bd._PROMPTS) * 4,
                              min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    shards: List[str] = []
    longest = 0
    for split, rows in rendered.items():
        recs = []
        for i, (s, images, videos, turns) in enumerate(rows):
            turns = _trim(tok, s, turns, mix.max_tokens)
            longest = max(longest, _count_tokens(tok, s, turns))
            recs.append({"__key__": f"{split}_{i:06d}".encode(),
                         "json": json.dumps(turns, sort_keys=True).encode(),
                         "jpgs": pickle.dumps(images, protocol=4),
                         "videos": pickle.dumps(videos, protocol=4)})
        shards += md._write_shards(out, split, recs)
    bd._prepare(out, shards, field_map={"imgs": "jpgs", "videos": "videos", "conversation": "json"})
    train = [row[0] for row in rendered["train"]]
    frames = [p for s in train for p in s.frames]
    spread = ", ".join(f"{k}:{sum(s.kind == k for s in train)}" for k in nr.KINDS)
    return [f"wrote {out}: train {len(train)}, val {len(rendered['val'])} ChatML samples (native-res: {spread})",
            f"train frames: {len(frames)}, {min(frames)}-{max(frames)} patches (mean {np.mean(frames):.0f}); "
            f"patches per sample mean {np.mean([s.patches for s in train]):.0f}; longest sample {longest} "
            f"tokens (max {mix.max_tokens})",
            f"DATA_PATH={out}", f"PROCESSOR={out / 'processor'}"]


def _plain(text: str) -> str:
    return text.replace("<image>\n", "").replace("<video>\n", "")
