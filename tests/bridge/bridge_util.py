"""Helpers of the Megatron-Bridge tests: a patched Bridge tree, its Python 3.12 environment,
a dataset, and launcher runs, all driven through the user's commands as subprocesses
(``scripts/setup_env_bridge.sh``, ``scripts/apply_patches.sh``, ``mm-balance make-dataset
--format bridge-qwen-vl``, ``scripts/pretrain_bridge_vlm.sh``)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from megatron_mm_balance.bench.runtime import free_port

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "realpath"))
from realpath_util import loss_table, max_rel_diff  # noqa: E402,F401  (the Megatron-LM path's, shared)
sys.path.insert(0, str(REPO / "tests" / "megatron_glue"))
from megatron_trees import rewrite_package_info  # noqa: E402  (the release trees' version rewrite, shared)
BRIDGE_ARCHIVE = "Megatron-Bridge-v0.6.0.tar.gz"
MLM_ARCHIVE = "Megatron-LM-cd4afffa.tar.gz"
#: Bridge main of the 0.7 line and the Megatron-LM it pins (0.20.0, laid out as core_v0.19.0)
BRIDGE_MAIN_ARCHIVE = "Megatron-Bridge-main-067f987d.tar.gz"
MLM_MAIN_ARCHIVE = "Megatron-LM-2a75ac12.tar.gz"
CACHE = REPO / ".bridge-cache"
LAUNCHER = REPO / "scripts" / "pretrain_bridge_vlm.sh"
CONFIG = REPO / "configs" / "bridge" / "qwen3_vl_moe_tiny_cpu.sh"
PATCHES = REPO / "patches" / "megatron-bridge-v0.6.0"

#: Bridge's iteration line: "iteration 3/ 6 | consumed samples: ... | lm loss: 6.4E+00 | ..."
#: (Bridge resets its loss accumulators at every print: each line is that iteration's loss).
ITER_RE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.Ee+-]+)")
#: our telemetry line, as printed (the logger's copy has a prefix and is not counted)


def archive_dir() -> Path:
    """``shared/megatron-bridge/`` beside the clone (CI) or beside its parent."""
    cands = [d / "shared" / "megatron-bridge" for d in (REPO.parent, REPO.parent.parent)]
    return next((c for c in cands if (c / BRIDGE_ARCHIVE).is_file()), cands[0])


def _digest(patches: Path = PATCHES) -> str:
    h = hashlib.sha256()
    for p in sorted(patches.glob("*.patch")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


#: the Bridge lines the tests run: the archives of Bridge and of the Megatron-LM it pins, and its set
LINES = {"v0.6.0": (BRIDGE_ARCHIVE, MLM_ARCHIVE, PATCHES),
         "main": (BRIDGE_MAIN_ARCHIVE, MLM_MAIN_ARCHIVE, REPO / "patches" / "megatron-bridge-v0.7.0")}


def bridge_trees(line: str = "v0.6.0") -> Optional[Dict[str, Path]]:
    """``{"bridge": patched Megatron-Bridge, "mlm": the Megatron-LM it pins}`` of ``line``
    (``v0.6.0`` or ``main``), or None.

    ``MEGATRON_BRIDGE_DIR`` (and ``MEGATRON_LM_DIR``) when set, for v0.6.0, used as they are;
    otherwise the archives, unpacked and patched once into ``.bridge-cache/<line>-<digest of its
    patches>``.
    """
    env = os.environ.get("MEGATRON_BRIDGE_DIR")
    if env and line == "v0.6.0":
        mlm = os.environ.get("MEGATRON_LM_DIR") or str(Path(env) / "3rdparty" / "Megatron-LM")
        return {"bridge": Path(env), "mlm": Path(mlm)}
    bridge_archive, mlm_archive, patches = LINES[line]
    src = archive_dir()
    if not (src / bridge_archive).is_file() or not (src / mlm_archive).is_file():
        return None
    dest = CACHE / f"{line}-{_digest(patches)}"
    strip = len(".tar.gz")
    trees = {"bridge": dest / bridge_archive[:-strip], "mlm": dest / mlm_archive[:-strip]}
    if (dest / ".ready").is_file():
        return trees
    tmp = CACHE / f".unpack-{os.getpid()}"
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    tmp.mkdir(parents=True)
    for name in (bridge_archive, mlm_archive):
        with tarfile.open(src / name) as tf:
            tf.extractall(tmp, filter="data")
    subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(tmp / bridge_archive[:-strip])],
                   check=True, timeout=120, stdout=subprocess.DEVNULL)
    (tmp / ".ready").write_text("patched\n")
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    os.replace(tmp, dest)
    return trees


def make_dataset(out: Path, samples: int = 128, seed: int = 0) -> Dict[str, str]:
    """``mm-balance make-dataset OUT --format bridge-qwen-vl``; returns its KEY=VALUE lines."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "make-dataset", str(out),
                          "--samples", str(samples), "--seed", str(seed), "--format", "bridge-qwen-vl"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"make-dataset failed:\n{res.stdout}\n{res.stderr}"
    return dict(line.split("=", 1) for line in res.stdout.splitlines() if re.match(r"^[A-Z_]+=", line))


@dataclass
class Run:
    """One launcher run: exit status, wall time, the log, what it printed."""

    rc: int
    wall_s: float
    log: str
    losses: Dict[int, float] = field(default_factory=dict)
    telemetry: Dict[int, Dict[str, float]] = field(default_factory=dict)
    log_path: Optional[Path] = None
    output_dir: Optional[Path] = None

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])

    def stat(self, key: str) -> Dict[int, float]:
        """One telemetry figure per logged iteration (``packs_moved``, ``prefetched``, ...),
        as :func:`~megatron_mm_balance.megatron.telemetry.read_lines` reads it (the field's
        leading number: should another rank's output ever share the line, the figure is
        still the one we printed)."""
        return {i: t[key] for i, t in self.telemetry.items() if key in t}


def timing_records(directory: Path) -> Dict[int, List[dict]]:
    """``timing-rank<R>.jsonl`` of a run, by rank."""
    out = {}
    for path in sorted(Path(directory).glob("timing-rank*.jsonl")):
        out[int(path.stem.replace("timing-rank", ""))] = [json.loads(x) for x in path.read_text().splitlines()]
    return out


def parse(log: str) -> Run:
    losses = {int(m.group(1)): float(m.group(2)) for m in ITER_RE.finditer(log)}
    from megatron_mm_balance.runtime.log_line import read_lines
    telemetry = {it: fields for it, chunk, fields in read_lines(log) if chunk == 0}
    return Run(0, 0.0, log, losses, telemetry)


def launcher_env(trees: Dict[str, Path], data: Dict[str, str], python: str, *, mm_balance: bool,
                 output_dir: Path, train_iters: int, **layout) -> Dict[str, str]:
    env = dict(os.environ)
    # The suite's jobs import Megatron (and Bridge) from the same cached trees: with their
    # bytecode written by the first job, every later one reads it instead of compiling
    # (a 4-rank Bridge job of the tiny config: 23.5 -> 19 s on 2 cores).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(MEGATRON_BRIDGE_DIR=str(trees["bridge"]), MEGATRON_LM_DIR=str(trees["mlm"]),
               DATA_PATH=data["DATA_PATH"], PROCESSOR=data["PROCESSOR"], PYTHON=python,
               MM_BALANCE="1" if mm_balance else "0", OUTPUT_DIR=str(output_dir),
               TRAIN_ITERS=str(train_iters), MASTER_PORT=str(free_port()))
    for k, v in layout.items():
        env[k.upper()] = str(v)
    return env


def run(env: Dict[str, str], extra: List[str] = (), *, log_path: Path, timeout: float = 900.0,
        config: Path = CONFIG) -> Run:
    """The launcher to completion in its own process group (all of it killed at ``timeout``)."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(LAUNCHER), "--config", str(config), *extra], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = -9
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    out = parse(log_path.read_text(errors="replace"))
    out.rc, out.wall_s, out.log_path = rc, time.monotonic() - t0, log_path
    out.output_dir = Path(env["OUTPUT_DIR"])
    return out


def compare_logs(off: Run, on: Run, control: Run) -> subprocess.CompletedProcess:
    """``mm-balance compare-logs --format bridge OFF ON --control CONTROL``."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "compare-logs", "--format", "bridge",
                           str(off.log_path), str(on.log_path), "--control", str(control.log_path)],
                          capture_output=True, text=True, timeout=120, env=env)


def check_band(off: Run, on: Run, control: Run, label: str, verdict: Optional[str] = None) -> str:
    """Off, on and control (``mm_balance.mode=control``): all exit 0, every control line a
    control one that moved and sent nothing and some reordered, and compare-logs' verdict
    against the control's band is not DIFFERENT (``verdict``: is that one). Returns its report."""
    for name, r in (("off", off), ("on", on), ("control", control)):
        assert r.rc == 0, f"{label} {name}: exit {r.rc}\n{r.tail()}"
    assert control.telemetry and sorted(control.stat("control")) == sorted(control.telemetry), control.tail()
    assert not any(control.stat("packs_moved").values()), f"{label}: the control moved packs"
    assert not any(control.stat("bytes_sent").values()), f"{label}: the control sent bytes"
    assert sum(control.stat("packs_reordered").values()) > 0, f"{label}: the control reordered nothing"
    assert sum(on.stat("packs_moved").values()) > 0, f"{label}: balancing moved no pack"
    res = compare_logs(off, on, control)
    report = res.stdout + res.stderr
    print(f"\n{label}: off/on/control wall {off.wall_s:.0f}/{on.wall_s:.0f}/{control.wall_s:.0f} s\n{report}")
    assert res.returncode == 0 and not report.strip().endswith("DIFFERENT"), report
    assert verdict is None or report.strip().endswith(f": {verdict}"), report
    return report




# --------------------------------------------------------------------------- Bridge as installed
APPLY = REPO / "scripts" / "apply_patches.sh"


def unpack_bridge_source(dest: Path, archive: str = BRIDGE_ARCHIVE) -> Optional[Path]:
    """An unmodified Megatron-Bridge archive (default v0.6.0's; ``BRIDGE_MAIN_ARCHIVE``: main's)
    unpacked under ``dest`` (read it, never write it); None when the archive is missing."""
    src = archive_dir() / archive
    if not src.is_file():
        return None
    with tarfile.open(src) as tf:
        tf.extractall(dest, filter="data")
    return dest / archive[:-len(".tar.gz")]


def set_bridge_version(package: Path, version: str) -> None:
    """Rewrite MAJOR/MINOR/PATCH of ``package``/package_info.py (package: a megatron/bridge/
    directory), a stand-in for another release of Bridge (0.6.2, 0.7.0)."""
    rewrite_package_info(package / "package_info.py", version)


def checkout_as(source: Path, dst: Path, version: str) -> Path:
    """A copy of the v0.6.0 checkout whose package_info.py says ``version``."""
    subprocess.run(["cp", "-a", str(source), str(dst)], check=True)
    set_bridge_version(dst / "src" / "megatron" / "bridge", version)
    return dst


def installed_as(source: Path, site: Path, version: str) -> Path:
    """``site``/megatron/bridge/ (the v0.6.0 sources, package_info.py saying ``version``) and
    ``site``/megatron_bridge-<version>.dist-info/METADATA: the layout pip gives an installed
    megatron-bridge wheel. Returns ``site``."""
    (site / "megatron").mkdir(parents=True)
    subprocess.run(["cp", "-a", str(source / "src" / "megatron" / "bridge"), str(site / "megatron")], check=True)
    set_bridge_version(site / "megatron" / "bridge", version)
    dist = site / f"megatron_bridge-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.4\nName: megatron-bridge\nVersion: {version}\n"
                                   "Requires-Python: <3.13,>=3.12\n")
    (dist / "top_level.txt").write_text("megatron\n")
    return site


def apply_patches(*args, env: Optional[Dict[str, str]] = None, timeout: float = 120):
    """``scripts/apply_patches.sh ARGS`` (text output)."""
    return subprocess.run(["bash", str(APPLY), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)
