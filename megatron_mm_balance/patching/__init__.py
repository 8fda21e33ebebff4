"""Our hooks in Megatron-LM and Megatron-Bridge, as data and at import time.

* :mod:`.hunks`: ``patches/<set>/*.patch`` parsed, applied to a text in memory as ``git apply``
  applies them (no fuzz);
* :mod:`.sets`: which set a tree gets (``patches/sets.tsv``, the rules of ``apply_patches.sh``);
* :mod:`.overlay`: the import-time overlay for read-only trees (no file written);
* :mod:`.digest`: the same code on every rank, agreed on at start-up.

Pure standard library except :func:`.digest.agree_on_code` (torch.distributed's store); imports
nothing from Megatron. The command line: ``python -m megatron_mm_balance.patching``.
"""
