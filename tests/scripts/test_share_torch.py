"""scripts/share_torch.py: a second environment gets the first one's torch pair by hard
links (same inodes), only the torch/torchvision/triton/cuda/nvidia distributions, console
scripts re-pointed; it refuses (exit 3, nothing written) when the pair differs, the Python
versions differ or torch is already there, and undoes a half-done link."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "share_torch.py"


def make_env(root: Path, pyver: str = "3.12") -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    site = root / "lib" / f"python{pyver}" / "site-packages"
    site.mkdir(parents=True)
    return site


def add_dist(site: Path, name: str, version: str, files: dict[str, str], scripts: dict[str, str] = {},
             tag: str = ""):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    rows = [f"{info.name}/METADATA,,"]
    if tag:                                  # the wheel's tags (WHEEL), one per line
        (info / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                                    + "".join(f"Tag: {t}\n" for t in tag.split()))
        rows.append(f"{info.name}/WHEEL,,")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
        rows.append(f"{rel},sha256=x,{len(text)}")
    for script, text in scripts.items():
        path = site.parents[2] / "bin" / script
        path.write_text(text)
        path.chmod(0o755)
        rows.append(f"../../../bin/{script},sha256=x,{len(text)}")
    rows.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(rows) + "\n")


def seed_env(root: Path, torch_version: str = "2.13.0") -> Path:
    site = make_env(root)
    add_dist(site, "torch", torch_version, {"torch/__init__.py": "T", "torch/lib/libtorch.so": "L" * 100},
             {"torchrun": f"#!{root}/bin/python3.12\nimport torch\n"})
    add_dist(site, "torchvision", "0.28.0", {"torchvision/__init__.py": "V"})
    add_dist(site, "nvidia-cublas", "13.0", {"nvidia/cublas/lib/libcublas.so": "C"})
    add_dist(site, "numpy", "2.5.5", {"numpy/__init__.py": "N"})
    return site


def run_cuda_libs(seed: Path, new: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--cuda-libs", str(seed), str(new)],
                          capture_output=True, text=True, timeout=60)


def run(seed: Path, new: Path, *pins: str) -> subprocess.CompletedProcess:
    pins = pins or ("torch==2.13.0", "torchvision==0.28.0")
    return subprocess.run([sys.executable, str(SCRIPT), str(seed), str(new), *pins],
                          capture_output=True, text=True, timeout=60)


def test_links_the_torch_pair_and_nothing_else(tmp_path):
    seed_site = seed_env(tmp_path / "seed")
    new_site = make_env(tmp_path / "new")
    r = run(tmp_path / "seed", tmp_path / "new")
    assert r.returncode == 0, r.stderr
    assert "linked" in r.stderr
    for rel in ("torch/__init__.py", "torch/lib/libtorch.so", "torchvision/__init__.py",
                "nvidia/cublas/lib/libcublas.so", "torch-2.13.0.dist-info/RECORD"):
        assert (new_site / rel).stat().st_ino == (seed_site / rel).stat().st_ino, rel
    assert not (new_site / "numpy").exists()
    assert not (new_site / "numpy-2.5.5.dist-info").exists()
    torchrun = (tmp_path / "new" / "bin" / "torchrun").read_text().splitlines()
    assert torchrun[0] == f"#!{tmp_path / 'new' / 'bin' / 'python'}"
    assert torchrun[1] == "import torch"


def test_refuses_other_pins_python_versions_and_a_torch_already_there(tmp_path):
    seed_env(tmp_path / "seed", torch_version="2.14.1")
    new_site = make_env(tmp_path / "new")
    r = run(tmp_path / "seed", tmp_path / "new")
    assert r.returncode == 3 and "torch 2.14.1 in the seed, 2.13.0 pinned" in r.stderr
    assert list(new_site.iterdir()) == []

    other = make_env(tmp_path / "py311", pyver="3.11")
    r = run(tmp_path / "seed", tmp_path / "py311", "torch==2.14.1", "torchvision==0.28.0")
    assert r.returncode == 3 and "python3.12 there, python3.11 here" in r.stderr
    assert list(other.iterdir()) == []

    add_dist(new_site, "torch", "2.13.0", {"torch/__init__.py": "mine"})
    r = run(tmp_path / "seed", tmp_path / "new", "torch==2.14.1", "torchvision==0.28.0")
    assert r.returncode == 3 and "already installed" in r.stderr
    assert (new_site / "torch" / "__init__.py").read_text() == "mine"


def test_a_failed_link_leaves_nothing_behind(tmp_path):
    seed_env(tmp_path / "seed")
    new_site = make_env(tmp_path / "new")
    (new_site / "torchvision").write_text("a file where a directory must go")
    r = run(tmp_path / "seed", tmp_path / "new")
    assert r.returncode != 0
    assert not (new_site / "torch").exists() or not any(p.is_file() for p in (new_site / "torch").rglob("*"))
    assert not (tmp_path / "new" / "bin" / "torchrun").exists()
    assert not (new_site / "nvidia" / "cublas" / "lib" / "libcublas.so").exists()


def test_cuda_libraries_are_shared_across_python_versions_when_python_independent(tmp_path):
    """``--cuda-libs``: a Python 3.11 environment's py3-none nvidia-*/cuda-* wheels are linked
    into a Python 3.12 venv (same inodes, dist-info included); its torch, a compiled
    cp311 cuda-bindings and everything else are not. A second call links nothing (exit 3)."""
    seed = make_env(tmp_path / "py311", pyver="3.11")
    add_dist(seed, "torch", "2.14.1", {"torch/__init__.py": "T"}, tag="cp311-cp311-manylinux_2_28_x86_64")
    add_dist(seed, "nvidia-cublas", "13.1.1.3", {"nvidia/cu13/lib/libcublas.so.13": "C" * 50},
             tag="py3-none-manylinux_2_27_x86_64 py3-none-manylinux_2_28_x86_64")
    add_dist(seed, "cuda-toolkit", "13.0.3.0", {}, tag="py2.py3-none-any")
    add_dist(seed, "cuda-bindings", "13.5.0", {"cuda/bindings/_lib.so": "B"},
             tag="cp311-cp311-manylinux_2_28_x86_64")
    add_dist(seed, "nvidia-untagged", "1.0", {"nvidia/untagged/lib.so": "U"})   # no WHEEL: unknown
    add_dist(seed, "numpy", "2.5.5", {"numpy/__init__.py": "N"}, tag="cp311-cp311-manylinux_2_28_x86_64")
    new_site = make_env(tmp_path / "new")
    r = run_cuda_libs(tmp_path / "py311", tmp_path / "new")
    assert r.returncode == 0, r.stderr
    for rel in ("nvidia/cu13/lib/libcublas.so.13", "nvidia_cublas-13.1.1.3.dist-info/RECORD",
                "cuda_toolkit-13.0.3.0.dist-info/METADATA"):
        assert (new_site / rel).stat().st_ino == (seed / rel).stat().st_ino, rel
    for rel in ("torch", "cuda/bindings", "nvidia/untagged", "numpy", "cuda_bindings-13.5.0.dist-info"):
        assert not (new_site / rel).exists(), rel
    again = run_cuda_libs(tmp_path / "py311", tmp_path / "new")
    assert again.returncode == 3 and "no Python-independent" in again.stderr
