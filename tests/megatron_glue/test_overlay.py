"""The import-time overlay (megatron_mm_balance/patching/) and the same-code digest, against the
Megatron-LM release trees of the archives (megatron_trees.py): nothing here trains.

* the overlay's in-memory sources are byte for byte what ``apply_patches.sh`` writes, on every
  release and on main; on a file-patched tree every hook is ``in the file``;
* ``apply_patches.sh DIR --check --overlay`` says which hooks would take; a target whose hook
  context changed is refused at start-up naming the file and the function, and nothing is
  installed; a target imported before the overlay is refused;
* in a process: core_v0.16.1 read-only (chmod -R a-w), unpatched, with the overlay imports,
  parses and validates exactly as the file-patched tree does (test_glue_patches.py's check),
  and no file of the tree is written.

The launcher paths under the overlay (read-only trees, equal losses) are in
tests/realpath/test_real_path_main.py and tests/bridge/test_bridge_main.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trees import PATCH_SET, RELEASES, ROOT, tree_hash
from test_glue_patches import PARSE_CHECK, run_script

from megatron_mm_balance.patching import overlay as ov
from megatron_mm_balance.patching.sets import OverlayRefused

MAIN = "main-d98e8a64"
#: a context line of main's training.py hunk (0002), changed as an upstream commit would
TRAINING_CONTEXT = ("    timers('train/valid/test-data-iterators-setup').stop()\n", "    pass\n")


def read_only(d: Path) -> Path:
    subprocess.run(["chmod", "-R", "a-w", str(d)], check=True)
    return d


@pytest.fixture()
def writable_tmp(tmp_path):
    """tmp_path, made writable again at the end (pytest removes it)."""
    yield tmp_path
    subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=False)


@pytest.mark.parametrize("tag", RELEASES)
def test_overlay_sources_are_what_apply_patches_writes(mlm_trees, tmp_path, tag):
    pristine = mlm_trees.source(tag)
    plan = ov.plan("megatron-lm", pristine)
    assert plan.set_name == PATCH_SET[tag]
    assert {h.state for h in plan.hooks} == {"takes"}
    patched = mlm_trees.copy(tag, tmp_path / "Megatron-LM")
    assert run_script(patched).returncode == 0
    for path, text in plan.set_fit.texts:
        assert (patched / path).read_text() == text, path        # byte for byte git apply's result
    again = ov.plan("megatron-lm", patched)
    assert {h.state for h in again.hooks} == {"in the file"} and not again.taking()


def test_check_says_which_hooks_would_take(mlm_trees, tmp_path):
    pristine = mlm_trees.copy(MAIN, tmp_path / "Megatron-LM")
    r = run_script(pristine, "--check", "--overlay")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("overlay: Megatron-LM core_v0.20.0 for Megatron-LM at ") and "laid out as main@d98e8a64" in lines[0]
    assert "megatron/training/training.py: pretrain(): takes at line 1957 (0002-training-wrap-train-data-iterator.patch, hunk 1)" in lines
    assert "megatron/training/arguments.py: validate_args(): takes at line 1987 (0001-arguments-mm-balance-flags.patch, hunk 2)" in lines
    assert lines[-1].startswith("overlay check ok: 11 of 11 hooks would take at import (0 already in the files)")
    assert run_script(pristine).returncode == 0
    r = run_script(pristine, "--check", "--overlay")
    assert r.returncode == 0 and "0 of 11 hooks would take at import (11 already in the files)" in r.stdout
    r = run_script(pristine, "--overlay")
    assert r.returncode == 1 and "--overlay goes with --check" in r.stderr


def test_a_changed_target_is_refused_naming_the_function(mlm_trees, tmp_path):
    d = mlm_trees.copy(MAIN, tmp_path / "Megatron-LM")
    f = d / "megatron/training/training.py"
    assert f.read_text().count(TRAINING_CONTEXT[0]) == 1
    f.write_text(f.read_text().replace(*TRAINING_CONTEXT))
    r = run_script(d, "--check", "--overlay")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
    assert "megatron/training/training.py, pretrain() (0002-training-wrap-train-data-iterator.patch, hunk 1): " \
           "its context is not there" in r.stderr and "nothing was patched" in r.stderr
    finders = list(sys.meta_path)
    with pytest.raises(OverlayRefused, match=r"training\.py, pretrain\(\)"):
        ov.install("megatron-lm", d)
    assert sys.meta_path == finders and "megatron-lm" not in ov.ACTIVE           # nothing installed


#: appended to test_glue_patches.py's check (parse_args with our flags, validate_args runs our
#: checks): which loader loaded the patched modules
OVERLAY_LOADERS = r"""
import megatron.training.training as T2
print('loader', type(T2.__loader__).__name__, type(A.__loader__).__name__)
"""


def _env(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT), str(Path(__file__).parent)]),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("MM_BALANCE_OVERLAY", None)
    return env


def test_overlay_on_a_read_only_tree_parses_and_validates_as_the_patched_one(mlm_trees, writable_tmp):
    """core_v0.16.1 unpatched and read-only: the overlay gives exactly the file patches' behaviour
    (test_glue_patches.py's test_patched_megatron_imports_parses_and_validates), and writes nothing.
    The script runs as a user's would, through ``python -m megatron_mm_balance.patching run``."""
    tree = read_only(mlm_trees.copy("core_v0.16.1", writable_tmp / "Megatron-LM"))
    before = tree_hash(tree)
    script = writable_tmp / "train_check.py"
    script.write_text(PARSE_CHECK + OVERLAY_LOADERS)
    r = subprocess.run([sys.executable, "-m", "megatron_mm_balance.patching", "run", str(script), str(tree)],
                       capture_output=True, text=True, env=_env(tree), timeout=300, cwd=str(writable_tmp))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parsed True False microstep 5" in r.stdout
    assert "validate: MMBalanceConfigError --mm-balance with --micro-batch-size 2" in r.stdout
    assert "loader _PatchedLoader _PatchedLoader" in r.stdout
    assert tree_hash(tree) == before and not list(tree.rglob("__pycache__"))


def test_a_target_imported_before_the_overlay_is_refused(mlm_trees, tmp_path):
    tree = mlm_trees.copy("core_v0.16.1", tmp_path / "Megatron-LM")
    # the module as an earlier import leaves it in sys.modules (created from its file; its code
    # need not run for the check, which looks at what is loaded from where)
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('megatron.training.arguments', "
            f"{str(tree / 'megatron/training/arguments.py')!r})\n"
            "sys.modules['megatron.training.arguments'] = importlib.util.module_from_spec(spec)\n"
            "from megatron_mm_balance.patching.overlay import install\ninstall('megatron-lm')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tree), timeout=300,
                       cwd=str(tmp_path))
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_mm_balance.patching.sets.OverlayRefused: Megatron-LM overlay: ") and \
        "megatron/training/arguments.py (imported as megatron.training.arguments)" in last and \
        "imported before the overlay, so its hook would not be in the code that runs" in last, r.stderr[-2000:]
