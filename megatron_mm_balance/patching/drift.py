"""Drift found early: every patch set against every tree, hunk by hunk.

For each tree and each set of its product (``patches/sets.tsv``), each hunk is classified by the
least it needs to apply:

* ``exact``: at the line it names;
* ``offset N``: its lines, unchanged, N lines away (``git apply`` finds it; so does the overlay);
* ``fuzz K``: only with its outer K context lines dropped (what ``patch --fuzz K`` would accept;
  neither ``apply_patches.sh`` nor the overlay does: the hook's surroundings changed);
* ``3-way``: a 3-way merge against the tree the set was made on succeeds (``git apply --3way``
  with that tree's files as the base, in a scratch repository of the touched files; a git
  checkout with upstream's history gets this from ``apply_patches.sh``);
* ``applied``: the tree already holds it; ``conflict``: none of these.

Plus what upstream's own per-global-batch seam looks like in each Megatron-LM tree: whether
``megatron/core/datasets/data_schedule.py`` exists and whether ``training.py`` calls its
``wrap_data_iterator`` (the day a release wires it, it shows here).

``tests/megatron_glue/test_drift.py`` runs it on every tree of ``../shared``; the report is the
table it prints.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .hunks import Hunk, _find, parse_patch
from .sets import PatchSet, Tree

GIT_ENV = {"GIT_AUTHOR_NAME": "drift", "GIT_AUTHOR_EMAIL": "drift@example.com", "GIT_COMMITTER_NAME": "drift",
           "GIT_COMMITTER_EMAIL": "drift@example.com", "GIT_CONFIG_NOSYSTEM": "1"}
MAX_FUZZ = 2


@dataclass(frozen=True)
class HunkDrift:
    patch: str
    path: str
    index: int
    function: str
    how: str            #: exact, offset N, fuzz K, 3-way, applied, conflict

    @property
    def needs_attention(self) -> bool:
        """Needed more than ``git apply`` without history gives: fuzz, a 3-way merge, or failed."""
        return self.how.startswith(("fuzz", "3-way", "conflict"))


def _fuzz(lines: List[str], hunk: Hunk, near: int) -> Optional[int]:
    """The least K (1..MAX_FUZZ) for which the hunk's old lines without their outer K context
    lines on each side are found in ``lines``."""
    lead = next((i for i, (a, b) in enumerate(zip(hunk.before, hunk.after)) if a != b), len(hunk.before))
    trail = next((i for i, (a, b) in enumerate(zip(reversed(hunk.before), reversed(hunk.after))) if a != b),
                 len(hunk.before))
    for k in range(1, MAX_FUZZ + 1):
        lo, hi = min(k, lead), min(k, trail)
        core = hunk.before[lo:len(hunk.before) - hi]
        if core and _find(lines, core, near + lo) is not None:
            return k
    return None


def classify(text: str, hunks: Sequence[Hunk]) -> List[str]:
    """How each hunk of one patch file fits ``text`` (without 3-way: ``conflict`` there)."""
    lines = text.split("\n")
    out, shift = [], 0
    for hunk in hunks:
        near = hunk.old_start - 1 + shift
        at = _find(lines, hunk.before, near)
        if at is not None:
            off = at - (hunk.old_start - 1)
            out.append("exact" if off == 0 else f"offset {off:+d}")
            shift = off + len(hunk.after) - len(hunk.before)
            continue
        if _find(lines, hunk.after, near) is not None:
            out.append("applied")
            continue
        k = _fuzz(lines, hunk, near)
        out.append(f"fuzz {k}" if k else "conflict")
    return out


def _three_way(base_root: Path, tree: Tree, patch: Path, paths: Sequence[str]) -> bool:
    """Whether ``git apply --3way`` of ``patch`` merges into the tree's files, with the files of
    the tree the set was made on (``base_root``) committed first as the merge base."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **GIT_ENV, "GIT_CEILING_DIRECTORIES": str(Path(tmp).parent)}

        def git(*args):
            return subprocess.run(["git", "-C", tmp, *args], capture_output=True, text=True, env=env, timeout=120)

        git("init", "-q")
        for p in paths:
            src = base_root / p
            if not src.is_file():
                return False
            dst = Path(tmp) / p
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
        git("add", "-A")
        git("commit", "-q", "-m", "base")
        for p in paths:
            src = tree.path_of(p)
            if not src.is_file():
                return False
            (Path(tmp) / p).write_bytes(src.read_bytes())
        git("commit", "-q", "-am", "tree")
        r = git("apply", "--3way", str(patch))
        return r.returncode == 0 and "with conflicts" not in (r.stdout + r.stderr)


def drift(tree: Tree, patch_set: PatchSet, base_root: Optional[Path] = None) -> List[HunkDrift]:
    """Every hunk of ``patch_set`` on ``tree``. ``base_root``: the tree the set was made on (its
    files are the merge base of the 3-way attempt; without it no 3-way is tried)."""
    out: List[HunkDrift] = []
    for patch in sorted(patch_set.directory.glob("*.patch")):
        hunks = parse_patch(patch)
        by_file: Dict[str, List[Hunk]] = {}
        for h in hunks:
            by_file.setdefault(h.path, []).append(h)
        merged = None
        for path, file_hunks in by_file.items():
            try:
                text = tree.path_of(path).read_text(encoding="utf-8")
            except OSError:
                hows = ["conflict"] * len(file_hunks)
            else:
                hows = classify(text, file_hunks)
            if any(h == "conflict" for h in hows) and base_root is not None:
                if merged is None:
                    merged = _three_way(base_root, tree, patch, sorted(by_file))
                hows = [("3-way" if merged else "conflict") if h in ("conflict",) or h.startswith("fuzz") else h
                        for h in hows]
            out.extend(HunkDrift(patch.name, path, h.index, h.function, how) for h, how in zip(file_hunks, hows))
    return out


def upstream_seam(tree_root: Path) -> Tuple[bool, bool]:
    """``(data_schedule.py exists, training.py calls wrap_data_iterator)`` of a Megatron-LM tree."""
    has = (tree_root / "megatron/core/datasets/data_schedule.py").is_file()
    try:
        calls = "wrap_data_iterator(" in (tree_root / "megatron/training/training.py").read_text(encoding="utf-8")
    except OSError:
        calls = False
    return has, calls


def summary(results: Sequence[HunkDrift]) -> str:
    """``7 hunks: 5 exact, 2 offset`` or the hunks that need attention by name."""
    kinds: Dict[str, int] = {}
    for r in results:
        key = r.how.split()[0]
        kinds[key] = kinds.get(key, 0) + 1
    head = f"{len(results)} hunks: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    odd = [f"{r.path} {r.function} ({r.patch} #{r.index}): {r.how}" for r in results if r.needs_attention]
    return head + ("; " + "; ".join(odd) if odd else "")
