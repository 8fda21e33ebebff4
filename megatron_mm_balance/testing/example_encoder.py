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


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def restore_check(helpers, make_encoder, data_path, *, before: int = 3, after: int = 4,
                  packing_buffer_size: int = 64, num_workers: int = 0) -> dict:
    """Energon's checkpoint contract for a task encoder built by ``make_encoder()``.

    Runs ``before`` batches, ``save_state_rank``, ``after`` more; restores the saved
    state into a fresh encoder and loader and compares its ``after`` batches with the
    uninterrupted run; then restores the last batch from its ``__restore_key__``
    (``restore_sample``) when the loader says it can.
    """
    import torch

    loader = train_loader(helpers, make_encoder(), data_path, packing_buffer_size=packing_buffer_size,
                          num_workers=num_workers)
    it = iter(loader)
    for _ in range(before):
        next(it)
    state = loader.save_state_rank()
    reference = [next(it) for _ in range(after)]

    fresh = train_loader(helpers, make_encoder(), data_path, packing_buffer_size=packing_buffer_size,
                         num_workers=num_workers)
    fresh.restore_state_rank(state)
    it2 = iter(fresh)
    resumed = [next(it2) for _ in range(after)]
    mismatched = [i for i, (a, b) in enumerate(zip(reference, resumed)) if not _same(a, b)]

    result = {"resumed_equal": not mismatched and len(resumed) == after, "mismatched": mismatched,
              "keys": sorted(reference[0]), "can_restore_sample": bool(fresh.can_restore_sample()),
              "restored_equal": None}
    if result["can_restore_sample"]:
        last = reference[-1]
        again = fresh.restore_sample(last["__restore_key__"])
        result["restored_equal"] = _same(last, again)
    result["image_tokens"] = [int(torch.as_tensor(b["image_tokens"]).sum()) if "image_tokens" in b else None
                              for b in reference]
    return result


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
    p.add_argument("--max-num-tiles", type=int, default=4,
                   help="the example's --max-num-tiles (12 for make-dataset --mix vision-heavy)")
    p.add_argument("--restore", metavar="KINDS",
                   help="instead: the save_state/restore_state and restore_sample check, for each of "
                        "the comma-separated encoders: 'balanced' (the example's TaskEncoder with the "
                        "mixin, as --mm-balance-task-encoder builds it), 'stock' (without it), "
                        "'balanced-unmarked' (the mixin following the example's missing marks)")
    p.add_argument("--num-workers", type=int, default=0)
    a = p.parse_args(argv)
    data = Path(a.data_dir)
    helpers = load_example(a.megatron_lm_dir, example_argv(
        data / "dataset.yaml", data / "tokenizer", a.megatron_lm_dir,
        packing_seq_length=a.packing_seq_length, packing_buffer_size=a.packing_buffer_size,
        max_num_tiles=a.max_num_tiles))
    if a.restore:
        from megatron_mm_balance.megatron.energon import balanced_example_task_encoder, balanced_task_encoder
        makers = {"balanced": lambda: balanced_example_task_encoder(helpers.TaskEncoder),
                  "stock": helpers.TaskEncoder,
                  "balanced-unmarked": lambda: balanced_task_encoder(helpers.TaskEncoder)()}
        kinds = a.restore.split(",")
        unknown = [k for k in kinds if k not in makers]
        if unknown:
            p.error(f"--restore: unknown kind {unknown[0]!r} (choose from {', '.join(makers)})")
        print(json.dumps({k: restore_check(helpers, makers[k], data / "dataset.yaml",
                                           packing_buffer_size=a.packing_buffer_size, num_workers=a.num_workers)
                          for k in kinds}))
        return 0
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
