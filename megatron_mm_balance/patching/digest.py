"""The same code on every rank: a digest of the hooks a rank runs and of our package, agreed on at
start-up.

A node with a stale image (an older megatron-mm-balance, an unpatched or differently patched
Megatron tree) would otherwise join the job and balance with other code, or without the hook at
all. Every rank computes :func:`code_digest` when the glue wraps its train iterator (the training
hook, the first place every rank passes after the process group exists) and the ranks compare
them through the job's own rendezvous store (:func:`agree_on_code`): one key per rank, a bounded
wait, so a rank that never reaches the hook (an unpatched tree) is named after the timeout instead
of hanging the others. A rank whose digest differs stops the job: every rank prints one line
naming the differing ranks and the digests, and exits 1.

What the digest covers: megatron-mm-balance's version and the bytes of its Python files; the
product's version file; the patch set; and each hook point (file, enclosing function, the added
lines) with whether it is in the code that runs, from the file or from the import-time overlay
(the same hooks loaded either way give the same digest). ``python -m megatron_mm_balance.patching
digest --product P DIR`` prints a tree's, e.g. to compare images before a launch.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .overlay import ACTIVE, Overlay
from .sets import PRODUCT_NAME, OverlayRefused, Tree, choose_set, find_tree, tree_at

PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: hex digits shown (and compared): 64 bits
DIGEST_CHARS = 16


_CALLS: Dict[str, int] = {}


class CodeMismatch(RuntimeError):
    """The ranks of one job do not run the same code (or a rank never reported its own)."""


def package_fingerprint() -> str:
    """``<version>+<sha256 of every .py file of the package, by relative path>`` (12 hex digits)."""
    from .. import __version__
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return f"{__version__}+{h.hexdigest()[:12]}"


def loaded_tree(product: str) -> Tree:
    """The tree this process imported ``product`` from (its loaded modules' files), else the one
    ``sys.path`` would give."""
    if product == "megatron-lm":
        mod = sys.modules.get("megatron.training.training")
        if mod is not None and getattr(mod, "__file__", None):
            return tree_at(product, Path(mod.__file__).resolve().parents[2])
    else:
        mod = sys.modules.get("megatron.bridge")
        if mod is not None and getattr(mod, "__file__", None):
            return tree_at(product, Path(mod.__file__).resolve().parents[2])
    return find_tree(product, sys.path)


def hook_points(product: str, directory: Optional[Path] = None, overlay: Optional[Overlay] = None) -> Dict[str, object]:
    """What the digest covers, as a dict: the product's tree and set, and per hook point its
    file, function, added lines' hash and whether it runs (``overlay``'s view, by default the
    active overlay's; else the files' of ``directory`` or of the loaded tree: a hook only in the
    patch does not run)."""
    if overlay is None and directory is None:
        overlay = ACTIVE.get(product)
    if overlay is None:
        try:
            tree = tree_at(product, directory) if directory else loaded_tree(product)
        except OverlayRefused:
            if directory:
                raise
            # the glue outside a tree of ours (a harness, a script of its own): the package only
            return {"product": product, "version": "none", "set": "none", "points": [], "source": "no tree",
                    "root": ""}
        try:
            set_fit, _ = choose_set(tree)
            set_name, results = set_fit.patch_set.label, set_fit.results
        except OverlayRefused:
            set_name, results = "none", ()
        hooks = [(r.hunk, r.state == "in the file") for r in results]
        source = "files"
    else:
        tree, set_name = overlay.tree, overlay.set_name
        hooks = [(r.hunk, r.state != "refused") for r in overlay.set_fit.results]
        source = "overlay"
    points = [{"file": h.path, "function": h.function, "patch": h.patch, "hunk": h.index,
               "added": hashlib.sha256("\n".join(h.added).encode()).hexdigest()[:12],
               "runs": runs} for h, runs in hooks]
    return {"product": product, "version": tree.version, "set": set_name, "points": points,
            "source": source, "root": str(tree.root)}


def code_digest(product: str, directory: Optional[Path] = None,
                overlay: Optional[Overlay] = None) -> Tuple[str, Dict[str, object]]:
    """``(digest, what it covers)``: the hex digest of the package fingerprint and the hook
    points (the tree's path and whether the overlay or the files carry the hooks are reported,
    not hashed: the same code from another path or the other way hashes the same)."""
    points = hook_points(product, directory, overlay)
    covered = {"package": package_fingerprint(), **{k: points[k] for k in ("product", "version", "set", "points")}}
    digest = hashlib.sha256(json.dumps(covered, sort_keys=True).encode()).hexdigest()[:DIGEST_CHARS]
    return digest, {**covered, "source": points["source"], "root": points["root"]}


def describe(covered: Dict[str, object]) -> str:
    runs = sum(1 for p in covered["points"] if p["runs"])
    if covered["set"] == "none":
        return f"megatron-mm-balance {covered['package']}, no {PRODUCT_NAME[covered['product']]} tree of ours"
    return (f"megatron-mm-balance {covered['package']}, {PRODUCT_NAME[covered['product']]} "
            f"{covered['version']} with set {covered['set']}: {runs} of {len(covered['points'])} hook points "
            f"running (from the {covered['source']})")


def _store():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    getter = getattr(c10d, "_get_default_store", None)
    if getter is None:
        raise CodeMismatch("this torch has no default store to compare code digests on")
    return getter(), dist.get_rank(), dist.get_world_size()


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def compare_digests(digests: Dict[int, str]) -> Optional[str]:
    """None when every rank reported the same digest, else the one line that says which ranks
    differ: the smallest groups first (the odd ones out), each with its digest."""
    groups: Dict[str, List[int]] = {}
    for rank in sorted(digests):
        groups.setdefault(digests[rank], []).append(rank)
    if len(groups) <= 1:
        return None
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
    parts = [f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {d}" for d, ranks in ordered]
    return ("the ranks do not run the same code: " + "; ".join(parts)
            + " (digest of megatron-mm-balance's files and the hook points each rank loaded; "
              "python -m megatron_mm_balance.patching digest DIR shows a tree's)")


def agree_on_code(product: str, *, timeout_s: float = 300.0, directory: Optional[Path] = None) -> str:
    """Every rank of the job calls this once at the same point: its digest goes into the job's
    store, and each waits (at most ``timeout_s``) for every rank's. Returns the common digest;
    on disagreement, or a rank that never reported, prints one line on every rank and raises
    :class:`SystemExit` (1). ``directory``: the tree to digest (default: the one loaded)."""
    digest, covered = code_digest(product, directory)
    store, rank, world = _store()
    call = _CALLS[product] = _CALLS.get(product, 0) + 1      # every rank calls in the same order
    prefix = f"mm_balance/code/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{product}/{call}"
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.set(keys[rank], digest)
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:                                   # DistStoreError / RuntimeError on timeout
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        _stop(rank, f"{_ranks(missing)} reported no code digest within {timeout_s:.0f} s (they run without "
                    f"the mm-balance hook: an unpatched or other {PRODUCT_NAME[product]} tree); this rank has {digest}")
    digests = {r: store.get(k).decode() for r, k in enumerate(keys)}
    line = compare_digests(digests)
    if line:
        _stop(rank, line)
    if rank == 0:
        print(f"[mm-balance] code: digest {digest} on all {world} ranks ({describe(covered)})", flush=True)
    return digest


def _stop(rank: int, line: str) -> None:
    print(f"[mm-balance] rank {rank}: {line}", file=sys.stderr, flush=True)
    raise SystemExit(1)
