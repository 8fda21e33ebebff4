"""Session fixtures: Megatron-LM release trees (see megatron_trees.py), and one patched
core_v0.16.1 tree for the tests that only read a patched tree."""
import subprocess
from pathlib import Path

import pytest

from megatron_trees import MegatronTrees


@pytest.fixture(scope="session")
def mlm_trees(tmp_path_factory) -> MegatronTrees:
    """Pristine release trees unpacked once per session; tests take copies."""
    return MegatronTrees(tmp_path_factory.mktemp("megatron-lm-releases"))


@pytest.fixture(scope="session")
def patched_v16(mlm_trees, tmp_path_factory) -> Path:
    """core_v0.16.1 with ``scripts/apply_patches.sh`` applied, built once per session and
    shared by the tests that only read it (launcher dry runs, Megatron's own parse_args and
    validate_args); tests that patch, revert or edit a tree take their own copy."""
    from megatron_trees import ROOT
    tree = mlm_trees.copy("core_v0.16.1", tmp_path_factory.mktemp("patched-v16") / "Megatron-LM")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), str(tree)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return tree
