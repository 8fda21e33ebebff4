"""Our patches as data: parse ``patches/<set>/*.patch`` and apply their hunks to a file's text in
memory, the way ``git apply`` does without fuzz (every context and removed line must match, at
the hunk's line or wherever it moved), or find them already there.

Pure text: no import of Megatron, Bridge or torch. :mod:`.overlay` compiles the result at import
time (the read-only trees' path); ``scripts/apply_patches.sh`` writes the same result to files
with ``git apply`` (``tests/megatron_glue/test_overlay.py`` checks that both give the same bytes).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ ?(.*)$")
FUNCTION = re.compile(r"\b(def|class)\s+(\w+)")


class PatchFormatError(ValueError):
    """A patch file that is not a git unified diff of the form our sets use."""


@dataclass(frozen=True)
class Hunk:
    """One hunk of one patch: where it expects to be, what it finds there, what it leaves."""

    patch: str          #: the patch file's name (``0002-training-wrap-train-data-iterator.patch``)
    path: str           #: the target file, as the patch names it (``megatron/training/training.py``)
    index: int          #: 1-based, within its file section
    old_start: int      #: 1-based line of its first line in the tree it was made on
    before: Tuple[str, ...]     #: context and removed lines (each without its newline)
    after: Tuple[str, ...]      #: context and added lines
    added: Tuple[str, ...]      #: the added lines alone (the hook itself, without its surroundings)
    header: str         #: the text after ``@@ ... @@`` (git's enclosing def or class)

    @property
    def function(self) -> str:
        """The enclosing function or class, from the hunk header (``pretrain()``, ``class
        ConfigContainer``); ``module level`` when the header names none."""
        m = FUNCTION.search(self.header)
        if not m:
            return "module level"
        return f"{m.group(2)}()" if m.group(1) == "def" else f"class {m.group(2)}"

    def where(self) -> str:
        return f"{self.path}, {self.function} ({self.patch}, hunk {self.index})"


def enclosing(text: str, line: int) -> Optional[str]:
    """The innermost function or class of ``text`` (Python source) around 1-based ``line``
    (``pretrain()``, ``class ConfigContainer``), ``module level`` outside any; None when the text
    does not parse."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno:
                best = node
    if best is None:
        return "module level"
    return f"class {best.name}" if isinstance(best, ast.ClassDef) else f"{best.name}()"


def parse_patch(path: Path) -> List[Hunk]:
    """The hunks of one patch file (git's ``diff --git`` format, no binary parts)."""
    name = Path(path).name
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    hunks: List[Hunk] = []
    target: Optional[str] = None
    k, index = 0, 0
    while k < len(lines):
        line = lines[k]
        if line.startswith("diff --git "):
            target, index = None, 0
        elif line.startswith("+++ "):
            if not line.startswith("+++ b/"):
                raise PatchFormatError(f"{name}: unexpected file header {line!r}")
            target = line[len("+++ b/"):]
        elif line.startswith("@@"):
            m = HUNK_HEADER.match(line)
            if not m or target is None:
                raise PatchFormatError(f"{name}: bad hunk header {line!r}")
            old_len = int(m.group(2) or 1)
            new_len = int(m.group(4) or 1)
            before, after, added = [], [], []
            k += 1
            while k < len(lines) and (len(before) < old_len or len(after) < new_len):
                body = lines[k]
                tag, text = (body[:1], body[1:]) if body else (" ", "")
                if tag == " ":
                    before.append(text)
                    after.append(text)
                elif tag == "-":
                    before.append(text)
                elif tag == "+":
                    after.append(text)
                    added.append(text)
                elif tag != "\\":
                    raise PatchFormatError(f"{name}: bad hunk line {body!r}")
                k += 1
            if len(before) != old_len or len(after) != new_len:
                raise PatchFormatError(f"{name}: hunk {line!r} has {len(before)}/{len(after)} lines")
            index += 1
            hunks.append(Hunk(name, target, index, int(m.group(1)), tuple(before), tuple(after),
                              tuple(added), m.group(5).strip()))
            continue
        k += 1
    if not hunks:
        raise PatchFormatError(f"{name}: no hunk")
    return hunks


def parse_set(directory: Path) -> List[Hunk]:
    """Every hunk of a patch set, in the order ``apply_patches.sh`` applies its files."""
    patches = sorted(Path(directory).glob("*.patch"))
    if not patches:
        raise PatchFormatError(f"no patches in {directory}")
    return [h for p in patches for h in parse_patch(p)]


def _find(lines: Sequence[str], block: Sequence[str], near: int) -> Optional[int]:
    """The start of ``block`` in ``lines`` closest to ``near`` (0-based), as git apply looks for
    a hunk: at its line first, then one line before, one after, and so on."""
    n, m = len(lines), len(block)
    if m == 0 or m > n:
        return None
    near = min(max(near, 0), n - m)
    for step in range(0, n):
        for pos in ((near,) if step == 0 else (near - step, near + step)):
            if 0 <= pos <= n - m and list(lines[pos:pos + m]) == list(block):
                return pos
        if near - step < 0 and near + step > n - m:
            break
    return None


@dataclass(frozen=True)
class HunkResult:
    """What became of one hunk on one text: ``takes`` (applied here), ``in the file`` (the text
    already holds it) or ``refused`` (neither its old nor its new lines are there)."""

    hunk: Hunk
    state: str
    line: Optional[int] = None      #: 1-based line of its first line in the result


def apply_hunks(text: str, hunks: Sequence[Hunk]) -> Tuple[str, List[HunkResult]]:
    """``text`` with each hunk applied where it fits (hunks of one file, in patch order), and what
    became of each. A hunk that fits neither way leaves the text as it was and is ``refused``:
    the caller decides (the overlay refuses the whole job, never a part of it)."""
    lines = text.split("\n")
    trailing_newline = text.endswith("\n")
    if trailing_newline:
        lines.pop()
    results: List[HunkResult] = []
    shift, patch = 0, None
    for hunk in hunks:
        if hunk.patch != patch:          # a new patch file: its line numbers are its own tree's
            shift, patch = 0, hunk.patch
        near = hunk.old_start - 1 + shift
        at = _find(lines, hunk.before, near)
        if at is not None:
            lines[at:at + len(hunk.before)] = list(hunk.after)
            shift = at - (hunk.old_start - 1) + len(hunk.after) - len(hunk.before)
            results.append(HunkResult(hunk, "takes", at + 1))
            continue
        at = _find(lines, hunk.after, near)
        if at is not None:
            shift = at - (hunk.old_start - 1) + len(hunk.after) - len(hunk.before)
            results.append(HunkResult(hunk, "in the file", at + 1))
            continue
        results.append(HunkResult(hunk, "refused"))
    out = "\n".join(lines)
    return (out + "\n" if trailing_newline else out), results
