"""The same code on every rank (megatron_mm_balance/patching/digest.py), against the Megatron-LM
main tree of the archives: the digest is the same for the same hooks from the files or from the
overlay, and differs for a stale hook or an unpatched tree; two real gloo ranks with different
trees stop with one line naming the rank and both digests; a rank that never reports is named
after the timeout (no hang)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_trees import ROOT
from test_glue_patches import run_script

from megatron_mm_balance.bench.runtime import free_port
from megatron_mm_balance.patching import overlay as ov
from megatron_mm_balance.patching.digest import code_digest, compare_digests

MAIN = "main-d98e8a64"


def test_digest_same_hooks_same_digest_from_files_or_overlay(mlm_trees, tmp_path):
    pristine = mlm_trees.source(MAIN)
    patched = mlm_trees.copy(MAIN, tmp_path / "patched")
    assert run_script(patched).returncode == 0
    from_files, covered = code_digest("megatron-lm", patched)
    from_overlay, covered_o = code_digest("megatron-lm", overlay=ov.plan("megatron-lm", pristine))
    assert from_files == from_overlay and covered["source"] == "files" and covered_o["source"] == "overlay"
    assert all(p["runs"] for p in covered["points"]) and len(covered["points"]) == 11
    unpatched, covered_u = code_digest("megatron-lm", pristine)               # hooks only in the patch
    assert unpatched != from_files and not any(p["runs"] for p in covered_u["points"])
    stale = stale_tree(patched, tmp_path / "stale")
    assert code_digest("megatron-lm", stale)[0] not in (from_files, unpatched)


def stale_tree(patched: Path, dst: Path) -> Path:
    """A copy of a patched tree whose training hook is another version's (a stale image)."""
    subprocess.run(["cp", "-a", str(patched), str(dst)], check=True)
    f = dst / "megatron/training/training.py"
    text = f.read_text()
    old = "train_data_iterator = wrap_train_data_iterator(train_data_iterator, args, model=model)"
    assert text.count(old) == 1
    f.write_text(text.replace(old, "train_data_iterator = wrap_train_data_iterator(train_data_iterator, args)"))
    return dst


def test_compare_digests_names_the_odd_ranks():
    assert compare_digests({0: "a", 1: "a", 2: "a"}) is None
    line = compare_digests({0: "a", 1: "b", 2: "a", 3: "a"})
    assert line.startswith("the ranks do not run the same code: rank 1 has b; ranks 0, 2, 3 have a (")
    assert compare_digests({0: "a", 1: "b"}).startswith("the ranks do not run the same code: rank 0 has a; rank 1 has b")


#: One rank of a 2-process gloo job: joins, agrees on the code digest of the tree it is given.
RANK = r"""
import os, sys
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method=f"tcp://127.0.0.1:{sys.argv[2]}")
tree = sys.argv[3]
if tree == "-":                      # a rank without the hook: never reports, waits past the others
    import time; time.sleep(float(sys.argv[4]) + 3); sys.exit(0)
from megatron_mm_balance.patching.digest import agree_on_code
print("agreed", agree_on_code("megatron-lm", timeout_s=float(sys.argv[4]), directory=Path(tree)), flush=True)
"""


def two_ranks(trees, timeout_s=60.0):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), str(t), str(timeout_s)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r, t in enumerate(trees)]
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout_s + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
        out.append((p.returncode, o, e))
    return out


def test_two_gloo_ranks_agree_or_stop_the_job(mlm_trees, tmp_path):
    patched = mlm_trees.copy(MAIN, tmp_path / "patched")
    assert run_script(patched).returncode == 0
    stale = stale_tree(patched, tmp_path / "stale")
    good, bad = code_digest("megatron-lm", patched)[0], code_digest("megatron-lm", stale)[0]
    (rc0, out0, _), (rc1, out1, _) = two_ranks([patched, patched])
    assert rc0 == rc1 == 0 and f"agreed {good}" in out0 and f"agreed {good}" in out1
    assert f"[mm-balance] code: digest {good} on all 2 ranks (megatron-mm-balance " in out0
    results = two_ranks([patched, stale])
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 1 and "agreed" not in out, (rank, out, err)
        lines = [x for x in err.splitlines() if x.startswith("[mm-balance]")]
        assert lines == [f"[mm-balance] rank {rank}: the ranks do not run the same code: rank 0 has {good}; "
                         f"rank 1 has {bad} (digest of megatron-mm-balance's files and the hook points each rank "
                         "loaded; python -m megatron_mm_balance.patching digest DIR shows a tree's)"], err


def test_a_rank_that_never_reports_is_named_after_the_timeout(mlm_trees, tmp_path):
    patched = mlm_trees.copy(MAIN, tmp_path / "patched")
    assert run_script(patched).returncode == 0
    (rc0, out0, err0), _ = two_ranks([patched, "-"], timeout_s=5.0)
    assert rc0 == 1 and "agreed" not in out0
    assert "[mm-balance] rank 0: rank 1 reported no code digest within 5 s (they run without the mm-balance " \
           "hook: an unpatched or other Megatron-LM tree)" in err0, err0
