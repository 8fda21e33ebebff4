"""Fixtures for the dataset tests: a small make-dataset output and a Megatron-LM source tree.

The Megatron-LM tree is ``$MEGATRON_LM_DIR`` or, when unset, the core_v0.16.1 release
archive (``shared/megatron-lm/`` beside the repository or its parent:
:mod:`megatron_mm_balance.testing.megatron_tree`), partly unpacked once per session;
tests that need it are skipped with the reason when neither exists.
"""
import os
import tarfile
from pathlib import Path

import pytest

from megatron_mm_balance.testing import megatron_tree

ARCHIVE = megatron_tree.archive("core_v0.16.1")


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory):
    """``make-dataset --samples 96 --seed 7``: the dataset every test here reads."""
    from megatron_mm_balance.data.make_dataset import make_dataset

    out = tmp_path_factory.mktemp("mkds") / "data"
    make_dataset(out, samples=96, seed=7)
    return out


@pytest.fixture(scope="session")
def megatron_lm_dir(tmp_path_factory):
    d = os.environ.get("MEGATRON_LM_DIR")
    if d:
        if not (Path(d) / "examples" / "multimodal" / "dataset_helpers.py").is_file():
            pytest.skip(f"MEGATRON_LM_DIR={d} has no examples/multimodal/dataset_helpers.py")
        return Path(d)
    if not ARCHIVE.is_file():
        pytest.skip(f"MEGATRON_LM_DIR is unset and {ARCHIVE} does not exist")
    dest = tmp_path_factory.mktemp("megatron-lm")
    with tarfile.open(ARCHIVE) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.split("/")[1:2] in (["megatron"], ["examples"])]
        tar.extractall(dest, members=members, filter="data")
    return dest / "Megatron-LM-core_v0.16.1"
