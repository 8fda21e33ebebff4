"""Which patch set a Megatron-LM or Megatron-Bridge tree gets, decided as
``scripts/apply_patches.sh`` decides it (from ``patches/sets.tsv``), for the trees the overlay
patches in memory: the version file's release, else its minor line, and on a line whose set was
made on main, the set whose hunks fit (the previous line's set where both fit and it fixes more).
No git here: an overlay reads the tree as it is (a read-only image has no history to merge).

Pure text and paths: no import of Megatron, Bridge or torch.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .hunks import Hunk, HunkResult, apply_hunks, parse_set

PRODUCTS = ("megatron-lm", "megatron-bridge")
PRODUCT_NAME = {"megatron-lm": "Megatron-LM", "megatron-bridge": "Megatron-Bridge"}


class OverlayRefused(RuntimeError):
    """The tree cannot take our hooks as a whole (unknown release, a hook whose target changed):
    one line naming it; nothing was patched."""


@dataclass(frozen=True)
class PatchSet:
    """One line of ``patches/sets.tsv``."""

    product: str
    name: str           #: the set's name (``core_v0.20.0``, ``v0.7.0``)
    version: str        #: what its tree's version file says
    made_on: str        #: a tag, or ``main@<commit>``
    directory: Path

    @property
    def line(self) -> str:
        return minor_line(self.version)

    @property
    def on_main(self) -> bool:
        return self.made_on.startswith("main@")

    @property
    def label(self) -> str:
        """``core_v0.20.0`` or ``Megatron-Bridge v0.7.0``: how the scripts name it."""
        return self.directory.name


def patch_root() -> Path:
    """``MM_BALANCE_PATCH_DIR``, else the repository's ``patches/`` (the package is installed
    editable from its checkout, as the docs install it)."""
    env = os.environ.get("MM_BALANCE_PATCH_DIR")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "patches"
    if not (root / "sets.tsv").is_file():
        raise OverlayRefused(f"no patch sets at {root} (set MM_BALANCE_PATCH_DIR to megatron-mm-balance's patches/)")
    return root


def read_sets(root: Optional[Path] = None) -> List[PatchSet]:
    """Every set of ``sets.tsv``, in its order (oldest line first, per product)."""
    root = root or patch_root()
    out = []
    for raw in (root / "sets.tsv").read_text(encoding="utf-8").splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        product, name, version, made_on = raw.split("\t")[:4]
        directory = root / (name if product == "megatron-lm" else f"megatron-bridge-{name}")
        out.append(PatchSet(product, name, version, made_on, directory))
    return out


def minor_line(version: str) -> str:
    """``0.19.2`` -> ``0.19``."""
    m = re.match(r"^(\d+\.\d+)\.", version)
    return m.group(1) if m else ""


def _version_key(line: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in line.split(".")) if line else ()


@dataclass(frozen=True)
class Tree:
    """A Megatron-LM checkout, or Megatron-Bridge (a checkout or an installed package), as the
    patches see it: ``root`` is the directory the patch paths are relative to (with ``strip_src``
    an installed Bridge's site-packages, where ``src/megatron/bridge/x`` is ``megatron/bridge/x``)."""

    product: str
    root: Path
    version: str
    found: str          #: where the version was read (``megatron/core/package_info.py: 0.20.0``)
    strip_src: bool = False

    def path_of(self, patch_path: str) -> Path:
        if self.strip_src and patch_path.startswith("src/"):
            patch_path = patch_path[len("src/"):]
        return self.root / patch_path

    def describe(self) -> str:
        return f"{PRODUCT_NAME[self.product]} at {self.root} ({self.found})"


def _package_info_version(path: Path) -> str:
    vals: Dict[str, str] = {}
    pre = ""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return ""
    for line in text.splitlines():
        m = re.match(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", line)
        if m:
            vals[m.group(1)] = m.group(2)
        m = re.match(r"""^PRE_RELEASE\s*=\s*["']([^"']*)["']""", line)
        if m and not pre:
            pre = m.group(1)
    if len(vals) < 3:
        return ""
    return f"{vals['MAJOR']}.{vals['MINOR']}.{vals['PATCH']}{pre}"


def tree_at(product: str, directory: Path) -> Tree:
    """The tree of ``product`` rooted at ``directory`` (a Bridge checkout's root or ``src/``, a
    site-packages holding ``megatron/bridge/``, or the package directory itself)."""
    d = Path(directory).resolve()
    if product == "megatron-lm":
        info = d / "megatron/core/package_info.py"
        if not (d / "megatron/training/training.py").is_file():
            raise OverlayRefused(f"{d} is not a Megatron-LM checkout (no megatron/training/training.py)")
        version = _package_info_version(info)
        return Tree(product, d, version, f"megatron/core/package_info.py: {version or 'no version'}")
    if d.name == "bridge" and d.parent.name == "megatron":
        d = d.parent.parent
    if d.name == "src" and (d / "megatron/bridge").is_dir() and not (d / "src/megatron/bridge").is_dir():
        d = d.parent
    if (d / "src/megatron/bridge").is_dir():
        version = _package_info_version(d / "src/megatron/bridge/package_info.py")
        return Tree(product, d, version, f"src/megatron/bridge/package_info.py: {version or 'no version'}")
    if (d / "megatron/bridge").is_dir():
        dists = sorted(d.glob("megatron_bridge-*.dist-info/METADATA"))
        for meta in dists[:1]:
            m = re.search(r"^Version:\s*(\S+)", meta.read_text(encoding="utf-8"), re.M)
            if m:
                return Tree(product, d, m.group(1), f"{meta.parent.name}/METADATA: {m.group(1)}", strip_src=True)
        version = _package_info_version(d / "megatron/bridge/package_info.py")
        return Tree(product, d, version, f"megatron/bridge/package_info.py: {version or 'no version'}", strip_src=True)
    raise OverlayRefused(f"{d} holds no Megatron-Bridge (no src/megatron/bridge/, no megatron/bridge/)")


def find_tree(product: str, search_path: Sequence[str]) -> Tree:
    """The tree ``import`` would load ``product`` from along ``search_path`` (``sys.path``): the
    first entry holding Megatron-LM's ``megatron/training`` or Bridge's ``megatron/bridge``."""
    for entry in search_path:
        d = Path(entry or os.getcwd())
        if product == "megatron-lm" and (d / "megatron/training/training.py").is_file() \
                and (d / "megatron/core/package_info.py").is_file():
            return tree_at(product, d)
        if product == "megatron-bridge" and (d / "megatron/bridge/__init__.py").is_file():
            return tree_at(product, d)
    raise OverlayRefused(f"no {PRODUCT_NAME[product]} on the Python path "
                         f"({'a checkout with megatron/training' if product == 'megatron-lm' else 'megatron/bridge'})")


@dataclass(frozen=True)
class SetFit:
    """A set on a tree: what each hunk does there, and the patched text of each file."""

    patch_set: PatchSet
    results: Tuple[HunkResult, ...]
    texts: Tuple[Tuple[str, str], ...]      #: (patch path, text with the set's hunks)
    missing: Tuple[str, ...]                #: patch paths the tree lacks

    @property
    def fits(self) -> bool:
        return not self.missing and all(r.state != "refused" for r in self.results)

    @property
    def refused(self) -> List[HunkResult]:
        return [r for r in self.results if r.state == "refused"]


def fit(tree: Tree, patch_set: PatchSet) -> SetFit:
    """Apply ``patch_set``'s hunks to the tree's files in memory (nothing is written)."""
    by_file: Dict[str, List[Hunk]] = {}
    for h in parse_set(patch_set.directory):
        by_file.setdefault(h.path, []).append(h)
    results, texts, missing = [], [], []
    for path, hunks in by_file.items():
        try:
            text = tree.path_of(path).read_text(encoding="utf-8")
        except OSError:
            missing.append(path)
            continue
        patched, res = apply_hunks(text, hunks)
        results.extend(res)
        texts.append((path, patched))
    return SetFit(patch_set, tuple(results), tuple(texts), tuple(missing))


def choose_set(tree: Tree, sets: Optional[Sequence[PatchSet]] = None, *, force: bool = False) -> Tuple[SetFit, str]:
    """The set this tree gets and a one-line account of why; :class:`OverlayRefused` when there
    is none (an unknown release, a newer line without ``force``, or hunks that fit nowhere)."""
    sets = [s for s in (sets or read_sets()) if s.product == tree.product]
    name = PRODUCT_NAME[tree.product]
    supported = ", ".join(s.label + (f" ({s.made_on})" if s.on_main else "") for s in sets)
    version, line = tree.version, minor_line(tree.version)
    chosen = next((s for s in sets if s.version == version), None)
    how = "release"
    if chosen is None:
        chosen = next((s for s in sets if s.line == line), None)
        how = "line"
    if chosen is None:
        newest = sets[-1]
        if force and line and _version_key(line) > _version_key(newest.line):
            chosen, how = newest, "forced"
        else:
            newer = bool(line) and _version_key(line) > _version_key(newest.line)
            raise OverlayRefused(
                f"{tree.describe()} is not a supported {name} release"
                + (f": the {line} line is newer than every patch set" if newer else "")
                + f"; supported releases: {supported}")
    candidates = [chosen]
    if chosen.on_main:
        i = sets.index(chosen)
        if i > 0:
            candidates.append(sets[i - 1])
    fits = [fit(tree, s) for s in candidates]
    good = [f for f in fits if f.fits]
    if not good:
        f = fits[0]
        what = "; ".join(f"{r.hunk.where()}: its context is not there" for r in f.refused)
        what = what or f"missing files {', '.join(f.missing)}"
        raise OverlayRefused(f"{tree.describe()}: the {f.patch_set.label} hooks do not fit: {what}; "
                             "nothing was patched")
    best = max(good, key=lambda f: (len(list(f.patch_set.directory.glob('*.patch'))), f is fits[0]))
    note = f"{name} {best.patch_set.label} for {tree.describe()}"
    if how == "line" and best.patch_set.version != version:
        note += f": the {line} line's set"
    if how == "forced":
        note += f": forced, the newest set on the {line} line"
    if len(candidates) > 1:
        if len(good) > 1:
            note += f"; laid out as {best.patch_set.made_on if best.patch_set.on_main else best.patch_set.label} " \
                    f"(both sets fit; {best.patch_set.label}'s fixes more)"
        else:
            other = next(f for f in fits if f is not best)
            files = sorted({r.hunk.path for r in other.refused} | set(other.missing))
            note += f"; laid out as {best.patch_set.made_on if best.patch_set.on_main else best.patch_set.label} " \
                    f"({other.patch_set.label} does not fit {', '.join(files)})"
    return best, note
