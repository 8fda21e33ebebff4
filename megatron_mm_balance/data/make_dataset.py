"""``mm-balance make-dataset``: a small synthetic VLM dataset and tokenizer for examples/multimodal.

Writes, under ``OUT_DIR``, everything Megatron-LM's ``examples/multimodal/train.py``
needs to train without downloading anything:

* ``captions/``: an energon-prepared WebDataset of ``CaptioningSample`` (one PNG and
  one caption per sample);
* ``conversations/``: an energon-prepared WebDataset of ``SimilarityInterleavedSample``
  (one to three images and a multi-turn human/gpt conversation per sample), the form
  the example's ``encode_llava_sft`` reads;
* ``dataset.yaml``: an energon ``MetadatasetV2``, the ``--data-path``: train blends the
  two, val is the captions alone (Megatron accepts one validation loader);
* ``tokenizer/``: a byte-level BPE Hugging Face fast tokenizer trained on the
  dataset's text, with the ChatML/Qwen special tokens (``<|im_start|>``,
  ``<|im_end|>``, ``<|endoftext|>``): ``--tokenizer-type MultimodalTokenizer
  --tokenizer-model OUT_DIR/tokenizer --tokenizer-prompt-format qwen2p5``. It does
  not contain Megatron's image token ``<image>``: ``MultimodalTokenizer`` adds it.

Images are sized in whole tiles of ``tile_size`` pixels (default 56), so that the
example's dynamic tiling (``--use-tiling --max-num-tiles 4 --img-h 56 --img-w 56``)
cuts 1, 2, 3 or 4 tiles from them: image-token counts differ per sample and per pack,
which is what the balancer acts on. Light samples (one tile, long text) and
image-heavy ones (four tiles, short text) are both common.

``--mix vision-heavy`` (the real-speed benchmark's data, ``configs/megatron/vision_heavy_cpu.sh``):
images of 1 to 12 tiles (``--max-num-tiles 12``), multi-image documents of 2-4 images,
and about 30% text-only conversations, so packs range from no image at all to
hundreds of image tokens. The default mix is unchanged by it (same seed, same bytes).

The output is a function of the seed alone: same seed, byte-identical files (tar
headers carry no times or owners, energon's index is built by one worker, and the
dataset UUID energon would draw at random is derived from the shard contents).
PIL, ``tokenizers`` and megatron-energon are imported only when a dataset is made.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import shutil
import tarfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

#: The prompt format the tokenizer is built for (``--tokenizer-prompt-format``).
PROMPT_FORMAT = "qwen2p5"
#: ChatML / Qwen2.5 special tokens; ``<|endoftext|>`` pads, ``<|im_end|>`` ends a turn.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
#: The chat template of Megatron's qwen2p0/qwen2p5 prompt formats (no forced system message).
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
#: Image shapes, in tiles (width, height), for each tile count the example's tiling
#: (``find_closest_aspect_ratio``, max 4 tiles) cuts from an image of that shape.
SHAPES_BY_TILES: Dict[int, Tuple[Tuple[int, int], ...]] = {
    1: ((1, 1),),
    2: ((2, 1), (1, 2)),
    3: ((3, 1), (1, 3)),
    4: ((2, 2), (4, 1), (1, 4)),
}
#: ``--mix vision-heavy``: shapes of 1 to 12 tiles (``--max-num-tiles 12``); every shape of
#: area <= 12 is cut into exactly its own tiles by the example's tiling.
SHAPES_UP_TO_12: Dict[int, Tuple[Tuple[int, int], ...]] = {
    n: tuple((w, n // w) for w in range(1, n + 1) if n % w == 0) for n in range(1, 13)
}
MIXES = ("default", "vision-heavy")
SAMPLES_PER_SHARD = 64
DEFAULT_SAMPLES = 512
DEFAULT_SEED = 1234
DEFAULT_TILE_SIZE = 56
#: Share of training samples that are multi-turn conversations (the rest are captions).
CONVERSATION_SHARE = 0.2
#: Enough samples of each kind in each split for a few data-parallel ranks to get some.
MIN_SAMPLES, MIN_CONVERSATIONS = 16, 4
#: ``--format``: the examples/multimodal form (default) or Megatron-Bridge's Qwen-VL form.
FORMATS = ("megatron-multimodal", "bridge-qwen-vl")

_COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black", "gray", "cyan")
_RGB = {"red": (200, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 200), "yellow": (230, 210, 50),
        "purple": (130, 60, 170), "orange": (240, 140, 30), "white": (245, 245, 245),
        "black": (15, 15, 15), "gray": (128, 128, 128), "cyan": (40, 200, 210)}
_SHAPES = ("square", "circle", "triangle", "stripe", "dot")
_PLACES = ("top left", "top right", "bottom left", "bottom right", "center", "left edge", "right edge")
_FILLER = ("The background is plain and the colors are flat.",
           "Nothing else appears in the picture.",
           "The shapes do not overlap and their edges are sharp.",
           "It looks like a simple diagram drawn for a test.",
           "The light is even across the whole picture.",
           "There is no text, person or animal in view.",
           "The composition is balanced between both halves.",
           "A thin margin surrounds every object.")


class MakeDatasetError(ValueError):
    """A bad argument or output directory: one line for the user."""


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    place: str


@dataclass
class SyntheticImage:
    """One image: its size in tiles, background and the shapes drawn on it."""
    tiles_w: int
    tiles_h: int
    background: str
    shapes: List[Shape]

    @property
    def tiles(self) -> int:
        return self.tiles_w * self.tiles_h


@dataclass
class Summary:
    """What ``make_dataset`` wrote: paths and per-split statistics."""
    out_dir: Path
    data_path: Path
    tokenizer_dir: Path
    prompt_format: str
    tile_size: int = DEFAULT_TILE_SIZE
    max_num_tiles: int = 4
    text_only: int = 0                                                # text-only samples (train)
    counts: Dict[str, Dict[str, int]] = field(default_factory=dict)   # split -> kind -> samples
    tiles: Dict[int, int] = field(default_factory=dict)               # tiles per image -> images (train)
    images_per_sample: Dict[int, int] = field(default_factory=dict)   # images per sample -> samples (train)

    def lines(self) -> List[str]:
        train, val = self.counts.get("train", {}), self.counts.get("val", {})
        tiles = ", ".join(f"{k}:{v}" for k, v in sorted(self.tiles.items()))
        imgs = ", ".join(f"{k}:{v}" for k, v in sorted(self.images_per_sample.items()))
        return [
            f"wrote {self.out_dir}: train {train.get('captions', 0)} captions + "
            f"{train.get('conversations', 0)} conversations, val {val.get('captions', 0)} + "
            f"{val.get('conversations', 0)}",
            f"train images by tiles (tiles:images): {tiles}; samples by images: {imgs}"
            + (f" ({self.text_only} text-only)" if self.text_only else ""),
            f"DATA_PATH={self.data_path}",
            f"TOKENIZER_MODEL={self.tokenizer_dir}",
            f"TOKENIZER_PROMPT_FORMAT={self.prompt_format}",
            f"use: --data-path $DATA_PATH --tokenizer-type MultimodalTokenizer --tokenizer-model "
            f"$TOKENIZER_MODEL --tokenizer-prompt-format {self.prompt_format} --use-tiling "
            f"--max-num-tiles {self.max_num_tiles} --img-h {self.tile_size} --img-w {self.tile_size}",
        ]


# ----------------------------------------------------------------------------------------
# content

def _random_image(rng: random.Random, tiles: int) -> SyntheticImage:
    tw, th = rng.choice(SHAPES_BY_TILES[tiles])
    n = rng.randint(1, 1 + tiles)
    bg = rng.choice(_COLORS)
    shapes = [Shape(rng.choice(_SHAPES), rng.choice([c for c in _COLORS if c != bg]), rng.choice(_PLACES))
              for _ in range(n)]
    return SyntheticImage(tw, th, bg, shapes)


def _describe(img: SyntheticImage, rng: random.Random, sentences: int) -> str:
    parts = [f"A {img.background} picture with {len(img.shapes)} "
             f"{'shape' if len(img.shapes) == 1 else 'shapes'}."]
    for s in img.shapes:
        parts.append(f"There is a {s.color} {s.kind} at the {s.place}.")
    while len(parts) < sentences:
        parts.append(rng.choice(_FILLER))
    return " ".join(parts[:max(sentences, 1 + len(img.shapes))])


def _tiles_for_caption(rng: random.Random) -> int:
    # light (1 tile) and image-heavy (4 tiles) samples are both common
    return rng.choices((1, 2, 3, 4), weights=(35, 20, 15, 30))[0]


def _caption_sample(rng: random.Random) -> Tuple[List[SyntheticImage], str]:
    tiles = _tiles_for_caption(rng)
    img = _random_image(rng, tiles)
    # few tiles -> long captions, many tiles -> short ones: packs differ in image share
    sentences = rng.randint(6, 14) if tiles == 1 else rng.randint(2, 10 - 2 * tiles + 2)
    return [img], _describe(img, rng, sentences)


def _conversation_sample(rng: random.Random) -> Tuple[List[SyntheticImage], List[Dict[str, str]]]:
    n_images = rng.choices((1, 2, 3), weights=(50, 35, 15))[0]
    images = [_random_image(rng, rng.choice((1, 2, 4))) for _ in range(n_images)]
    turns: List[Dict[str, str]] = []
    for t in range(rng.randint(2, 4)):
        i = rng.randrange(n_images)
        img = images[i]
        s = rng.choice(img.shapes)
        which = f"image {i + 1}" if n_images > 1 else "the image"
        q, a = rng.choice((
            (f"What color is the {s.kind} in {which}?", f"The {s.kind} is {s.color}."),
            (f"Where is the {s.color} {s.kind} in {which}?", f"It is at the {s.place}."),
            (f"How many shapes are in {which}?", f"There are {len(img.shapes)}."),
            (f"Describe {which}.", _describe(img, rng, rng.randint(2, 5))),
            (f"What is the background color of {which}?", f"The background is {img.background}."),
        ))
        turns.append({"from": "human", "value": q})
        turns.append({"from": "gpt", "value": a})
    return images, turns


# ``--mix vision-heavy``: 1-12 tiles per image, multi-image documents, ~30% text-only samples.
#: Sample kinds of the vision-heavy mix and their shares (text-only and documents are
#: conversations; a text-only conversation has no image).
VISION_HEAVY_SHARES = (("text", 30), ("caption", 40), ("document", 30))


def _tiles_vision_heavy(rng: random.Random) -> int:
    # every count from 1 to 12; the heavy end (8-12 tiles) about as common as the light one
    return rng.choices(range(1, 13), weights=(8, 8, 7, 9, 6, 9, 6, 9, 7, 8, 6, 10))[0]


def _random_image_up_to_12(rng: random.Random, tiles: int) -> SyntheticImage:
    tw, th = rng.choice(SHAPES_UP_TO_12[tiles])
    n = rng.randint(1, min(6, 1 + tiles))
    bg = rng.choice(_COLORS)
    shapes = [Shape(rng.choice(_SHAPES), rng.choice([c for c in _COLORS if c != bg]), rng.choice(_PLACES))
              for _ in range(n)]
    return SyntheticImage(tw, th, bg, shapes)


def _paragraph(rng: random.Random, sentences: int) -> str:
    """Image-free text: statements about shapes and colours, and the filler sentences."""
    out = []
    for _ in range(sentences):
        if rng.random() < 0.6:
            out.append(f"A {rng.choice(_COLORS)} {rng.choice(_SHAPES)} is often drawn at the "
                       f"{rng.choice(_PLACES)} of a picture.")
        else:
            out.append(rng.choice(_FILLER))
    return " ".join(out)


def _vision_heavy_text_sample(rng: random.Random) -> Tuple[List[SyntheticImage], List[Dict[str, str]]]:
    """A text-only conversation, long enough to fill a large part of a pack."""
    turns: List[Dict[str, str]] = []
    for _ in range(rng.randint(2, 4)):
        turns.append({"from": "human", "value": f"Tell me about the {rng.choice(_COLORS)} "
                                                 f"{rng.choice(_SHAPES)}."})
        turns.append({"from": "gpt", "value": _paragraph(rng, rng.randint(4, 16))})
    return [], turns


def _vision_heavy_caption_sample(rng: random.Random) -> Tuple[List[SyntheticImage], str]:
    img = _random_image_up_to_12(rng, _tiles_vision_heavy(rng))
    return [img], _describe(img, rng, rng.randint(2, 6))


def _vision_heavy_document_sample(rng: random.Random) -> Tuple[List[SyntheticImage], List[Dict[str, str]]]:
    """A multi-image document: 2-4 images of 1-12 tiles, questions about each."""
    images = [_random_image_up_to_12(rng, _tiles_vision_heavy(rng)) for _ in range(rng.randint(2, 4))]
    turns: List[Dict[str, str]] = []
    for i, img in enumerate(images):
        s = rng.choice(img.shapes)
        turns.append({"from": "human", "value": f"Where is the {s.color} {s.kind} in image {i + 1}?"})
        turns.append({"from": "gpt", "value": f"It is at the {s.place}. " + _describe(img, rng, 2)})
    return images, turns


def _render_png(img: SyntheticImage, tile_size: int, image_format: str = "PNG") -> bytes:
    """The image drawn at ``tile_size`` pixels per tile: PNG bytes (``image_format="JPEG"``:
    JPEG, quality 90, several times faster to encode for large images)."""
    from PIL import Image, ImageDraw

    w, h = img.tiles_w * tile_size, img.tiles_h * tile_size
    canvas = Image.new("RGB", (w, h), _RGB[img.background])
    draw = ImageDraw.Draw(canvas)
    r = max(4, tile_size // 5)
    for s in img.shapes:
        fx = 0.2 if "left" in s.place else 0.8 if "right" in s.place else 0.5
        fy = 0.2 if "top" in s.place else 0.8 if "bottom" in s.place else 0.5
        cx, cy = int(fx * w), int(fy * h)
        box = (cx - r, cy - r, cx + r, cy + r)
        color = _RGB[s.color]
        if s.kind == "square":
            draw.rectangle(box, fill=color)
        elif s.kind == "circle":
            draw.ellipse(box, fill=color)
        elif s.kind == "triangle":
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
        elif s.kind == "stripe":
            draw.rectangle((0, cy - r // 3, w, cy + r // 3), fill=color)
        else:
            draw.ellipse((cx - r // 3, cy - r // 3, cx + r // 3, cy + r // 3), fill=color)
    buf = io.BytesIO()
    if image_format == "JPEG":
        canvas.save(buf, format="JPEG", quality=90)
    else:
        canvas.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------
# WebDataset shards and energon metadata

def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def _write_shards(root: Path, split: str, samples: Sequence[Dict[str, bytes]]) -> List[str]:
    """Write ``samples`` (``{"__key__": ..., part: bytes}``) into ``split-NNNNNN.tar`` shards."""
    names = []
    for start in range(0, len(samples), SAMPLES_PER_SHARD):
        name = f"{split}-{start // SAMPLES_PER_SHARD:06d}.tar"
        with open(root / name, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for sample in samples[start:start + SAMPLES_PER_SHARD]:
                key = sample["__key__"].decode()
                for part in sorted(k for k in sample if k != "__key__"):
                    _tar_add(tar, f"{key}.{part}", sample[part])
        names.append(name)
    return names


_CONVERSATION_LOADER = '''\
"""energon sample loader: a conversation sample's parts -> SimilarityInterleavedSample fields."""


def sample_loader(raw: dict) -> dict:
    conv = raw["json"]
    return dict(
        images=[raw[f"img{i}.png"] for i in range(conv["num_images"])],
        texts=conv["texts"],
    )


def part_filter(part: str) -> bool:
    return part == "json" or (part.startswith("img") and part.endswith(".png"))
'''


def _dataset_yaml(kind: str) -> str:
    if kind == "captions":
        return ("sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
                "field_map:\n  image: png\n  caption: txt\n")
    return ("sample_type:\n  __module__: megatron.energon\n  __class__: SimilarityInterleavedSample\n"
            "sample_loader: sample_loader.py:sample_loader\npart_filter: sample_loader.py:part_filter\n")


def _prepare(root: Path, shards: List[str], kind: str) -> None:
    """energon's prepare step, programmatic and non-interactive, with a seed-derived UUID."""
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    with contextlib.redirect_stdout(io.StringIO()):
        WebdatasetPreparator.prepare_dataset(
            root, shards, split_parts_patterns=[("train", r"train-.*\.tar"), ("val", r"val-.*\.tar")],
            workers=1, shuffle_seed=None)
    meta = root / ".nv-meta"
    (meta / "dataset.yaml").write_text(_dataset_yaml(kind))
    if kind == "conversations":
        (meta / "sample_loader.py").write_text(_CONVERSATION_LOADER)
    digest = hashlib.sha256()
    for name in shards:
        digest.update(name.encode())
        digest.update((root / name).read_bytes())
    (meta / "index.uuid").write_text(str(uuid.UUID(bytes=digest.digest()[:16], version=4)))


def _metadataset_yaml(weights: Dict[str, int]) -> str:
    """Train blends every component; val is the first component alone, because
    examples/multimodal hands Megatron one validation loader per dataset of the val split
    and Megatron's ``build_train_valid_test_data_loaders`` accepts exactly one (unless
    ``--multiple-validation-sets``)."""
    first = next(iter(weights))
    lines = ["__module__: megatron.energon", "__class__: MetadatasetV2", "splits:",
             "  train:", "    blend:"]
    for name, w in weights.items():
        lines += [f"      - weight: {w}", f"        path: {name}"]
    lines += ["  val:", f"    path: {first}"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# tokenizer

def train_bpe_tokenizer(out: Path, corpus: List[str], special_tokens, vocab_size: int = 2048):
    """A byte-level BPE tokenizer trained on ``corpus`` (deterministic), saved as
    ``out/tokenizer.json``; returns it and the ``added_tokens_decoder`` entries of its
    special tokens (for the Hugging Face config files each dataset format writes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in special_tokens}
    return tok, added


def _write_tokenizer(out: Path, corpus: List[str], vocab_size: int = 2048) -> None:
    _, added = train_bpe_tokenizer(out, corpus, SPECIAL_TOKENS, vocab_size)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
         "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}, indent=2, sort_keys=True) + "\n")


def _tokenizer_corpus(texts: List[str]) -> List[str]:
    """The dataset's text plus the words of the example's prompts and chat roles."""
    extra = ["system", "user", "assistant", "Answer the questions.",
             "Generate a short caption of the image.", "Describe the image concisely.",
             "Provide a brief description of the given image.", "Give a short caption of the picture.",
             "Write a brief caption for this image.", "Summarize the image in a sentence."]
    return texts + extra * 4


# ----------------------------------------------------------------------------------------

def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise MakeDatasetError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        ours = (out / "dataset.yaml").is_file() and (out / "captions").is_dir()
        if not ours:
            raise MakeDatasetError(f"{out}: directory is not empty (give a new or empty directory, "
                                   f"or one written by make-dataset)")


def _vision_heavy_kinds(n: int) -> List[str]:
    """``n`` sample kinds of the vision-heavy mix in their shares (shuffled by the caller)."""
    total = sum(w for _, w in VISION_HEAVY_SHARES)
    counts = {k: round(n * w / total) for k, w in VISION_HEAVY_SHARES}
    counts["document"] = max(MIN_CONVERSATIONS, counts["document"])
    counts["caption"] = n - counts["text"] - counts["document"]
    return [k for k, _ in VISION_HEAVY_SHARES for _ in range(counts[k])]


#: Which energon dataset each sample kind is written to.
_DATASET_OF = {"captions": "captions", "conversations": "conversations", "caption": "captions",
               "text": "conversations", "document": "conversations"}


def make_dataset(out_dir, samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED,
                 tile_size: int = DEFAULT_TILE_SIZE, mix: str = "default") -> Summary:
    """Write the dataset, its metadataset and the tokenizer under ``out_dir``; return a summary.

    ``samples`` training samples (captions and conversations together) plus a
    validation split of ``max(16, samples // 8)``; an existing directory written by
    this function is replaced. ``mix``: ``default`` (1-4 tiles, one to three images per
    conversation) or ``vision-heavy`` (1-12 tiles per image for ``--max-num-tiles 12``,
    multi-image documents of 2-4 images, about 30% text-only conversations: packs that
    differ widely in image tokens). Both are byte-reproducible from the seed.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < MIN_SAMPLES:
        raise MakeDatasetError(f"--samples must be an integer >= {MIN_SAMPLES}, got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise MakeDatasetError(f"--seed must be an integer >= 0, got {seed!r}")
    if not isinstance(tile_size, int) or not 14 <= tile_size <= 1024:
        raise MakeDatasetError(f"--tile-size must be an integer between 14 and 1024, got {tile_size!r}")
    if mix not in MIXES:
        raise MakeDatasetError(f"--mix must be one of {', '.join(MIXES)}, got {mix!r}")
    out = Path(out_dir).absolute()
    _check_out_dir(out)
    for name in ("captions", "conversations", "tokenizer", "dataset.yaml"):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)

    rng = random.Random(seed)
    summary = Summary(out, out / "dataset.yaml", out / "tokenizer", PROMPT_FORMAT, tile_size,
                      max_num_tiles=4 if mix == "default" else 12)
    texts: List[str] = []
    records: Dict[str, Dict[str, List[Dict[str, bytes]]]] = {"captions": {}, "conversations": {}}
    for split, n in (("train", samples), ("val", max(MIN_SAMPLES, samples // 8))):
        if mix == "default":
            n_conv = max(MIN_CONVERSATIONS, round(n * CONVERSATION_SHARE))
            kinds = ["conversations"] * n_conv + ["captions"] * (n - n_conv)
        else:
            kinds = _vision_heavy_kinds(n)
        rng.shuffle(kinds)
        for kind in records:
            records[kind][split] = []
        for i, kind in enumerate(kinds):
            key = f"{split}_{i:06d}".encode()
            if kind in ("captions", "caption"):
                images, caption = (_caption_sample(rng) if kind == "captions"
                                   else _vision_heavy_caption_sample(rng))
                rec = {"__key__": key, "png": _render_png(images[0], tile_size), "txt": caption.encode()}
                texts.append(caption)
            else:
                images, turns = {"conversations": _conversation_sample, "text": _vision_heavy_text_sample,
                                 "document": _vision_heavy_document_sample}[kind](rng)
                rec = {"__key__": key,
                       "json": json.dumps({"num_images": len(images), "texts": turns}, sort_keys=True).encode()}
                for j, img in enumerate(images):
                    rec[f"img{j}.png"] = _render_png(img, tile_size)
                texts.extend(t["value"] for t in turns)
            records[_DATASET_OF[kind]][split].append(rec)
            if split == "train":
                summary.text_only += not images
                for img in images:
                    summary.tiles[img.tiles] = summary.tiles.get(img.tiles, 0) + 1
                summary.images_per_sample[len(images)] = summary.images_per_sample.get(len(images), 0) + 1
        summary.counts[split] = {k: len(v[split]) for k, v in records.items()}

    for kind, splits in records.items():
        root = out / kind
        root.mkdir()
        shards = _write_shards(root, "train", splits["train"]) + _write_shards(root, "val", splits["val"])
        _prepare(root, shards, kind)
    weights = {k: len(v["train"]) for k, v in records.items()}
    summary.data_path.write_text(_metadataset_yaml(weights))
    _write_tokenizer(summary.tokenizer_dir, _tokenizer_corpus(texts))
    return summary


def add_arguments(parser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (new, empty, or an earlier output)")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                        help=f"training samples (default {DEFAULT_SAMPLES}); validation gets one eighth")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="same seed, byte-identical output")
    parser.add_argument("--tile-size", type=int, default=DEFAULT_TILE_SIZE,
                        help=f"pixels per image tile, the example's --img-h/--img-w (default {DEFAULT_TILE_SIZE})")
    parser.add_argument("--mix", default="default", choices=MIXES + ("native-res",),
                        help="default: 1-4 tiles per image, 20%% conversations of 1-3 images; vision-heavy: "
                             "1-12 tiles (--max-num-tiles 12), multi-image documents, ~30%% text-only "
                             "samples (the real-speed benchmark's data); native-res (--format "
                             "bridge-qwen-vl only): native-resolution images of 64-3,136 patches, "
                             "documents, videos and text (data/native_res.py)")
    parser.add_argument("--format", choices=FORMATS, default=FORMATS[0],
                        help="megatron-multimodal (default): Megatron-LM examples/multimodal; "
                             "bridge-qwen-vl: Megatron-Bridge's Qwen-VL energon path (docs/bridge.md)")


def run(args) -> int:
    """``mm-balance make-dataset`` in the Megatron-LM examples/multimodal format (the CLI
    sends ``--format bridge-qwen-vl`` to :mod:`megatron_mm_balance.bridge.dataset`)."""
    try:
        summary = make_dataset(args.out_dir, samples=args.samples, seed=args.seed, tile_size=args.tile_size,
                               mix=args.mix)
    except ImportError as exc:
        raise MakeDatasetError(f"make-dataset needs {exc.name or exc} (pip install megatron-energon "
                               f"pillow tokenizers)") from None
    for line in summary.lines():
        print(line)
    return 0
