"""Megatron-LM release trees for the glue tests, unpacked once per test session.

Source of each release, in order:
  * ``MEGATRON_LM_DIR`` (a Megatron-LM checkout) for the release it holds;
  * the unmodified archives ``Megatron-LM-<tag>.tar.gz`` in ``MEGATRON_LM_ARCHIVES``,
    default ``shared/megatron-lm/`` next to the repository root or next to its parent
    (:func:`megatron_mm_balance.testing.megatron_tree.archives_dir`).
A test that needs a release neither provides is skipped with that reason. Tests never
touch the cache: they get their own copy, as a plain source tree or as a git checkout
that carries one local commit on top of the release.
"""
import hashlib
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from megatron_mm_balance.testing import megatron_tree

ROOT = Path(__file__).resolve().parents[2]
#: The Megatron-LM trees of the archives, by the name in ``Megatron-LM-<name>.tar.gz``: each
#: release tag, and main of the 0.20 line (no tag yet).
RELEASES = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0", "main-d98e8a64")
#: The patch set of each tree (``patches/<set>/``; a release tag's own, main's the one made on it).
PATCH_SET = {**{t: t for t in RELEASES if t.startswith("core_v")}, "main-d98e8a64": "core_v0.20.0"}
# The file and line the "local commit" of the git variant changes: a context line of the
# training.py hunk, so that a plain `git apply` fails there and the 3-way path is taken.
LOCAL_EDIT_FILE = "megatron/training/training.py"
LOCAL_EDIT = ("    print_datetime('after dataloaders are built')\n",
              "    print_datetime('after dataloaders are built')  # our team's local change\n")
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_NOSYSTEM": "1"}


def archives_dir() -> Path:
    return megatron_tree.archives_dir()


def package_version(tree: Path) -> str:
    """MAJOR.MINOR.PATCH from megatron/core/package_info.py."""
    vals = {}
    for line in (tree / "megatron/core/package_info.py").read_text().splitlines():
        key, _, val = line.partition("=")
        if key.strip() in ("MAJOR", "MINOR", "PATCH"):
            vals[key.strip()] = val.strip()
    return ".".join(vals.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))


# package_info.py of each tag (core_v0.19.0's already says 0.19.1).
INFO_VERSION = {"core_v0.16.1": "0.16.1", "core_v0.17.1": "0.17.1", "core_v0.18.2": "0.18.2",
                "core_v0.19.0": "0.19.1", "main-d98e8a64": "0.20.0"}


def git(d, *args, check=True):
    return subprocess.run(["git", "-C", str(d), *args], capture_output=True, text=True, check=check,
                          env={**os.environ, **GIT_ENV}, timeout=120)


def tree_hash(d: Path) -> str:
    """Hash of every file's path, mode and bytes under d (a git checkout's .git excluded,
    its index included: the tools must leave the user's staging area alone)."""
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d)
        if rel.parts[0] == ".git" or p.is_dir():
            continue
        h.update(f"{rel}\0{p.stat().st_mode:o}\0".encode())
        h.update(p.read_bytes())
    if (d / ".git" / "index").exists():
        h.update((d / ".git" / "index").read_bytes())
    return h.hexdigest()


class MegatronTrees:
    """Pristine release trees in a per-session cache; copies for tests."""

    def __init__(self, cache: Path):
        self.cache = cache

    def source(self, tag: str) -> Path:
        """The unpacked pristine tree of a release (read it, never write it)."""
        dst = self.cache / "plain" / tag
        if dst.exists():
            return dst
        env_dir = os.environ.get("MEGATRON_LM_DIR")
        if env_dir and (Path(env_dir) / "megatron/core/package_info.py").exists() \
                and package_version(Path(env_dir)) == INFO_VERSION[tag]:
            shutil.copytree(env_dir, dst, symlinks=True, ignore=shutil.ignore_patterns(".git"))
            return dst
        archive = archives_dir() / f"Megatron-LM-{tag}.tar.gz"
        if not archive.exists():
            pytest.skip(f"Megatron-LM {tag}: set MEGATRON_LM_DIR to a checkout of it, or put {archive.name} "
                        f"in {archives_dir()} (or point MEGATRON_LM_ARCHIVES at it)")
        tmp = self.cache / "unpack" / tag
        tmp.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(tmp, filter="tar")
            else:
                tf.extractall(tmp)
        dst.parent.mkdir(parents=True, exist_ok=True)
        (tmp / f"Megatron-LM-{tag}").rename(dst)
        return dst

    def git_source(self, tag: str) -> Path:
        """A git checkout of the release plus one local commit (adds a file, edits a context
        line of the training.py hunk)."""
        dst = self.cache / "git" / tag
        if dst.exists():
            return dst
        tmp = self.cache / "git-tmp" / tag
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", str(self.source(tag)), str(tmp)], check=True)
        git(tmp, "init", "-q")
        git(tmp, "add", "-A")
        git(tmp, "commit", "-q", "-m", f"{tag}")
        f = tmp / LOCAL_EDIT_FILE
        text = f.read_text()
        assert text.count(LOCAL_EDIT[0]) == 1, f"{tag}: the local-edit anchor moved"
        f.write_text(text.replace(*LOCAL_EDIT))
        (tmp / "our_team_config.sh").write_text("TP=2\n")
        git(tmp, "add", "-A")
        git(tmp, "commit", "-q", "-m", "local: our team's change")
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(dst)
        return dst

    def copy(self, tag: str, dst: Path, kind: str = "plain") -> Path:
        """A private copy: kind 'plain' (no .git) or 'git' (checkout with one local commit)."""
        src = self.source(tag) if kind == "plain" else self.git_source(tag)
        subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
        return dst

    def copy_as(self, tag: str, version: str, dst: Path, kind: str = "plain") -> Path:
        """A private copy of ``tag`` whose version file says ``version`` (MAJOR.MINOR.PATCH):
        a stand-in for another release of that line (a patch release, 0.19.2) or of a newer
        one (0.20.0). Kind 'git' also commits the change and tags it ``core_v<version>``, on
        top of the local commit, so the release comes from ``git describe``."""
        d = self.copy(tag, dst, kind)
        set_package_version(d, version)
        if kind == "git":
            git(d, "commit", "-q", "-am", f"release {version}")
            git(d, "tag", f"core_v{version}")
        return d


def rewrite_package_info(f: Path, version: str) -> None:
    """Rewrite MAJOR/MINOR/PATCH of a ``package_info.py`` (Megatron-LM's, Megatron-Bridge's)."""
    values = dict(zip(("MAJOR", "MINOR", "PATCH"), version.split(".")))
    lines = []
    for line in f.read_text().splitlines(keepends=True):
        key = line.partition("=")[0].strip()
        lines.append(f"{key} = {values[key]}\n" if key in values and "=" in line else line)
    f.write_text("".join(lines))


def set_package_version(tree: Path, version: str) -> None:
    """Rewrite MAJOR/MINOR/PATCH in megatron/core/package_info.py."""
    rewrite_package_info(tree / "megatron/core/package_info.py", version)
    assert package_version(tree) == version
