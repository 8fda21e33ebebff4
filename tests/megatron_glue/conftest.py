"""Session fixture: Megatron-LM release trees (see megatron_trees.py)."""
import pytest

from megatron_trees import MegatronTrees


@pytest.fixture(scope="session")
def mlm_trees(tmp_path_factory) -> MegatronTrees:
    """Pristine release trees unpacked once per session; tests take copies."""
    return MegatronTrees(tmp_path_factory.mktemp("megatron-lm-releases"))
