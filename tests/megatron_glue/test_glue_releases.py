"""Every supported Megatron-LM release after core_v0.16.1, under the Python they require.

core_v0.17.1 and later need Python >= 3.12 (``typing.override`` in megatron/training).
These tests build (once, idempotently) the separate Python 3.12 environment of
``scripts/setup_env_py312.sh`` (``.venv-py312/``, about 5 GB, 3 minutes the first time)
and run, in that interpreter, against each release's patched tree (its own
``megatron/core`` first on PYTHONPATH):
  * the patched tree imports (megatron.training.training, examples/multimodal model and
    train), and Megatron's own parse_args + validate_args accept every config's launch
    command (tests/megatron_glue/release_check.py);
  * the glue's own tests (real gloo processes), which exercise the release's API:
    RerunDataIterator, parallel_state, the micro-batch calculator, the samplers.
They are skipped, with the reason, only when the environment cannot be built or a
release's archive is missing. They carry the ``realpath`` marker (about 4.5 minutes on 2
cores, most of the ``-m "not realpath"`` subset's time before): they run in the whole suite,
not in the fast subset. The launcher's release checks run under any Python.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trees import ROOT, RELEASES
from test_glue_launch import CONFIGS, check_upstream_balancer_lines, config_vars, dry_run, upstream_balancer_specs
from test_glue_patches import SUPPORTED_MSG, run_script

NEWER = [t for t in RELEASES if t != "core_v0.16.1"]
HERE = Path(__file__).parent
LAUNCH = ROOT / "scripts" / "pretrain_vlm_moe.sh"


def patched(mlm_trees, tmp_path, tag):
    d = mlm_trees.copy(tag, tmp_path / "Megatron-LM")
    r = run_script(d)
    assert r.returncode == 0, r.stderr
    return d


def launch_env(**kw):
    e = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_DIR", "DATA_PATH", "DRY_RUN", "PYTHON")}
    e.update(kw)
    return e


# -- the launcher's release check (any Python) ------------------------------------------------
def test_launcher_refuses_an_unsupported_release(mlm_trees, tmp_path):
    d = mlm_trees.copy("core_v0.16.1", tmp_path / "Megatron-LM")
    info = d / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 16", "MINOR = 14"))
    r = subprocess.run(["bash", str(LAUNCH), "--config", str(ROOT / "configs/megatron/tiny_cpu.sh")],
                       capture_output=True, text=True, timeout=120,
                       env=launch_env(MEGATRON_LM_DIR=str(d), DATA_PATH=str(tmp_path)))
    assert r.returncode == 1 and "0.14.1" in r.stderr and SUPPORTED_MSG in r.stderr
    r = subprocess.run(["bash", str(LAUNCH)], capture_output=True, text=True, timeout=60, env=launch_env())
    assert r.returncode == 1 and "core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0, core_v0.20.0" in r.stderr


def test_launcher_asks_for_python312_on_newer_releases(mlm_trees, tmp_path):
    if sys.version_info >= (3, 12):
        pytest.skip("this interpreter is 3.12+; the refusal concerns older ones")
    d = patched(mlm_trees, tmp_path, "core_v0.19.0")
    r = subprocess.run(["bash", str(LAUNCH), "--config", str(ROOT / "configs/megatron/tiny_cpu.sh")],
                       capture_output=True, text=True, timeout=120,
                       env=launch_env(MEGATRON_LM_DIR=str(d), DATA_PATH=str(tmp_path), PYTHON=sys.executable))
    assert r.returncode == 1 and "core_v0.19.0 needs Python >= 3.12" in r.stderr, r.stderr


def test_launcher_takes_patch_releases_and_forced_lines(mlm_trees, tmp_path):
    """The launcher reads the release from apply_patches.sh --check: a patch release of the 0.16
    line runs under this Python (DRY_RUN prints the command), one of the 0.18 line asks for
    Python 3.12, a forced 0.21 tree is refused unless FORCE_RELEASE=1."""
    def launch(tree, **env):
        return subprocess.run(["bash", str(LAUNCH), "--config", str(ROOT / "configs/megatron/tiny_cpu.sh")],
                              capture_output=True, text=True, timeout=120,
                              env=launch_env(MEGATRON_LM_DIR=str(tree), DATA_PATH=str(tmp_path),
                                             PYTHON=sys.executable, DRY_RUN="1", **env))
    old = mlm_trees.copy_as("core_v0.16.1", "0.16.0", tmp_path / "mlm-0.16.0")
    assert run_script(old).returncode == 0
    r = launch(old)
    assert r.returncode == 0 and "examples/multimodal/train.py" in r.stdout, r.stderr
    if sys.version_info < (3, 12):
        mid = mlm_trees.copy_as("core_v0.18.2", "0.18.0", tmp_path / "mlm-0.18.0")
        assert run_script(mid).returncode == 0
        r = launch(mid)
        assert r.returncode == 1 and "core_v0.18.0 needs Python >= 3.12" in r.stderr, r.stderr
    new = mlm_trees.copy_as("main-d98e8a64", "0.21.0", tmp_path / "mlm-0.21.0")
    assert run_script(new, "--force").returncode == 0
    r = launch(new)
    assert r.returncode == 1 and "the 0.21 line is newer" in r.stderr, r.stderr
    r = launch(new, FORCE_RELEASE="1")
    want = "core_v0.21.0 needs Python >= 3.12" if sys.version_info < (3, 12) else "examples/multimodal/train.py"
    assert want in r.stderr + r.stdout, r.stderr


# -- in the Python 3.12 environment ---------------------------------------------------------------
@pytest.mark.realpath
@pytest.mark.parametrize("tag", NEWER)
def test_patched_release_imports_and_validates_every_config(py312, mlm_trees, tmp_path, tag):
    d = patched(mlm_trees, tmp_path, tag)
    specs = []
    for cfg in CONFIGS:
        r = dry_run(cfg, {"MEGATRON_LM_DIR": str(d), "PYTHON": py312})
        assert r.returncode == 0, r.stderr
        f = tmp_path / f"{cfg.stem}.argv"
        f.write_text(r.stdout)
        v = config_vars(cfg)
        specs.append((cfg, f, v, v["NNODES"] * v["GPUS_PER_NODE"]))
    r = subprocess.run([py312, str(HERE / "release_check.py"), str(d), str(ROOT),
                        *[f"{f}:{world}" for _, f, _, world in specs],
                        *upstream_balancer_specs(d, py312, tmp_path)],
                       capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert f"IMPORTED {d}" in r.stdout
    for cfg, f, v, world in specs:
        dp = world // (v["TP"] * v["PP"] * v["CP"])
        assert f"VALID {f} {world} {dp} {v['EP']} True" in r.stdout, cfg.stem
    # Megatron's own hybrid context parallel with --mm-balance: refused by our check at start-up.
    check_upstream_balancer_lines(r.stdout, tmp_path)


GLUE_TESTS = {tag: ["test_glue_units.py", "test_glue_multirank.py"] for tag in NEWER}
GLUE_TESTS["core_v0.19.0"] += ["test_glue_sampler.py", "test_glue_checks.py", "test_glue_arguments.py"]


#: the newest release runs the glue tests in CI; the others with --extended (each release's
#: patched tree is imported and every config validated in CI all the same)
GLUE_TAGS = [pytest.param(t, marks=() if t == NEWER[-1] else pytest.mark.extended) for t in NEWER]


@pytest.mark.realpath
@pytest.mark.parametrize("tag", GLUE_TAGS)
def test_glue_tests_pass_against_the_release(py312, mlm_trees, tmp_path, tag):
    d = patched(mlm_trees, tmp_path, tag)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]))
    r = subprocess.run([py312, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "600",
                        *[str(HERE / t) for t in GLUE_TESTS[tag]]],
                       capture_output=True, text=True, timeout=1500, env=env, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-4000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-1000:]
    # The release's own megatron.core was the one tested, not a pip copy.
    r = subprocess.run([py312, "-c", "import megatron.core, sys; print(megatron.core.__file__)"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.stdout.strip().startswith(str(d)), r.stdout + r.stderr
