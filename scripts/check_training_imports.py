"""Check that a Megatron-LM checkout's training path imports in this Python environment.

    python scripts/check_training_imports.py MEGATRON_LM_DIR

Imports what ``examples/multimodal/train.py`` pulls in at start-up, from the checkout
itself (its own ``megatron/core`` first on the path, as the launcher sets it):
``megatron.training.training``, ``megatron.training.arguments``,
``megatron.training.checkpointing``, ``megatron.training.datasets.data_samplers`` and the
example's ``model``, ``dataloader_provider`` and ``train`` modules. The setup scripts run it
when ``MEGATRON_LM_DIR`` is set, so that a package the training path needs but the
environment lacks (``pydantic``: ``megatron/rl``, imported by ``training.py`` at
core_v0.16.1) is found at setup time instead of by every rank at start-up.

On a machine without triton (a CPU-only torch), the CPU harness's inert triton package
is registered first, as ``scripts/pretrain_vlm_moe.sh`` does for CPU runs.

Prints one line and exits 0 when everything imports; otherwise one line naming the
missing module and the file that imports it, exit 1.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ("megatron.training.training", "megatron.training.arguments",
           "megatron.training.checkpointing", "megatron.training.datasets.data_samplers",
           "model", "dataloader_provider", "train")


def _importer(exc: BaseException, tree: str) -> str:
    """The checkout file (and line) whose import failed, relative to the checkout."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(tree)]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{os.path.relpath(f.filename, tree)}:{f.lineno}"


def main(argv) -> int:
    if len(argv) != 1:
        print("usage: check_training_imports.py MEGATRON_LM_DIR", file=sys.stderr)
        return 2
    tree = os.path.abspath(argv[0])
    if not os.path.isfile(os.path.join(tree, "megatron", "training", "training.py")):
        print(f"check_training_imports: {tree} is not a Megatron-LM checkout "
              "(no megatron/training/training.py)", file=sys.stderr)
        return 1
    sys.path[:0] = [tree, os.path.join(tree, "examples", "multimodal"), REPO]
    if importlib.util.find_spec("triton") is None:
        from megatron_mm_balance.testing.cpu_pretrain import _stub_triton
        _stub_triton()
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing = getattr(exc, "name", None) or str(exc)
            print(f"check_training_imports: {sys.executable} cannot import the training path of "
                  f"{tree}: {name} needs '{missing}' (imported at {_importer(exc, tree)}); "
                  "install it (scripts/setup_env.sh or scripts/setup_env_py312.sh)", file=sys.stderr)
            return 1
    import megatron.core
    version = getattr(megatron.core, "__version__", "?")
    if not os.path.abspath(megatron.core.__file__).startswith(tree):
        print(f"check_training_imports: megatron.core came from {megatron.core.__file__}, not from "
              f"{tree}", file=sys.stderr)
        return 1
    print(f"training entry points import: Megatron-LM {version} at {tree} "
          f"({', '.join(MODULES)}) with {sys.executable}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
