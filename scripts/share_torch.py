"""Give a new virtual environment the torch build of an existing one by hard links.

    python scripts/share_torch.py SEED_ENV NEW_VENV torch==2.13.0 torchvision==0.28.0
    python scripts/share_torch.py --cuda-libs SEED_ENV NEW_VENV

Both Python 3.12 environments (scripts/setup_env_py312.sh, scripts/setup_env_bridge.sh) pin
the same torch pair, whose registry build for Python 3.12 is the CUDA one: about 4.7 GB in
each venv, most of it nvidia-* libraries; scripts/setup_env.sh's pair for Python 3.11 is
5.5 GB. When SEED_ENV (a venv, or an interpreter's prefix such as pyenv's, of the same
Python minor version) already has exactly the pinned pair and lies on the same filesystem,
this links the files of torch, torchvision, triton and the cuda-*/nvidia-* distributions
into NEW_VENV (listed by each distribution's RECORD), so the second environment costs no
disk for them; pip then installs the rest as usual and finds the pair satisfied. Console scripts under bin/ are copied with their interpreter line rewritten.

Hard links are safe to share: pip never writes an installed file in place (an upgrade or
uninstall in one venv removes its links and writes new files), and Python replaces .pyc
files atomically. Exits 0 after linking, 3 when it does nothing (seed absent or different,
another filesystem, NEW_VENV already has torch), printing why on stderr; the caller then
installs from the registry. Standard library only.

``--cuda-libs``: when no environment of the same Python version has the pair, the CUDA
libraries can still be shared, because the nvidia-*/cuda-* wheels that hold them are
Python-independent (``py3-none``): about 2 GB of a Python 3.12 venv's 4.7 GB are the same
files, at the same versions, as in a Python 3.11 torch's environment. This links every
nvidia-*/cuda-* distribution of SEED_ENV (of any Python version) whose wheel tags are all
``py3-none-*`` (a compiled ``cp311`` one such as cuda-bindings is left out). pip then keeps
those at the versions the torch pin asks for and replaces the others (its uninstall removes
the links here, never the seed's files). Exits 0 after linking, 3 when it links nothing.
"""
from __future__ import annotations

import csv
import os
import re
import sys
from pathlib import Path

SHARED = re.compile(r"^(torch|torchvision|triton|cuda[-_].*|nvidia[-_].*)$", re.IGNORECASE)


def site_packages(venv: Path) -> Path:
    """The one lib/pythonX.Y/site-packages of a POSIX venv."""
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"share_torch: {venv} has {len(found)} site-packages directories, expected 1")
    return found[0]


def dists(site: Path) -> dict[str, tuple[str, Path]]:
    """Normalised distribution name -> (version, dist-info directory)."""
    out = {}
    for info in site.glob("*.dist-info"):
        meta = info / "METADATA"
        if not meta.exists():
            continue
        fields = dict(line.split(": ", 1) for line in meta.read_text(errors="replace").splitlines()[:20]
                      if ": " in line)
        name, version = fields.get("Name"), fields.get("Version")
        if name and version:
            out[re.sub(r"[-_.]+", "-", name).lower()] = (version, info)
    return out


def pins_match(seed: dict, pins: list[str]) -> str | None:
    """None when the seed has every pinned version, else the first difference."""
    for pin in pins:
        name, _, version = pin.partition("==")
        have = seed.get(name.lower())
        if have is None or have[0] != version:
            return f"{name} {'absent' if have is None else have[0]} in the seed, {version} pinned"
    return None


def record_files(info: Path) -> list[str]:
    with open(info / "RECORD", newline="") as f:
        return [row[0] for row in csv.reader(f) if row]


def repoint(script: bytes, python: bytes) -> bytes:
    """A console script with its ``#!...python...`` line naming PYTHON instead."""
    first, nl, rest = script.partition(b"\n")
    if first.startswith(b"#!") and b"python" in first:
        return b"#!" + python + nl + rest
    return script


CUDA_LIBS = re.compile(r"^(cuda[-_].*|nvidia[-_].*)$", re.IGNORECASE)


def python_independent(info: Path) -> bool:
    """Every wheel tag of the distribution is ``py3-none-*`` (or ``py2.py3-none-*``)."""
    wheel = info / "WHEEL"
    if not wheel.is_file():
        return False
    tags = [line.split(":", 1)[1].strip() for line in wheel.read_text(errors="replace").splitlines()
            if line.startswith("Tag:")]
    return bool(tags) and all(t.split("-")[0] in ("py3", "py2.py3") and t.split("-")[1] == "none" for t in tags)


def torch_pair(name: str, info: Path) -> bool:
    return bool(SHARED.match(name))


def cuda_library(name: str, info: Path) -> bool:
    return bool(CUDA_LIBS.match(name)) and python_independent(info)


def share(seed_venv: Path, new_venv: Path, keep=torch_pair) -> tuple[int, int]:
    """Link the files of the seed's distributions ``keep(name, dist-info)`` accepts;
    returns (files, bytes). Undoes itself on error."""
    seed_site, new_site = site_packages(seed_venv), site_packages(new_venv)
    new_py = str(new_venv / "bin" / "python").encode()
    files = size = 0
    made: list[Path] = []
    try:
        for name, (_, info) in sorted(dists(seed_site).items()):
            if not keep(name, info):
                continue
            for rel in record_files(info):
                outside = rel.startswith("..")       # a console script under bin/
                src = Path(os.path.normpath(seed_site / rel))
                dst = Path(os.path.normpath(new_site / rel))
                if not src.is_file() or dst.exists():
                    continue
                dst.parent.mkdir(parents=True, exist_ok=True)
                if outside:                          # copied, its interpreter line re-pointed
                    dst.write_bytes(repoint(src.read_bytes(), new_py))
                    dst.chmod(src.stat().st_mode)
                else:
                    os.link(src, dst)
                made.append(dst)
                files += 1
                size += src.stat().st_size
    except BaseException:
        for path in made:            # no half-shared torch: the caller installs from the registry
            path.unlink(missing_ok=True)
        raise
    return files, size


def cannot_link(seed_venv: Path, new_venv: Path) -> str | None:
    """Why nothing can be hard-linked from the seed into the new environment (None: it can):
    the same environment, a seed that is none, or another filesystem."""
    if seed_venv == new_venv or not (seed_venv / "bin" / "python").exists():
        return "no such environment"
    if os.stat(site_packages(seed_venv)).st_dev != os.stat(site_packages(new_venv)).st_dev:
        return "another filesystem (hard links need one)"
    return None


def skipped(what: str, seed_venv: Path, why: str) -> int:
    print(f"share_torch: {what} shared from {seed_venv}: {why}", file=sys.stderr)
    return 3


def share_cuda_libs(seed_venv: Path, new_venv: Path) -> int:
    """``--cuda-libs`` (module docstring)."""
    def skip(why: str) -> int:
        return skipped("no CUDA libraries", seed_venv, why)

    why = cannot_link(seed_venv, new_venv)
    if why:
        return skip(why)
    files, size = share(seed_venv, new_venv, keep=cuda_library)
    if not files:
        return skip("it has no Python-independent nvidia-*/cuda-* distributions that are not here already")
    print(f"share_torch: linked {files} files ({size / 2**30:.1f} GiB) of Python-independent cuda/nvidia "
          f"libraries from {seed_venv}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cuda-libs"] and len(argv) == 3:
        return share_cuda_libs(Path(argv[1]).resolve(), Path(argv[2]).resolve())
    if len(argv) < 3:
        print("\n".join(__doc__.strip().splitlines()[2:4]), file=sys.stderr)
        return 2
    seed_venv, new_venv, pins = Path(argv[0]).resolve(), Path(argv[1]).resolve(), argv[2:]

    def skip(why: str) -> int:
        return skipped("no torch", seed_venv, why)

    why = cannot_link(seed_venv, new_venv)
    if why:
        return skip(why)
    seed_site, new_site = site_packages(seed_venv), site_packages(new_venv)
    if seed_site.name != new_site.name or seed_site.parent.name != new_site.parent.name:
        return skip(f"{seed_site.parent.name} there, {new_site.parent.name} here")
    if "torch" in dists(new_site):
        return skip("torch is already installed here")
    why = pins_match(dists(seed_site), pins)
    if why:
        return skip(why)
    files, size = share(seed_venv, new_venv)
    print(f"share_torch: linked {files} files ({size / 2**30:.1f} GiB) of torch, torchvision, triton and "
          f"cuda/nvidia from {seed_venv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
