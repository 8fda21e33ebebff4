"""Where the demo and the tests find Megatron-LM: the release archives, and one patched tree.

The archives ``Megatron-LM-<tag>.tar.gz`` live in ``shared/megatron-lm/`` beside the
clone (CI) or beside its parent (a worktree one level deeper), or wherever
``MEGATRON_LM_ARCHIVES`` says. :func:`patched_tree` unpacks one release and applies
``patches/`` with ``scripts/apply_patches.sh`` once, into ``.megatron-lm-cache/<tag>-<digest
of patches/>`` at the repository root (gitignored; a changed patch gets a fresh tree), so
that the demo and every real-path test of a run share the same tree.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
#: The release the launcher's CPU configs and the demo run on.
DEFAULT_TAG = "core_v0.16.1"
CACHE = REPO / ".megatron-lm-cache"


def archive_dirs() -> list:
    """Candidate folders of the release archives, in the order they are searched."""
    env = os.environ.get("MEGATRON_LM_ARCHIVES")
    return [Path(env)] if env else [d / "shared" / "megatron-lm" for d in (REPO.parent, REPO.parent.parent)]


def archives_dir() -> Path:
    """The first candidate folder that exists (the first candidate when none does)."""
    cands = archive_dirs()
    return next((d for d in cands if d.is_dir()), cands[0])


def archive(tag: str = DEFAULT_TAG) -> Path:
    """The release archive of ``tag`` (the first candidate location when none exists)."""
    cands = [d / f"Megatron-LM-{tag}.tar.gz" for d in archive_dirs()]
    return next((a for a in cands if a.is_file()), cands[0])


def patches_digest() -> str:
    """Short hash of every patch under ``patches/``: the cache key of a patched tree."""
    h = hashlib.sha256()
    for p in sorted((REPO / "patches").rglob("*.patch")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def patched_tree(tag: str = DEFAULT_TAG) -> Optional[Path]:
    """``tag``'s release with ``patches/`` applied (unpacked and patched on first use), or
    None when its archive is not there."""
    src = archive(tag)
    if not src.is_file():
        return None
    dest = CACHE / f"{tag}-{patches_digest()}"
    tree = dest / f"Megatron-LM-{tag}"
    if (dest / ".ready").is_file():
        return tree
    tmp = CACHE / f".unpack-{os.getpid()}"
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    tmp.mkdir(parents=True)
    with tarfile.open(src) as tf:
        tf.extractall(tmp, filter="data")
    subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(tmp / f"Megatron-LM-{tag}")],
                   check=True, timeout=120, stdout=subprocess.DEVNULL)
    (tmp / ".ready").write_text("patched\n")
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    os.replace(tmp, dest)
    return tree


def user_tree(tag: str = DEFAULT_TAG) -> Optional[Path]:
    """``MEGATRON_LM_DIR`` when set (used as is: the launcher refuses it while patches are
    pending), else :func:`patched_tree`."""
    env = os.environ.get("MEGATRON_LM_DIR")
    if env:
        return Path(env)
    return patched_tree(tag)
