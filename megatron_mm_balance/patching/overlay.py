"""The import-time overlay: our hooks in a read-only Megatron-LM or Megatron-Bridge tree, with no
file written.

Where a tree cannot be patched in place (a container image's ``/opt``, a read-only network
share), the same hunks ``scripts/apply_patches.sh`` writes are applied to each target file's
source in memory when Python imports it, and the module is compiled from that source. It is a
``sys.meta_path`` finder in front of the others: for a module whose file is one of the patch
set's targets it hands back the spec the other finders found, with a loader that compiles the
patched source (no bytecode is read or written for it); every other module loads as before.

Why source-level, not function-level hooks: most of our hunks sit in the middle of a function and
use its locals (``pretrain()``'s ``model`` and ``args``, ``build_pretraining_data_loader``'s
``batch_sampler``, ``model_provider``'s ``add_encoder``), which a wrapper around the function
cannot reach without copying the function; a copy drifts from upstream with every release. The
hunks themselves are checked against the tree's text at start-up, exactly as ``git apply`` checks
them (every context line must be there), so one source of truth (``patches/<set>/``) serves both
paths, a target that changed is refused by name instead of patched wrongly, and the patched
module is byte for byte what the file patch would have written (tested).

All or nothing: :func:`install` reads and patches every target file of the set before it
registers the finder; one hunk that does not fit refuses the whole job (one line naming the
file, the function and the patch), and nothing is patched. Targets imported before
:func:`install` are refused too (the hook would not be in the code that runs).

Chosen by the launchers (``MM_BALANCE_OVERLAY=1``) or by running a script through
``python -m megatron_mm_balance.patching run SCRIPT ARGS``; our entry points
(``megatron_mm_balance.bridge.run``, the CPU harnesses) honour ``MM_BALANCE_OVERLAY`` themselves.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import linecache
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .hunks import HunkResult, enclosing
from .sets import PRODUCT_NAME, OverlayRefused, SetFit, Tree, choose_set, find_tree, tree_at

#: the environment variable that turns the overlay on (``1``)
ENV = "MM_BALANCE_OVERLAY"
#: the overlays installed in this process, by product
ACTIVE: Dict[str, "Overlay"] = {}

#: the module names each product's targets are imported under, by patch path (for the check that
#: none was imported before the overlay; the finder itself matches files, not names)
MODULE_OF = {
    "megatron/training/arguments.py": "megatron.training.arguments",
    "megatron/training/training.py": "megatron.training.training",
    "megatron/training/datasets/data_samplers.py": "megatron.training.datasets.data_samplers",
    "megatron/training/checkpointing.py": "megatron.training.checkpointing",
    "megatron/core/tokenizers/utils/build_tokenizer.py": "megatron.core.tokenizers.utils.build_tokenizer",
    "examples/multimodal/model.py": "model",
    "examples/multimodal/dataloader_provider.py": "dataloader_provider",
    "src/megatron/bridge/training/config.py": "megatron.bridge.training.config",
    "src/megatron/bridge/training/setup.py": "megatron.bridge.training.setup",
    "src/megatron/bridge/data/builders/energon.py": "megatron.bridge.data.builders.energon",
}


@dataclass(frozen=True)
class HookState:
    """One hook of the set on this tree, as the check reports it."""

    path: str           #: the patch's path of the file
    function: str       #: where it goes (``pretrain()``), from the patched source where it parses
    patch: str
    hunk: int
    state: str          #: ``takes`` (the overlay adds it), ``in the file``, or ``refused``
    line: Optional[int]

    def line_text(self) -> str:
        at = f" at line {self.line}" if self.line else ""
        return f"{self.path}: {self.function}: {self.state}{at} ({self.patch}, hunk {self.hunk})"


class Overlay:
    """A tree and its set, every target's patched source computed (nothing written)."""

    def __init__(self, tree: Tree, set_fit: SetFit, note: str):
        self.tree, self.set_fit, self.note = tree, set_fit, note
        self.sources: Dict[str, str] = {}             # real path -> patched source
        for path, text in set_fit.texts:
            self.sources[os.path.realpath(self.tree.path_of(path))] = text
        texts = dict(set_fit.texts)
        self.hooks: List[HookState] = [self._state(r, texts.get(r.hunk.path, "")) for r in set_fit.results]

    @staticmethod
    def _state(result: HunkResult, text: str) -> HookState:
        h = result.hunk
        function = h.function
        if result.line is not None and h.path.endswith(".py"):
            first_added = next((i for i, line in enumerate(h.after) if line in h.added), 0)
            function = enclosing(text, result.line + first_added) or function
        return HookState(h.path, function, h.patch, h.index, result.state, result.line)

    @property
    def product(self) -> str:
        return self.tree.product

    @property
    def set_name(self) -> str:
        return self.set_fit.patch_set.label

    def taking(self) -> List[HookState]:
        return [h for h in self.hooks if h.state == "takes"]

    def report(self) -> str:
        """The ``--check`` report: the set and why, then one line per hook."""
        lines = [f"overlay: {self.note}"]
        lines += [h.line_text() for h in self.hooks]
        n = len(self.taking())
        lines.append(f"overlay check ok: {n} of {len(self.hooks)} hooks would take at import "
                     f"({len(self.hooks) - n} already in the files); nothing is written")
        return "\n".join(lines)


def plan(product: str, directory: Optional[Path] = None, *, force: bool = False,
         search_path: Optional[Sequence[str]] = None) -> Overlay:
    """The overlay for ``product``'s tree (``directory``, else the one on ``search_path`` /
    ``sys.path``): every hook checked, every patched source computed. :class:`OverlayRefused`
    when any hook does not fit (naming it); nothing is installed either way."""
    tree = tree_at(product, directory) if directory else find_tree(product, search_path or sys.path)
    set_fit, note = choose_set(tree, force=force)
    return Overlay(tree, set_fit, note)


class _PatchedLoader(importlib.machinery.SourceFileLoader):
    """Compiles the patched source; reads and writes no bytecode for it."""

    def __init__(self, fullname: str, path: str, source: str):
        super().__init__(fullname, path)
        self._source = source

    def get_source(self, fullname):
        return self._source

    def get_code(self, fullname):
        return compile(self._source, self.path, "exec", dont_inherit=True)


class _OverlayFinder(importlib.abc.MetaPathFinder):
    """In front of ``sys.meta_path``: asks the finders behind it, and for a target file swaps
    the loader."""

    def __init__(self):
        self.sources: Dict[str, str] = {}

    def find_spec(self, fullname, path, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            origin = spec.origin and os.path.realpath(spec.origin)
            source = self.sources.get(origin) if origin else None
            if source is None:
                return spec
            spec.loader = _PatchedLoader(fullname, spec.origin, source)
            spec.cached = None
            spec.has_location = True
            _cache_lines(spec.origin, source)
            return spec
        return None


_FINDER: Optional[_OverlayFinder] = None


def _cache_lines(path: str, source: str) -> None:
    """Tracebacks and ``inspect`` show the patched source (what runs), not the file's."""
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)


def install(product: str, directory: Optional[Path] = None, *, force: bool = False) -> Overlay:
    """Check every hook of ``product``'s tree and, when all fit, patch its modules as they are
    imported from now on. Idempotent per product. :class:`OverlayRefused` (one line) otherwise,
    and nothing is installed."""
    global _FINDER
    if product in ACTIVE:
        return ACTIVE[product]
    overlay = plan(product, directory, force=force)
    early = []
    for path in {h.path for h in overlay.taking()}:
        real = os.path.realpath(overlay.tree.path_of(path))
        for mod in list(sys.modules.values()):
            f = getattr(mod, "__file__", None)
            if f and os.path.realpath(f) == real:
                early.append(f"{path} (imported as {mod.__name__})")
    if early:
        were = "was" if len(early) == 1 else "were"
        raise OverlayRefused(f"{PRODUCT_NAME[product]} overlay: {', '.join(sorted(early))} {were} imported before "
                             "the overlay, so its hook would not be in the code that runs; install the overlay "
                             "first (MM_BALANCE_OVERLAY=1 with our launchers, or python -m "
                             "megatron_mm_balance.patching run SCRIPT)")
    if _FINDER is None:
        _FINDER = _OverlayFinder()
        sys.meta_path.insert(0, _FINDER)
    _FINDER.sources.update(overlay.sources)
    ACTIVE[product] = overlay
    return overlay


def requested() -> bool:
    """Whether ``MM_BALANCE_OVERLAY`` asks for the overlay (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def install_if_requested(product: str) -> Optional[Overlay]:
    """:func:`install` when ``MM_BALANCE_OVERLAY`` asks for it; a refusal ends the process with
    its one line (every rank says the same)."""
    if not requested():
        return None
    try:
        return install(product)
    except OverlayRefused as exc:
        print(f"[mm-balance] {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def run_main(path: str) -> None:
    """Run ``path`` as ``__main__`` in this process, patched when it is a target of an installed
    overlay (``examples/multimodal/train.py``), else as ``runpy.run_path`` runs it."""
    real = os.path.realpath(path)
    source = next((o.sources[real] for o in ACTIVE.values() if real in o.sources), None)
    if source is None:
        import runpy
        runpy.run_path(path, run_name="__main__")
        return
    _cache_lines(path, source)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def run_script(path: str, argv: Sequence[str], product: str = "megatron-lm") -> None:
    """``python path argv`` with ``product``'s overlay installed first (a refusal: one line, exit 1)."""
    try:
        install(product)
    except OverlayRefused as exc:
        print(f"[mm-balance] {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    run_main(path)


def hook_lines(product: str) -> Tuple[str, ...]:
    """One line per hook of the active overlay (empty when none is installed)."""
    overlay = ACTIVE.get(product)
    return tuple(h.line_text() for h in overlay.hooks) if overlay else ()
