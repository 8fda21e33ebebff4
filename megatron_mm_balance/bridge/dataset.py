"""``mm-balance make-dataset --format bridge-qwen-vl``: the same synthetic content, in the
form Megatron-Bridge's Qwen-VL energon path reads.

Bridge's ``QwenVLTaskEncoder`` (``EnergonDatasetConfig`` + ``QwenVLEnergonTaskEncoderConfig``)
reads energon ``ChatMLSample`` datasets (``megatron.bridge.data.energon.task_encoder_utils``:
a ``json`` conversation and a ``jpgs`` part, a pickled list of encoded images) and
tokenizes them with a Hugging Face ``Qwen3VLProcessor`` loaded from a local directory.
Qwen-VL encoders see each image at its native resolution (``image_grid_thw``: one
16-pixel patch per grid cell, 2 x 2 patches merged into one language-model token), so
images here are sized in whole merge units of ``UNIT`` = 32 pixels, from 1 x 1 (4
patches, 1 token) to 8 x 8 (256 patches, 64 tokens). Under ``OUT_DIR``:

* ``train/`` and ``val/`` shards and ``.nv-meta/`` of one energon WebDataset
  (``--data-path``; Bridge: ``dataset.path=OUT_DIR``): captions (one image) and
  multi-turn conversations (one to three images), the same generators as the
  examples/multimodal form;
* ``processor/``: a ``Qwen3VLProcessor`` directory (a byte-level BPE tokenizer trained
  on the text, with the Qwen special tokens ``<|im_start|>``, ``<|im_end|>``,
  ``<|endoftext|>``, ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
  ``<|video_pad|>``, a Qwen-VL chat template, and the image/video processor settings):
  ``dataset.task_encoder.hf_processor_path`` and ``tokenizer.tokenizer_model``.

Same seed, byte-identical files (as for the default form). The default
``make-dataset`` output does not change.
"""
from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..data import make_dataset as md

#: Pixels per merge unit: patch 16, 2 x 2 merge (Qwen3-VL).
PATCH, MERGE = 16, 2
UNIT = PATCH * MERGE
#: Merge units per side: (width, height) choices for light and heavy images.
LIGHT_SHAPES = ((1, 1), (2, 1), (1, 2), (2, 2))
HEAVY_SHAPES = ((6, 6), (8, 4), (4, 8), (8, 8), (6, 8))
#: Processor bounds (pixels) that keep every generated image at its own size.
MIN_PIXELS, MAX_PIXELS = UNIT * UNIT, 8 * 8 * UNIT * UNIT

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: Qwen-VL chat template: text turns, and a vision block per image/video content part.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_MEAN, _STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
_PROMPTS = ("Describe the image.", "Give a short caption of the picture.", "What is shown here?")


def _shape(rng: random.Random, tiles: int) -> Tuple[int, int]:
    """Merge units (w, h) of an image: the examples/multimodal tile count picks light or heavy."""
    return rng.choice(LIGHT_SHAPES if tiles <= 2 else HEAVY_SHAPES)


def _image_bytes(img: "md.SyntheticImage", units: Tuple[int, int]) -> bytes:
    """The synthetic image drawn at ``units`` merge units (PNG bytes, deterministic)."""
    from dataclasses import replace
    # _render_png draws tiles_w x tiles_h tiles of tile_size pixels: one unit per tile.
    return md._render_png(replace(img, tiles_w=units[0], tiles_h=units[1]), UNIT)


def _sample(rng: random.Random, kind: str):
    """(images as units, PNG bytes list, conversation turns) of one sample."""
    if kind == "captions":
        images, caption = md._caption_sample(rng)
        prompt = rng.choice(_PROMPTS)
        turns = [{"from": "human", "value": "<image>\n" + prompt}, {"from": "gpt", "value": caption}]
    else:
        images, turns = md._conversation_sample(rng)
        marks = "".join("<image>\n" for _ in images)
        turns = [dict(turns[0], value=marks + turns[0]["value"])] + turns[1:]
    units = [_shape(rng, img.tiles) for img in images]
    return units, [_image_bytes(img, u) for img, u in zip(images, units)], turns


def _dataset_yaml(field_map: Dict[str, str]) -> str:
    return ("__module__: megatron.bridge.data.energon.task_encoder_utils\n"
            "__class__: ChatMLWebdataset\n"
            "field_map:\n" + "".join(f"  {k}: {v}\n" for k, v in field_map.items()))


def _write_processor(out: Path, corpus: List[str], vocab_size: int = 2048, *, min_pixels: int = MIN_PIXELS,
                     max_pixels: int = MAX_PIXELS):
    """The processor directory (tokenizer, chat template, image and video processor settings
    with these pixel bounds); returns the trained tokenizer."""
    tok, added = md.train_bpe_tokenizer(out, corpus, SPECIAL_TOKENS, vocab_size)

    def dump(name, obj):
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    dump("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]), "model_max_length": 32768,
        "clean_up_tokenization_spaces": False, "processor_class": "Qwen3VLProcessor"})
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    vision = {"patch_size": PATCH, "temporal_patch_size": 2, "merge_size": MERGE,
              "image_mean": _MEAN, "image_std": _STD, "do_resize": True, "do_rescale": True,
              "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
              "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
              "processor_class": "Qwen3VLProcessor"}
    dump("preprocessor_config.json", {**vision, "image_processor_type": "Qwen2VLImageProcessorFast"})
    dump("video_preprocessor_config.json", {**vision, "video_processor_type": "Qwen3VLVideoProcessor",
                                            "fps": 2, "min_frames": 4, "max_frames": 16,
                                            "do_sample_frames": False})
    return tok


def token_ids(processor_dir) -> Dict[str, int]:
    """The special-token ids of a processor written here (the model's ``*_token_id`` fields)."""
    vocab = json.loads((Path(processor_dir) / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}


def check_output(out_dir, samples, seed) -> Path:
    """The output directory (absolute) after checking the arguments; one-line errors."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < md.MIN_SAMPLES:
        raise md.MakeDatasetError(f"--samples must be an integer >= {md.MIN_SAMPLES}, got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise md.MakeDatasetError(f"--seed must be an integer >= 0, got {seed!r}")
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise md.MakeDatasetError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "processor").is_dir():
        raise md.MakeDatasetError(f"{out}: directory is not empty (give a new or empty directory, "
                                  f"or one written by make-dataset --format bridge-qwen-vl)")
    return out


def make_qwen_vl_dataset(out_dir, samples: int = md.DEFAULT_SAMPLES, seed: int = md.DEFAULT_SEED) -> List[str]:
    """Write the dataset and processor under ``out_dir``; return the summary lines."""
    out = check_output(out_dir, samples, seed)
    if out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rng = random.Random(seed)
    texts: List[str] = []
    shards: List[str] = []
    patches: Dict[int, int] = {}
    counts = {}
    for split, n in (("train", samples), ("val", max(md.MIN_SAMPLES, samples // 8))):
        n_conv = max(md.MIN_CONVERSATIONS, round(n * md.CONVERSATION_SHARE))
        kinds = ["conversations"] * n_conv + ["captions"] * (n - n_conv)
        rng.shuffle(kinds)
        recs = []
        for i, kind in enumerate(kinds):
            units, pngs, turns = _sample(rng, kind)
            recs.append({"__key__": f"{split}_{i:06d}".encode(),
                         "json": json.dumps(turns, sort_keys=True).encode(),
                         "jpgs": pickle.dumps(pngs, protocol=4)})
            texts.extend(t["value"].replace("<image>\n", "") for t in turns)
            if split == "train":
                n_patches = sum(w * h * MERGE * MERGE for w, h in units)
                patches[n_patches] = patches.get(n_patches, 0) + 1
        counts[split] = len(recs)
        shards += md._write_shards(out, split, recs)
    _prepare(out, shards)
    _write_processor(out / "processor", md._tokenizer_corpus(texts) + list(_PROMPTS) * 4)
    spread = ", ".join(f"{k}:{v}" for k, v in sorted(patches.items()))
    return [f"wrote {out}: train {counts['train']}, val {counts['val']} ChatML samples",
            f"train vision patches per sample (patches:samples): {spread}",
            f"DATA_PATH={out}", f"PROCESSOR={out / 'processor'}"]


def _prepare(root: Path, shards: List[str], field_map: Optional[Dict[str, str]] = None) -> None:
    """energon's prepare step (as the default form does), then the ChatML dataset.yaml
    (``field_map``: the sample parts of each ChatMLSample field; default images only)."""
    import contextlib
    import hashlib
    import io
    import uuid

    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    with contextlib.redirect_stdout(io.StringIO()):
        WebdatasetPreparator.prepare_dataset(
            root, shards, split_parts_patterns=[("train", r"train-.*\.tar"), ("val", r"val-.*\.tar")],
            workers=1, shuffle_seed=None)
    meta = root / ".nv-meta"
    (meta / "dataset.yaml").write_text(_dataset_yaml(field_map or {"imgs": "jpgs", "conversation": "json"}))
    digest = hashlib.sha256()
    for name in shards:
        digest.update(name.encode())
        digest.update((root / name).read_bytes())
    (meta / "index.uuid").write_text(str(uuid.UUID(bytes=digest.digest()[:16], version=4)))
