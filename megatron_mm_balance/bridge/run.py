"""Pretrain with Megatron-Bridge from a recipe function, a YAML file and Hydra overrides.

    torchrun ... -m megatron_mm_balance.bridge.run --recipe MODULE_OR_FILE:FUNCTION \\
        [--config-file FILE.yaml] [--step qwen3_vl] [override=value ...]

The same steps Bridge's own recipe scripts take: the recipe function builds the
``ConfigContainer``, ``process_config_with_overrides`` merges the YAML file and the
overrides (``mm_balance.enabled=true``, ``train.train_iters=6``,
``checkpoint.save=...``), and Bridge's ``pretrain(cfg, forward_step)`` trains with
the model's own step function (``qwen3_vl``: ``models/qwen_vl/qwen3_vl_step.forward_step``).
``RECIPE`` may be a dotted module (``megatron.bridge.recipes.qwen_vl.qwen3_vl:...``) or a
``.py`` file (``configs/bridge/qwen3_vl_moe_tiny_cpu.py:config``).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

STEPS = {
    "qwen3_vl": "megatron.bridge.models.qwen_vl.qwen3_vl_step:forward_step",
    "vlm": "megatron.bridge.training.vlm_step:forward_step",
    "gpt": "megatron.bridge.training.gpt_step:forward_step",
}


def _load(spec: str):
    """``module.path:attr`` or ``path/to/file.py:attr``."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise SystemExit(f"bridge.run: expected MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise SystemExit(f"bridge.run: no such recipe file {where}")
        mod_spec = importlib.util.spec_from_file_location(f"_mm_balance_recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"bridge.run: {where} has no {attr!r}") from None


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_mm_balance.bridge.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="MODULE:FUNCTION or FILE.py:FUNCTION returning a ConfigContainer")
    p.add_argument("--config-file", default=None, help="YAML merged over the recipe (Bridge's format)")
    p.add_argument("--step", default="qwen3_vl", help=f"forward step: {', '.join(STEPS)} or MODULE:FUNCTION")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. mm_balance.enabled=true")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    from ..patching.overlay import install_if_requested
    install_if_requested("megatron-bridge")       # MM_BALANCE_OVERLAY=1: before Bridge is imported
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    cfg = _load(args.recipe)()
    cfg = process_config_with_overrides(cfg, config_filepath=args.config_file, cli_overrides=args.overrides)
    step = _load(STEPS.get(args.step, args.step))
    pretrain(cfg, step)


if __name__ == "__main__":
    main()
