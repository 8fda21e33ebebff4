"""scripts/check_training_imports.py, the setup scripts' check of a checkout's training path.

It runs here with this interpreter against the core_v0.16.1 tree of megatron_trees.py: it
passes, and it fails with one line naming the module when a package the training path
imports is missing (``pydantic``, hidden by a stand-in that raises as an absent package
does). The setup scripts themselves run in fresh virtual environments in tests/realpath
(test_real_path_fresh_env.py, test_real_path_newest.py). About 20 s.
"""
import os
import subprocess
import sys

from megatron_trees import ROOT
import pytest

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

CHECK = ROOT / "scripts" / "check_training_imports.py"


def _check(tree, extra_path=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, str(CHECK), str(tree)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(tree))


def test_training_entry_points_import(mlm_trees, tmp_path):
    tree = mlm_trees.copy("core_v0.16.1", tmp_path / "Megatron-LM")
    r = _check(tree)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(f"training entry points import: Megatron-LM 0.16.1 at {tree} (")
    assert "megatron.training.training" in r.stdout and "train)" in r.stdout


def test_a_missing_package_is_named_in_one_line(mlm_trees, tmp_path):
    tree = mlm_trees.copy("core_v0.16.1", tmp_path / "Megatron-LM")
    hide = tmp_path / "hide"
    (hide / "pydantic").mkdir(parents=True)
    (hide / "pydantic" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pydantic'\", name='pydantic')\n")
    r = _check(tree, hide)
    ours = [l for l in r.stderr.splitlines() if l.startswith("check_training_imports:")]
    assert r.returncode == 1 and len(ours) == 1, r.stderr[-2000:]    # (torch and Megatron warn too)
    assert "megatron.training.training needs 'pydantic'" in ours[0]
    assert "megatron/rl/__init__.py:" in ours[0] and "Traceback" not in r.stderr


def test_not_a_checkout(tmp_path):
    r = subprocess.run([sys.executable, str(CHECK), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not a Megatron-LM checkout" in r.stderr
