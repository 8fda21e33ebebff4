"""Energon's checkpoint and restore contract for the task encoder ``--mm-balance-task-encoder``
builds: Megatron-LM's examples/multimodal TaskEncoder with ``BalancedPackingMixin``, over a
``make-dataset`` output, through energon's real ``get_train_dataset``/``get_savable_loader``.

One subprocess (Megatron's globals and import paths stay out of the test process) runs,
for each encoder: 3 batches, ``save_state_rank``, 4 more; a fresh encoder and loader restored
from the saved state must give the same 4 batches; and the last batch restored from its
``__restore_key__`` must equal it when ``can_restore_sample()`` says it can.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checks(dataset_dir, megatron_lm_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-m", "megatron_mm_balance.testing.example_encoder",
                        str(megatron_lm_dir), str(dataset_dir), "--restore", "balanced,stock,balanced-unmarked",
                        "--num-workers", "1"],
                       capture_output=True, text=True, timeout=480, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_balanced_encoder_resumes_exactly_and_restores_batches(checks):
    c = checks["balanced"]
    assert c["resumed_equal"], c["mismatched"]
    assert {"image_tokens", "image_token_counts", "tokens", "num_tiles", "cu_lengths"} <= set(c["keys"])
    assert all(n > 0 for n in c["image_tokens"])
    assert c["can_restore_sample"] is True and c["restored_equal"] is True


def test_restorability_follows_the_marks(checks):
    """The stock example's batch carries no @stateless mark: energon cannot restore its batches,
    nor those of the mixin when it only follows the example's marks; save/restore_state still works."""
    for kind in ("stock", "balanced-unmarked"):
        c = checks[kind]
        assert c["resumed_equal"], (kind, c["mismatched"])
        assert c["can_restore_sample"] is False and c["restored_equal"] is None, kind
    assert "image_tokens" not in checks["stock"]["keys"]
