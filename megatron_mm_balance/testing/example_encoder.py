"""Megatron-LM's ``examples/multimodal`` TaskEncoder in one process, without ``pretrain()``.

The example's ``TaskEncoder`` reads Megatron's global ``args`` and tokenizer. This
module sets both the way ``initialize_megatron`` would (Megatron's own argument
parser with the example's extra arguments, then ``build_tokenizer``), skipping the
distributed start-up, so a test can drive the real encoder through energon's
``get_train_dataset``/``get_savable_loader`` on one CPU process. Test-only: the
training path never loads it.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import List, Optional, Sequence


def example_argv(data_path, tokenizer_model, megatron_lm_dir, *, packing_seq_length: int = 1024,
                 packing_buffer_size: int = 64, tile_size: int = 56, max_num_tiles: int = 4,
                 micro_batch_size: int = 1, extra: Sequence[str] = ()) -> List[str]:
    """The flags of a tiny tiled, packed run (what ``configs/megatron/tiny_cpu.sh`` plus
    ``make-dataset``'s recommendation give the example)."""
    prompts = Path(megatron_lm_dir) / "examples" / "multimodal" / "manual_prompts.json"
    return [
        "--tokenizer-type", "MultimodalTokenizer", "--tokenizer-model", str(tokenizer_model),
        "--tokenizer-prompt-format", "qwen2p5", "--language-model-type", "qwen2.5_7B",
        "--vision-model-type", "clip", "--disable-vision-class-token", "--patch-dim", "14",
        "--img-h", str(tile_size), "--img-w", str(tile_size), "--use-tiling",
        "--max-num-tiles", str(max_num_tiles), "--prompt-path", str(prompts),
        "--seq-length", str(packing_seq_length), "--decoder-seq-length", str(packing_seq_length),
        "--packing-seq-length", str(packing_seq_length), "--packing-buffer-size", str(packing_buffer_size),
        "--micro-batch-size", str(micro_batch_size), "--data-path", str(data_path),
        "--dataloader-type", "external", "--num-workers", "0", *extra,
    ]


def load_example(megatron_lm_dir, argv: Sequence[str]):
    """Import ``examples/multimodal/dataset_helpers`` with Megatron's globals set from ``argv``.

    Returns the module; ``module.TaskEncoder()`` is the example's encoder.
    """
    root = Path(megatron_lm_dir).resolve()
    example = root / "examples" / "multimodal"
    if not (example / "dataset_helpers.py").is_file():
        raise FileNotFoundError(f"{root}: no examples/multimodal/dataset_helpers.py (not a Megatron-LM tree)")
    for p in (str(example), str(root)):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from megatron.training.tokenizer.tokenizer import build_tokenizer
    multimodal_args = importlib.import_module("multimodal_args")

    saved = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        args = parse_args(multimodal_args.add_multimodal_extra_args)
    finally:
        sys.argv = saved
    args.rank, args.world_size = 0, 1
    args.data_parallel_size = 1
    global_vars._GLOBAL_ARGS = None
    global_vars.set_args(args)
    global_vars._GLOBAL_TOKENIZER = build_tokenizer(args)
    return importlib.import_module("dataset_helpers")


def train_loader(helpers, task_encoder, data_path, *, packing_buffer_size: int = 64, micro_batch_size: int = 1,
                 num_workers: int = 0, seed: Optional[int] = None):
    """The example's train loader (``datasets_provider`` settings) over one rank."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers,
                      **({} if seed is None else {"seed_offset": seed}))
    ds = get_train_dataset(
        str(data_path), batch_size=micro_batch_size, task_encoder=task_encoder,
        virtual_epoch_length=1000, max_samples_per_sequence=100, shuffle_buffer_size=100,
        worker_config=wc, packing_buffer_size=packing_buffer_size,
        handler=helpers.print_error_handler, image_decode="pil")
    return get_savable_loader(ds, worker_config=wc)


def pack_stats(batches, tokens_per_tile: int) -> List[dict]:
    """Per pack of micro-batch-size-1 batches: samples, images, tiles, image tokens, sequence length."""
    out = []
    for b in batches:
        tiles = [int(n) for n in b["num_tiles"].reshape(-1).tolist()]
        cu = b["cu_lengths"][0].tolist()
        out.append({"samples": len(cu) - 1, "images": len(tiles), "tiles": sum(tiles),
                    "image_tokens": sum(tiles) * tokens_per_tile, "length": int(cu[-1])})
    return out


def tokenizer_roundtrip(tokenizer, texts: Sequence[str]) -> List[str]:
    """Texts whose Megatron ``tokenize``/``detokenize`` round trip is not the identity (empty: all pass)."""
    return [t for t in texts if tokenizer.detokenize(tokenizer.tokenize(t)) != t]


def main(argv=None) -> int:
    """``python -m megatron_mm_balance.testing.example_encoder MEGATRON_LM_DIR DATA_DIR``: run the
    example's TaskEncoder with packing over a ``make-dataset`` output; print one JSON object."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("megatron_lm_dir")
    p.add_argument("data_dir", help="a make-dataset OUT_DIR")
    p.add_argument("--packs", type=int, default=16)
    p.add_argument("--packing-seq-length", type=int, default=1024)
    p.add_argument("--packing-buffer-size", type=int, default=64)
    a = p.parse_args(argv)
    data = Path(a.data_dir)
    helpers = load_example(a.megatron_lm_dir, example_argv(
        data / "dataset.yaml", data / "tokenizer", a.megatron_lm_dir,
        packing_seq_length=a.packing_seq_length, packing_buffer_size=a.packing_buffer_size))
    te = helpers.TaskEncoder()
    loader = train_loader(helpers, te, data / "dataset.yaml", packing_buffer_size=a.packing_buffer_size)
    it = iter(loader)
    packs = pack_stats([next(it) for _ in range(a.packs)], te.num_image_embeddings_per_tile)
    from megatron.training import get_tokenizer
    tok = get_tokenizer()
    probe = ["A red square at the top left.", "  spaces, digits 0123 and ünïcödé!\n", "<|im_start|>user\nhi<|im_end|>\n"]
    conv = [{"role": "user", "content": "<image>\nDescribe the image."}, {"role": "assistant", "content": "A blue dot."}]
    ids, target = tok.tokenize_conversation(conv, True, False)
    print(json.dumps({
        "tokens_per_tile": te.num_image_embeddings_per_tile,
        "packs": packs,
        "roundtrip_failures": tokenizer_roundtrip(tok, probe),
        "image_token_id": int(tok.convert_tokens_to_ids("<image>")),
        "conversation_image_tokens": int((ids == tok.convert_tokens_to_ids("<image>")).sum()),
        "conversation_trainable": int((target != -100).sum()),
        "conversation_text": tok.detokenize(ids.tolist()),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
