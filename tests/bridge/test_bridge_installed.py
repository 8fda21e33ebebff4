"""Megatron-Bridge as users have it: any 0.6.x release (a checkout whose version says 0.6.0
or 0.6.2, one tagged v0.6.2 in git), an installed package (site-packages/megatron/bridge/ with
its megatron_bridge-<version>.dist-info) patched in place, found by ``--installed`` through
the python that imports it; main of the 0.7 line (the real tree, plain, git and installed); a
newer line (0.8.0) refused unless --force; a read-only install
refused with the remedy. The trees are copies of the v0.6.0 archive (unpacked once per
session) whose version file and dist-info say the release under test: the patch set's fit to
the real 0.6.2 files is recorded in docs/bridge.md. The launcher tests (realpath) find an
installed Bridge without MEGATRON_BRIDGE_DIR, in DRY_RUN and in one short training run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import bridge_util as bu

sys.path.insert(0, str(bu.REPO / "tests" / "megatron_glue"))
from megatron_trees import git, tree_hash  # noqa: E402  (the Megatron-LM release tests' helpers)

SUPPORTED = "supported releases: Megatron-Bridge v0.6.0, v0.7.0 (main@067f987d)"
CONFIG_PY = "training/config.py"


def states(out: str) -> dict:
    """{file: state word} from apply_patches.sh's per-file lines."""
    return {line.split(": ")[0]: line.split(": ")[1].split(" ")[0] for line in out.splitlines()
            if line.startswith(("src/megatron/", "megatron/")) and ": " in line}


def assert_apply_check_revert(tree: Path, prefix: str, *extra, n: int = 3) -> str:
    """--check (pending, nothing written), apply, apply again (nothing to do), --check
    (applied), --revert (byte for byte); returns the first line of the apply. ``n``: the
    patches of the set (the 0.6 set's 3, main's 2)."""
    before = tree_hash(tree)
    r = bu.apply_patches(tree, "--check", *extra)
    assert r.returncode == 0, r.stderr
    assert set(states(r.stdout).values()) == {"pending"} and len(states(r.stdout)) == n, r.stdout
    assert all(f.startswith(prefix) for f in states(r.stdout)), r.stdout
    assert tree_hash(tree) == before
    r = bu.apply_patches(tree, *extra)
    assert r.returncode == 0 and f"applied {n} patch(es)" in r.stdout, r.stdout + r.stderr
    first = r.stdout.splitlines()[0]
    assert "mm_balance: Optional[Any]" in (tree / prefix / "megatron/bridge" / CONFIG_PY).read_text()
    assert "applied 0 patch(es)" in bu.apply_patches(tree, *extra).stdout          # idempotent
    assert set(states(bu.apply_patches(tree, "--check", *extra).stdout).values()) == {"applied"}
    r = bu.apply_patches(tree, "--revert", *extra)
    assert r.returncode == 0 and f"reverted {n} patch(es)" in r.stdout, r.stderr
    assert tree_hash(tree) == before                                                 # byte for byte
    return first


# --------------------------------------------------------------------------- checkouts
@pytest.mark.parametrize("version", ["0.6.0", "0.6.2"])
def test_checkout_of_the_06_line_gets_its_patch_set(bridge_source, tmp_path, version):
    tree = bu.checkout_as(bridge_source, tmp_path / "Megatron-Bridge", version)
    first = assert_apply_check_revert(tree, "src/")
    assert first.startswith(f"Megatron-Bridge v{version} (src/megatron/bridge/package_info.py: {version})"), first
    assert "a patch release (or another commit) of the 0.6 line" in first
    assert "patches/megatron-bridge-v0.6.0/" in first


#: a context line of the setup.py hunk, changed by the "0.6.2" commit so that a plain apply fails
SETUP_CONTEXT = ('    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)\n',
                 '    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=False)\n')


def test_checkout_tagged_v062_in_git_merged_3way(bridge_source, tmp_path):
    """A git checkout: v0.6.0, then a commit tagged v0.6.2 that changes a context line of a
    hunk; the release comes from git describe, setup.py is merged 3-way (against the v0.6.0
    blob in the history), --revert restores it byte for byte."""
    tree = tmp_path / "Megatron-Bridge"
    subprocess.run(["cp", "-a", str(bridge_source), str(tree)], check=True)
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "v0.6.0")
    bu.set_bridge_version(tree / "src/megatron/bridge", "0.6.2")
    setup = tree / "src/megatron/bridge/training/setup.py"
    text = setup.read_text()
    assert text.count(SETUP_CONTEXT[0]) == 1
    setup.write_text(text.replace(*SETUP_CONTEXT))
    git(tree, "commit", "-q", "-am", "0.6.2")
    git(tree, "tag", "v0.6.2")
    before = tree_hash(tree)
    r = bu.apply_patches(tree, "--check")
    assert r.returncode == 0 and r.stdout.startswith("Megatron-Bridge v0.6.2 (git describe: v0.6.2;"), r.stdout
    assert "src/megatron/bridge/training/setup.py: pending (needs a 3-way merge" in r.stdout
    r = bu.apply_patches(tree)
    assert r.returncode == 0 and "setup.py: applied with git apply --3way" in r.stdout, r.stdout + r.stderr
    patched = setup.read_text()
    assert "wrap_train_data_iterator(" in patched and SETUP_CONTEXT[1] in patched
    assert "setup.py: applied (3-way merge" in bu.apply_patches(tree, "--check").stdout
    assert git(tree, "diff", "--cached", "--name-only").stdout == ""                  # index untouched
    r = bu.apply_patches(tree, "--revert")
    assert r.returncode == 0 and "reverted 3 patch(es)" in r.stdout and tree_hash(tree) == before
    assert git(tree, "status", "--porcelain").stdout == ""


def test_newer_line_refused_unless_forced(bridge_source, tmp_path):
    tree = bu.checkout_as(bridge_source, tmp_path / "Megatron-Bridge", "0.8.0")
    before = tree_hash(tree)
    for mode in ((), ("--check",)):
        r = bu.apply_patches(tree, *mode)
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
        assert "0.8.0" in r.stderr and "the 0.8 line is newer" in r.stderr and SUPPORTED in r.stderr
        assert "--force" in r.stderr and tree_hash(tree) == before
    first = assert_apply_check_revert(tree, "src/", "--force")
    assert first.startswith("Megatron-Bridge v0.8.0 (") and "--force: trying the newest patch set" in first
    # the newest set's layout (main's energon builder) is absent here: the 0.6 layout's set
    assert ("patches/megatron-bridge-v0.6.0/ (laid out as v0.6.0 (the sets of v0.7.0 and v0.6.0 both fit; "
            "v0.6.0's fixes more))") in first, first


def test_older_line_refused_even_forced(bridge_source, tmp_path):
    tree = bu.checkout_as(bridge_source, tmp_path / "Megatron-Bridge", "0.5.0")
    r = bu.apply_patches(tree, "--force")
    assert r.returncode == 1 and "not a supported Megatron-Bridge release" in r.stderr and SUPPORTED in r.stderr


# --------------------------------------------------------------------------- main (0.7.0 dev)
MAIN_LAYOUT = "laid out as main@067f987d (patches/megatron-bridge-v0.6.0/ does not fit "


@pytest.mark.parametrize("kind", ["plain", "git", "installed"])
def test_main_gets_the_set_made_on_it(bridge_main_source, tmp_path, kind):
    """Bridge main (0.7.0 dev, 067f987d) as a plain tree, as a git checkout whose local commit
    moves a context line of the setup.py hunk (3-way), and installed (site-packages): the set made
    on main (2 patches: the energon builder's fix is upstream there), layout said, byte-exact revert."""
    if kind == "installed":
        site = tmp_path / "site-packages"
        (site / "megatron").mkdir(parents=True)
        subprocess.run(["cp", "-a", str(bridge_main_source / "src/megatron/bridge"), str(site / "megatron")], check=True)
        first = assert_apply_check_revert(site, "", n=2)
        assert MAIN_LAYOUT in first and "installed package in" in first, first
        assert "does not fit megatron/bridge/data/builders/energon.py)" in first, first
        return
    tree = tmp_path / "Megatron-Bridge"
    subprocess.run(["cp", "-a", str(bridge_main_source), str(tree)], check=True)
    if kind == "git":
        git(tree, "init", "-q")
        git(tree, "add", "-A")
        git(tree, "commit", "-q", "-m", "main 067f987d")
        setup = tree / "src/megatron/bridge/training/setup.py"
        assert setup.read_text().count(SETUP_CONTEXT[0]) == 1
        setup.write_text(setup.read_text().replace(*SETUP_CONTEXT))
        git(tree, "commit", "-q", "-am", "local change")
        r = bu.apply_patches(tree, "--check")
        assert "src/megatron/bridge/training/setup.py: pending (needs a 3-way merge" in r.stdout, r.stdout
    first = assert_apply_check_revert(tree, "src/", n=2)
    assert first.startswith("Megatron-Bridge v0.7.0 (src/megatron/bridge/package_info.py: 0.7.0)"), first
    assert "main before the 0.7.0 release" in first and MAIN_LAYOUT in first, first
    assert "src/megatron/bridge/data/builders/energon.py)" in first, first
    assert "patches/megatron-bridge-v0.7.0/" in first


def test_07_version_with_the_06_layout_gets_the_06_set(bridge_source, tmp_path):
    """A commit of main from before the energon builder's fix (version file 0.7.0, 0.6 layout):
    both sets fit, the 0.6 set, whose energon fix it needs, wins; said in the first line."""
    tree = bu.checkout_as(bridge_source, tmp_path / "Megatron-Bridge", "0.7.0")
    first = assert_apply_check_revert(tree, "src/")
    assert "laid out as v0.6.0 (the sets of v0.7.0 and v0.6.0 both fit; v0.6.0's fixes more)" in first, first
    assert "patches/megatron-bridge-v0.6.0/" in first


# --------------------------------------------------------------------------- installed packages
def test_installed_package_patched_checked_reverted(bridge_source, tmp_path):
    site = bu.installed_as(bridge_source, tmp_path / "site-packages", "0.6.2")
    first = assert_apply_check_revert(site, "")
    assert first.startswith("Megatron-Bridge v0.6.2 (megatron_bridge-0.6.2.dist-info/METADATA: 0.6.2, "
                            f"installed package in {site})"), first
    assert "of the 0.6 line" in first and "patches/megatron-bridge-v0.6.0/" in first
    # the package directory itself names the same install
    r = bu.apply_patches(site / "megatron" / "bridge", "--check")
    assert r.returncode == 0 and f"installed package in {site})" in r.stdout, r.stderr


def test_installed_without_dist_info_reads_package_info(bridge_source, tmp_path):
    site = bu.installed_as(bridge_source, tmp_path / "site-packages", "0.6.2")
    shutil.rmtree(site / "megatron_bridge-0.6.2.dist-info")
    r = bu.apply_patches(site, "--check")
    assert r.returncode == 0 and "(megatron/bridge/package_info.py: 0.6.2, installed package" in r.stdout


def test_installed_newer_line_refused(bridge_source, tmp_path):
    site = bu.installed_as(bridge_source, tmp_path / "site-packages", "0.8.0")
    r = bu.apply_patches(site)
    assert r.returncode == 1 and "megatron_bridge-0.8.0.dist-info/METADATA: 0.8.0" in r.stderr
    assert "the 0.8 line is newer" in r.stderr and SUPPORTED in r.stderr


def test_installed_found_through_the_python_that_imports_it(bridge_source, tmp_path):
    """--installed asks python where megatron.bridge is: through PYTHONPATH, and in a venv
    (lib/pythonX.Y/site-packages) through --python."""
    site = bu.installed_as(bridge_source, tmp_path / "on-path", "0.6.2")
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("PYTHON", None)
    r = bu.apply_patches("--installed", "--python", sys.executable, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"Megatron-Bridge as {sys.executable} imports it: {site}/megatron/bridge"
    assert "applied 3 patch(es)" in r.stdout
    assert "applied 0 patch(es)" in bu.apply_patches("--installed", env=dict(env, PYTHON=sys.executable)).stdout

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vsite = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    shutil.rmtree(vsite)
    bu.installed_as(bridge_source, vsite, "0.6.2")
    before = tree_hash(vsite)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHON")}
    r = bu.apply_patches("--installed", "--python", venv / "bin" / "python", env=clean)
    assert r.returncode == 0 and f"imports it: {vsite}/megatron/bridge" in r.stdout, r.stdout + r.stderr
    assert "installed package in " + str(vsite) in r.stdout and "applied 3 patch(es)" in r.stdout
    r = bu.apply_patches("--installed", "--python", venv / "bin" / "python", "--revert", env=clean)
    assert r.returncode == 0 and tree_hash(vsite) == before

    r = bu.apply_patches("--installed", "--python", sys.executable, env=clean)
    assert r.returncode == 1 and "cannot import megatron.bridge" in r.stderr and len(r.stderr.splitlines()) == 1

    # an editable install (the checkout's src/ on the path) is patched as the checkout it is
    tree = bu.checkout_as(bridge_source, tmp_path / "Megatron-Bridge", "0.6.2")
    r = bu.apply_patches("--installed", "--check", env=dict(clean, PYTHONPATH=str(tree / "src")))
    assert r.returncode == 0 and r.stdout.splitlines()[1].startswith(
        "Megatron-Bridge v0.6.2 (src/megatron/bridge/package_info.py: 0.6.2)"), r.stdout
    assert "src/megatron/bridge/training/config.py: pending" in r.stdout


def test_read_only_install_refused_with_the_remedy(bridge_source):
    """An install this user cannot write (root's site-packages): one line naming the files and
    the remedy, nothing changed; --check still reports. As root the script runs as nobody."""
    as_other = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot run as a user that lacks write access")
        as_other = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    top = Path(tempfile.mkdtemp(prefix="mm-balance-readonly-"))       # outside root's private pytest dir
    try:
        site = bu.installed_as(bridge_source, top / "site-packages", "0.6.2")
        subprocess.run(["chmod", "-R", "a+rX,a-w", str(top)], check=True)
        top.chmod(0o755)
        before = tree_hash(site)
        run = lambda *a: subprocess.run([*as_other, "bash", str(bu.APPLY), *map(str, a)],  # noqa: E731
                                        capture_output=True, text=True, timeout=120, cwd="/")
        r = run(site)
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
        assert f"{site} is not writable by" in r.stderr and "megatron/bridge/training/config.py" in r.stderr
        assert "sudo bash" in r.stderr and "--installed --python ENV/bin/python" in r.stderr
        assert "megatron-bridge==0.6.2" in r.stderr and "Nothing was changed." in r.stderr
        assert tree_hash(site) == before
        r = run(site, "--check")
        assert r.returncode == 0 and "check ok" in r.stdout, r.stderr
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(top)], check=True)
        shutil.rmtree(top)


# --------------------------------------------------------------------------- launcher (realpath)
def launcher_env(python: str, mlm: Path, site: Path, **kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_BRIDGE_DIR", "PYTHON", "DRY_RUN")}
    env.update(PYTHON=python, MEGATRON_LM_DIR=str(mlm),
               PYTHONPATH=os.pathsep.join([str(site), str(bu.REPO), os.environ.get("PYTHONPATH", "")]), **kw)
    return env


@pytest.mark.realpath
def test_launcher_finds_an_installed_bridge(bridge_python, bridge_trees, bridge_source, tmp_path):
    site = bu.installed_as(bridge_source, tmp_path / "site-packages", "0.6.2")
    env = launcher_env(bridge_python, bridge_trees["mlm"], site, DRY_RUN="1", DATA_PATH="/data/q")
    launch = lambda: subprocess.run(["bash", str(bu.LAUNCHER), "--config", str(bu.CONFIG)], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    r = launch()
    assert r.returncode == 1 and f"imports it: {site}/megatron/bridge" in r.stderr, r.stderr
    assert "patches are not applied to the installed Megatron-Bridge" in r.stderr
    assert f"run scripts/apply_patches.sh --installed --python {bridge_python}" in r.stderr
    r = bu.apply_patches("--installed", "--python", bridge_python, env=env)
    assert r.returncode == 0 and "applied 3 patch(es)" in r.stdout, r.stderr
    r = launch()
    assert r.returncode == 0, r.stderr
    assert "Megatron-Bridge v0.6.2 (megatron_bridge-0.6.2.dist-info/METADATA" in r.stderr
    argv = r.stdout.splitlines()
    assert argv[:3] == [bridge_python, "-m", "torch.distributed.run"] and "megatron_mm_balance.bridge.run" in argv
    # a checkout named by MEGATRON_BRIDGE_DIR wins over the installed package (it goes first on PYTHONPATH)
    r = subprocess.run(["bash", str(bu.LAUNCHER), "--config", str(bu.CONFIG)], capture_output=True, text=True,
                       env=dict(env, MEGATRON_BRIDGE_DIR=str(bridge_trees["bridge"])), timeout=120)
    assert r.returncode == 0 and "imports it" not in r.stderr, r.stderr
    assert r.stderr.startswith("Megatron-Bridge v0.6.0 (src/megatron/bridge/package_info.py: 0.6.1)"), r.stderr


@pytest.mark.realpath
@pytest.mark.timeout(1200)
def test_installed_bridge_trains_through_gpu_check_part5(bridge_python, bridge_trees, bridge_source,
                                                         bridge_dataset, bridge_runs_dir):
    """scripts/gpu_check.py part 5 (what a 2-GPU machine runs) on a patched installed package,
    no MEGATRON_BRIDGE_DIR: two 3-iteration DP=2 jobs of the user's launcher, off and on, here
    through the launcher's CPU harness: both exit 0, lm loss equal, packs moved, the report
    and its table written."""
    site = bu.installed_as(bridge_source, bridge_runs_dir / "installed-site-packages", "0.6.2")
    env = launcher_env(bridge_python, bridge_trees["mlm"], site, DATA_PATH=bridge_dataset["DATA_PATH"],
                       PROCESSOR=bridge_dataset["PROCESSOR"])
    assert bu.apply_patches("--installed", "--python", bridge_python, env=env).returncode == 0
    out = bridge_runs_dir / "gpu-check-part5"
    r = subprocess.run([sys.executable, str(bu.REPO / "scripts" / "gpu_check.py"), "--out", str(out),
                        "--bridge-only", "--bridge-ranks", "2", "--bridge-iters", "3"],
                       env=env, capture_output=True, text=True, timeout=1100)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rep = json.loads((out / "bridge_check.json").read_text())
    off, on = rep["runs"]["dp2-off"], rep["runs"]["dp2-on"]
    assert off["rc"] == on["rc"] == 0 and sorted(off["losses"]) == sorted(on["losses"]) == ["1", "2", "3"]
    assert rep["max_rel_loss_diff"] <= 1e-5 and sum(on["packs_moved"].values()) > 0 and not off["packs_moved"]
    assert all(v > 0 for v in on["elapsed_ms"].values()) and rep["median_on_over_off"] > 0
    assert f"imports it: {site}/megatron/bridge" in Path(on["log"]).read_text()
    assert "median iteration time on / off" in r.stdout and "dp2-on" in r.stdout
    print(f"wall off {off['wall_s']:.0f}s on {on['wall_s']:.0f}s")


# --------------------------------------------------------------------------- the import-time overlay
@pytest.mark.parametrize("which", ["v0.6.0", "main", "main-installed"])
def test_overlay_sources_are_what_apply_patches_writes(bridge_source, bridge_main_source, tmp_path, which):
    """The overlay's in-memory Bridge sources equal what apply_patches.sh writes (the 0.6 set on
    v0.6.0, main's on main, a checkout and an installed package), and ``--check --overlay`` says
    which hooks would take."""
    from megatron_mm_balance.patching import overlay as ov
    src = bridge_source if which == "v0.6.0" else bridge_main_source
    if which == "main-installed":
        tree = tmp_path / "site-packages"
        (tree / "megatron").mkdir(parents=True)
        subprocess.run(["cp", "-a", str(src / "src/megatron/bridge"), str(tree / "megatron")], check=True)
    else:
        tree = tmp_path / "Megatron-Bridge"
        subprocess.run(["cp", "-a", str(src), str(tree)], check=True)
    plan = ov.plan("megatron-bridge", tree)
    assert plan.set_name == ("megatron-bridge-v0.6.0" if which == "v0.6.0" else "megatron-bridge-v0.7.0")
    assert {h.state for h in plan.hooks} == {"takes"}
    r = bu.apply_patches(tree, "--check", "--overlay")
    assert r.returncode == 0 and "hooks would take at import" in r.stdout, r.stdout + r.stderr
    assert "src/megatron/bridge/training/setup.py: setup(): takes at line" in r.stdout
    assert bu.apply_patches(tree).returncode == 0
    for path, text in plan.set_fit.texts:
        assert plan.tree.path_of(path).read_text() == text, path
    assert {h.state for h in ov.plan("megatron-bridge", tree).hooks} == {"in the file"}
