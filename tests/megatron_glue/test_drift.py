"""Drift found early: every patch set applied to every tree of ``../shared`` (Megatron-LM's
release archives and main, the Megatron-LM commits Bridge pins, Bridge v0.6.0 and main), hunk by
hunk (megatron_mm_balance/patching/drift.py): exact, offset, fuzz, 3-way merge against the tree
the set was made on, or conflict; and whether each Megatron-LM tree's ``training.py`` calls
upstream's ``wrap_data_iterator`` (its per-global-batch scheduler, which would rebalance what we
balance). Every tree is accepted by its own set (``apply_patches.sh --check``, all pending) with
no hunk that needs fuzz or a 3-way merge; the README's support line names exactly these trees.
The report is printed (``-s``). About a minute on 2 cores, most of it unpacking."""
from __future__ import annotations

import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from megatron_trees import ROOT, archives_dir

from megatron_mm_balance.patching.drift import drift, summary, upstream_seam
from megatron_mm_balance.patching.sets import read_sets, tree_at

BRIDGE_ARCHIVES = archives_dir().parent / "megatron-bridge"
#: the tree each set was made on, by its made_on column (the base of the 3-way attempts)
MADE_ON_TREE = {"core_v0.16.1": "Megatron-LM-core_v0.16.1", "core_v0.17.1": "Megatron-LM-core_v0.17.1",
                "core_v0.18.2": "Megatron-LM-core_v0.18.2", "core_v0.19.0": "Megatron-LM-core_v0.19.0",
                "main@d98e8a64": "Megatron-LM-main-d98e8a64", "v0.6.0": "Megatron-Bridge-v0.6.0",
                "main@067f987d": "Megatron-Bridge-main-067f987d"}


@pytest.fixture(scope="module")
def shared_trees(mlm_trees, tmp_path_factory) -> dict:
    """Every tree of the archives: ``{name: path}`` (the release trees from the session cache)."""
    archives = sorted(archives_dir().glob("Megatron-LM-*.tar.gz")) + sorted(BRIDGE_ARCHIVES.glob("*.tar.gz"))
    if not archives:
        pytest.skip(f"no archives in {archives_dir()}")
    trees, dest = {}, tmp_path_factory.mktemp("shared-trees")
    for a in archives:
        name = a.name[:-len(".tar.gz")]
        tag = name[len("Megatron-LM-"):]
        if a.parent == archives_dir():
            trees[name] = mlm_trees.source(tag)
            continue
        with tarfile.open(a) as tf:
            tf.extractall(dest, filter="data")
        trees[name] = dest / name
    return trees


def _product(path: Path) -> str:
    return "megatron-bridge" if (path / "src/megatron/bridge").is_dir() else "megatron-lm"


def test_every_set_on_every_tree(shared_trees):
    sets = read_sets()
    lines, attention = [], []
    for name, path in shared_trees.items():
        product = _product(path)
        tree = tree_at(product, path)
        r = subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), str(path), "--check"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{name} is refused by its own set: {r.stderr}"
        m = re.search(r"patch set patches/([^/]+)/", r.stdout) or re.match(r"Megatron-(?:LM|Bridge) (\S+) \(", r.stdout)
        own = m.group(1)
        own = own[len("megatron-bridge-"):] if own.startswith("megatron-bridge-") else own
        assert {w for w in re.findall(r": (\w+) \(\d{4}-", r.stdout)} == {"pending"}, r.stdout
        seam = ""
        if product == "megatron-lm":
            has, calls = upstream_seam(path)
            seam = (f"; data_schedule.py {'present' if has else 'absent'}, training.py "
                    f"{'calls' if calls else 'does not call'} wrap_data_iterator")
        lines.append(f"{name} ({tree.found}): own set {own}{seam}")
        newest = [s for s in sets if s.product == product][-1]
        for s in sets:
            if s.product != product:
                continue
            # a 3-way merge is tried for the tree's own set and the newest (what a release needs);
            # the other pairs are reported without it (git runs dominate the test's time)
            three_way = s.name in (own, newest.name)
            base = shared_trees.get(MADE_ON_TREE.get(s.made_on, "")) if three_way else None
            results = drift(tree, s, base_root=base)
            mark = "*" if s.name == own else " "
            lines.append(f"  {mark} {s.label:<24} {summary(results)}")
            if s.name == own:
                attention += [f"{name}: {r}" for r in results if r.needs_attention]
    print("\ndrift report (* the tree's own set; 3-way merges tried for it and the newest set):\n" + "\n".join(lines))
    assert not attention, "hunks of a tree's own set that need fuzz or a 3-way merge:\n" + "\n".join(map(str, attention))


def test_main_says_whether_training_calls_upstreams_scheduler(shared_trees):
    """main at d98e8a64 has data_schedule.py and does not wire it (the day a tree does, the
    report says so and apply_patches.sh's layout line too)."""
    has, calls = upstream_seam(shared_trees["Megatron-LM-main-d98e8a64"])
    assert has and not calls
    r = subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), str(shared_trees["Megatron-LM-main-d98e8a64"]),
                        "--check"], capture_output=True, text=True, timeout=300)
    assert "layout: megatron/core/datasets/data_schedule.py present, not called by training.py" in r.stdout


def test_readme_names_exactly_the_trees_ci_runs(shared_trees):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.find("CI runs every patch set on every tree")
    assert start >= 0, "README.md has no support paragraph starting 'CI runs every patch set on every tree'"
    paragraph = text[start:].split("\n\n")[0]
    named = set(re.findall(r"`(Megatron-(?:LM|Bridge)-[^`]+)`", paragraph))
    assert named == set(shared_trees), (sorted(named), sorted(shared_trees))
