"""``python -m megatron_mm_balance.patching``: the overlay's check, a script run under it, and
a tree's code digest.

    check [--product megatron-lm|megatron-bridge] [--force] DIR
        which hooks would take at import on DIR (nothing is written): one line per hook; exit 1
        with one line when the tree cannot take them all
    run SCRIPT [ARGS...]
        python SCRIPT ARGS with the Megatron-LM overlay installed first (the Megatron-LM tree on
        the Python path, e.g. PYTHONPATH=MEGATRON_LM_DIR)
    digest [--product P] DIR
        the code digest a rank running DIR as its files are would report at start-up
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        if len(argv) < 2:
            print("usage: python -m megatron_mm_balance.patching run SCRIPT [ARGS...]", file=sys.stderr)
            return 2
        from .overlay import run_script
        run_script(argv[1], argv[2:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m megatron_mm_balance.patching")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "digest"):
        p = sub.add_parser(name)
        p.add_argument("--product", choices=("megatron-lm", "megatron-bridge"), default=None,
                       help="default: megatron-bridge when DIR holds megatron/bridge, else megatron-lm")
        p.add_argument("--force", action="store_true", help="a newer line: try the newest set")
        p.add_argument("--json", action="store_true", help="digest: also print what it covers")
        p.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    product = args.product or _product_of(args.directory)
    from .sets import OverlayRefused
    try:
        if args.command == "check":
            from .overlay import plan
            print(plan(product, args.directory, force=args.force).report())
        else:
            from .digest import code_digest, describe
            digest, covered = code_digest(product, args.directory)
            print(f"{digest} {describe(covered)}")
            if args.json:
                print(json.dumps(covered, indent=1, sort_keys=True))
    except OverlayRefused as exc:
        print(f"overlay: {exc}", file=sys.stderr)
        return 1
    return 0


def _product_of(directory: Path) -> str:
    d = Path(directory)
    bridge = any((d / p).is_dir() for p in ("src/megatron/bridge", "megatron/bridge")) or \
        (d.name == "bridge" and d.parent.name == "megatron")
    return "megatron-bridge" if bridge else "megatron-lm"


if __name__ == "__main__":
    sys.exit(main())
