"""``mm-balance make-dataset``: deterministic, loadable by energon, varied tiles, and the
example's TaskEncoder packs it into packs that differ in image tokens."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mm_balance.data.make_dataset import SHAPES_BY_TILES, make_dataset

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}


def files(d: Path):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def test_same_seed_byte_identical_other_seed_differs(dataset_dir, tmp_path):
    make_dataset(tmp_path / "again", samples=96, seed=7)
    make_dataset(tmp_path / "other", samples=96, seed=8)
    a, b, c = files(dataset_dir), files(tmp_path / "again"), files(tmp_path / "other")
    assert any(k.endswith(".tar") for k in a) and ".nv-meta/index.sqlite" in "".join(a)
    assert a == b
    assert set(a) == set(c) and a["captions/train-000000.tar"] != c["captions/train-000000.tar"]
    # rewriting an earlier output in place gives the same bytes again
    make_dataset(tmp_path / "again", samples=96, seed=7)
    assert files(tmp_path / "again") == a


def test_energon_loads_both_splits_with_the_sample_types(dataset_dir):
    from PIL import Image
    from megatron.energon import (CaptioningSample, SimilarityInterleavedSample, WorkerConfig,
                                  get_loader, get_val_dataset)

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    seen = {}
    for kind, cls in (("captions", CaptioningSample), ("conversations", SimilarityInterleavedSample)):
        for split in ("train", "val"):
            ds = get_val_dataset(str(dataset_dir / kind), split_part=split, batch_size=None,
                                 worker_config=wc, image_decode="pil")
            samples = list(get_loader(ds))
            assert samples and all(isinstance(s, cls) for s in samples), (kind, split)
            seen[kind, split] = samples
    assert len(seen["captions", "train"]) + len(seen["conversations", "train"]) == 96
    assert len(seen["captions", "val"]) + len(seen["conversations", "val"]) == 16
    assert all(len(seen["conversations", split]) >= 4 for split in ("train", "val"))
    cap = seen["captions", "train"][0]
    assert isinstance(cap.image, Image.Image) and cap.caption.strip()
    conv = seen["conversations", "train"][0]
    assert conv.images and all(isinstance(i, Image.Image) for i in conv.images)
    roles = [t["from"] for t in conv.texts]
    assert roles[0] == "human" and roles.count("gpt") >= 2 and set(roles) == {"human", "gpt"}
    # the metadataset blends both, for both splits
    mds = (dataset_dir / "dataset.yaml").read_text()
    assert "MetadatasetV2" in mds and "path: captions" in mds and "path: conversations" in mds


def test_images_span_one_to_four_tiles(dataset_dir):
    """Every image is whole tiles of 56 px in a shape the example's tiling cuts into 1-4 tiles;
    all four counts occur, light (1) and image-heavy (4) ones often."""
    import tarfile
    from PIL import Image

    tiles_of = {shape: n for n, shapes in SHAPES_BY_TILES.items() for shape in shapes}
    counts = {}
    for tar_path in sorted((dataset_dir / "captions").glob("train-*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar:
                if m.name.endswith(".png"):
                    w, h = Image.open(io.BytesIO(tar.extractfile(m).read())).size
                    assert w % 56 == 0 and h % 56 == 0, (m.name, w, h)
                    n = tiles_of[(w // 56, h // 56)]
                    counts[n] = counts.get(n, 0) + 1
    total = sum(counts.values())
    assert set(counts) == {1, 2, 3, 4}, counts
    assert counts[1] >= 0.2 * total and counts[4] >= 0.15 * total, counts


def test_cli_prints_paths_and_writes_what_the_function_writes(tmp_path):
    r = cli("make-dataset", tmp_path / "d", "--samples", "16", "--seed", "3")
    assert r.returncode == 0, r.stderr
    lines = dict(l.split("=", 1) for l in r.stdout.splitlines() if "=" in l and " " not in l.split("=")[0])
    assert Path(lines["DATA_PATH"]) == tmp_path / "d" / "dataset.yaml"
    assert Path(lines["TOKENIZER_MODEL"]) == tmp_path / "d" / "tokenizer"
    assert lines["TOKENIZER_PROMPT_FORMAT"] == "qwen2p5"
    assert (tmp_path / "d" / "captions" / ".nv-meta" / "index.sqlite").is_file()
    assert make_dataset(tmp_path / "again", samples=16, seed=3) and files(tmp_path / "again") == files(tmp_path / "d")


def run_main(capsys, *args):
    from megatron_mm_balance.cli import main
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, needle", [
    (["--samples", "0"], "--samples must be an integer >= 16"),
    (["--samples", "many"], "invalid int value"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--tile-size", "3"], "--tile-size"),
    (["--bogus"], "unrecognized arguments"),
])
def test_cli_bad_arguments_one_line_exit_2(tmp_path, capsys, args, needle):
    code, out, err = run_main(capsys, "make-dataset", tmp_path / "d", *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "d").exists()


def test_cli_refuses_foreign_output_dirs(tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("x")
    for target, needle in ((tmp_path / "busy", "not empty"), (tmp_path / "file", "not a directory")):
        code, _, err = run_main(capsys, "make-dataset", target, "--samples", "16")
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
    code, _, err = run_main(capsys, "make-dataset")
    assert code == 2 and "OUT_DIR" in err and len(err.strip().splitlines()) == 1
    # the process exit status, once
    r = cli("make-dataset", tmp_path / "busy")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not empty" in r.stderr


def test_example_task_encoder_packs_differ_in_image_tokens(dataset_dir, megatron_lm_dir):
    """Megatron's examples/multimodal TaskEncoder, packing to 1024, over energon's loader:
    the packs' image-token counts differ; MultimodalTokenizer loads the tokenizer and round-trips."""
    r = subprocess.run([sys.executable, "-m", "megatron_mm_balance.testing.example_encoder",
                        str(megatron_lm_dir), str(dataset_dir), "--packs", "12"],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens_per_tile"] == 16
    packs = out["packs"]
    assert all(0 < p["length"] <= 1024 for p in packs)
    assert any(p["samples"] > 1 for p in packs)
    image_tokens = [p["image_tokens"] for p in packs]
    assert len(set(image_tokens)) >= 3 and max(image_tokens) >= 2 * min(image_tokens), image_tokens
    assert out["roundtrip_failures"] == []
    assert out["conversation_image_tokens"] == 1 and out["conversation_trainable"] > 0
    assert out["conversation_text"].startswith("<|im_start|>user\n<image>\nDescribe")


def _content_digest(d: Path) -> str:
    """The samples' content (member names, captions, conversations, image sizes), not the PNG
    bytes (those follow the zlib build)."""
    import hashlib
    import tarfile
    from PIL import Image

    h = hashlib.sha256()
    for tar_path in sorted(d.rglob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar:
                data = tar.extractfile(m).read()
                h.update(f"{tar_path.relative_to(d)}/{m.name}".encode())
                h.update(repr(Image.open(io.BytesIO(data)).size).encode() if m.name.endswith(".png") else data)
    return h.hexdigest()


def test_default_mix_is_unchanged(dataset_dir):
    """The default mix's samples are what they were before --mix existed (seed 7, 96 samples)."""
    assert _content_digest(dataset_dir) == "6ffb47be4a500e0876d268d2e964e924e2515b91e52ffd2e47b3f4a5269b961d"


def test_vision_heavy_mix(tmp_path):
    """--mix vision-heavy: byte-reproducible; images of every count from 1 to 12 tiles (whole
    56 px tiles in shapes the example's tiling keeps), multi-image documents of 2-4 images,
    about 30% text-only samples."""
    import tarfile
    from PIL import Image

    from megatron_mm_balance.data.make_dataset import SHAPES_UP_TO_12

    a = make_dataset(tmp_path / "a", samples=160, seed=3, mix="vision-heavy")
    make_dataset(tmp_path / "b", samples=160, seed=3, mix="vision-heavy")
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert a.max_num_tiles == 12 and "--max-num-tiles 12" in a.lines()[-1]
    tiles_of = {shape: n for n, shapes in SHAPES_UP_TO_12.items() for shape in shapes}
    tiles, images_per_conv = {}, []
    for tar_path in sorted((tmp_path / "a").rglob("train-*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar:
                data = tar.extractfile(m).read()
                if m.name.endswith(".png"):
                    w, h = Image.open(io.BytesIO(data)).size
                    assert w % 56 == 0 and h % 56 == 0
                    n = tiles_of[(w // 56, h // 56)]
                    tiles[n] = tiles.get(n, 0) + 1
                elif m.name.endswith(".json"):
                    images_per_conv.append(json.loads(data)["num_images"])
    assert set(tiles) == set(range(1, 13)), tiles
    text_only = images_per_conv.count(0)
    assert a.text_only == text_only and 0.25 <= text_only / 160 <= 0.35
    assert {2, 3, 4} <= set(images_per_conv)
    with pytest.raises(Exception, match="--mix"):
        make_dataset(tmp_path / "c", samples=16, mix="text-only")
