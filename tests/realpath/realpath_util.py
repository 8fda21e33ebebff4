"""Helpers for the real-path acceptance tests: a patched Megatron-LM, a dataset, launcher runs.

Everything here drives the user's commands as subprocesses (``scripts/apply_patches.sh``,
``mm-balance make-dataset``, ``scripts/pretrain_vlm_moe.sh``) and reads what they print;
nothing imports Megatron-LM into the test process.
"""
from __future__ import annotations

import hashlib
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
TAG = "core_v0.16.1"
#: The release archive: ``shared/megatron-lm/`` beside the clone (CI), or beside its parent.
def archive(tag: str = TAG) -> Path:
    """The release archive of ``tag`` (the first candidate location when none exists)."""
    cands = [d / "shared" / "megatron-lm" / f"Megatron-LM-{tag}.tar.gz" for d in (REPO.parent, REPO.parent.parent)]
    return next((a for a in cands if a.is_file()), cands[0])


ARCHIVE = archive(TAG)
#: Unpacked, patched trees (gitignored; .megatron-lm/ is the glue tests' git checkout).
CACHE = REPO / ".megatron-lm-cache"
LAUNCHER = REPO / "scripts" / "pretrain_vlm_moe.sh"
CONFIG = REPO / "configs" / "megatron" / "tiny_cpu.sh"

#: Megatron's per-iteration log line: "iteration 3/ 6 | ... | lm loss: 6.42E+00 | ...".
ITER_RE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.Ee+-]+)")
#: Our telemetry line: "[mm-balance] iteration 3 | ... | packs_moved: 7 | ...".
MOVED_RE = re.compile(r"^\[mm-balance\] iteration (\d+) \|.*?\bpacks_moved: (\d+)", re.M)
#: The same line's share of global batches the exchange thread pulled before the training
#: loop asked for them ("prefetched: 1": all of them).
PREFETCH_RE = re.compile(r"^\[mm-balance\] iteration (\d+) \|.*?\bprefetched: ([0-9.]+)", re.M)


def _patches_digest() -> str:
    h = hashlib.sha256()
    for p in sorted((REPO / "patches").rglob("*.patch")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def megatron_lm_dir(tag: str = TAG) -> Optional[Path]:
    """A Megatron-LM core_v0.16.1 tree with ``patches/`` applied, or None if there is none.

    ``MEGATRON_LM_DIR`` when set (used as is: the launcher refuses it if patches are
    pending); otherwise the release archive beside the repository, unpacked and patched
    once into ``.megatron-lm-cache/<tag>-<digest of patches/>`` (a changed patch gets a fresh tree).
    """
    env = os.environ.get("MEGATRON_LM_DIR")
    if env and tag == TAG:
        return Path(env)
    src = archive(tag)
    if not src.is_file():
        return None
    dest = CACHE / f"{tag}-{_patches_digest()}"
    tree = dest / f"Megatron-LM-{tag}"
    if (dest / ".ready").is_file():
        return tree
    tmp = CACHE / f".unpack-{os.getpid()}"
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    tmp.mkdir(parents=True)
    with tarfile.open(src) as tf:
        tf.extractall(tmp, filter="data")
    subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(tmp / f"Megatron-LM-{tag}")],
                   check=True, timeout=120, stdout=subprocess.DEVNULL)
    (tmp / ".ready").write_text("patched\n")
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    os.replace(tmp, dest)
    return tree


def make_dataset(out: Path, samples: int = 128, seed: int = 0) -> Dict[str, str]:
    """``mm-balance make-dataset OUT --samples N --seed S``; returns its KEY=VALUE lines."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "make-dataset", str(out),
                          "--samples", str(samples), "--seed", str(seed)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"make-dataset failed:\n{res.stdout}\n{res.stderr}"
    return dict(line.split("=", 1) for line in res.stdout.splitlines()
                if re.match(r"^[A-Z_]+=", line))


@dataclass
class Run:
    """One launcher run: exit status, wall time, the log, and what it printed."""

    rc: int
    wall_s: float
    log: str
    losses: Dict[int, float] = field(default_factory=dict)
    prefetched: Dict[int, float] = field(default_factory=dict)
    moved: Dict[int, int] = field(default_factory=dict)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def parse_losses(log: str) -> Dict[int, float]:
    """Per-iteration lm loss from Megatron's iteration lines (``--log-interval 1``).

    Megatron does not reset its loss accumulators after the first iteration of a job
    (``training_log(is_first_iteration=True)``), so the line of the job's second
    iteration prints the mean of its first two; that iteration's own loss is
    ``2 * printed - first``. Reconstructed here so that a resumed job's iterations
    compare one to one with an uninterrupted run's.
    """
    printed = {int(m.group(1)): float(m.group(2)) for m in ITER_RE.finditer(log)}
    its = sorted(printed)
    if len(its) >= 2 and its[1] == its[0] + 1:
        printed[its[1]] = 2 * printed[its[1]] - printed[its[0]]
    return printed


def parse_moved(log: str) -> Dict[int, int]:
    return {int(m.group(1)): int(m.group(2)) for m in MOVED_RE.finditer(log)}


def parse_prefetched(log: str) -> Dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in PREFETCH_RE.finditer(log)}


def launcher_env(mlm: Path, data: Dict[str, str], *, mm_balance: bool, output_dir: Path,
                 train_iters: int, python: str = sys.executable, **layout: int) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(MEGATRON_LM_DIR=str(mlm), DATA_PATH=data["DATA_PATH"],
               TOKENIZER_MODEL=data["TOKENIZER_MODEL"], MM_BALANCE="1" if mm_balance else "0",
               OUTPUT_DIR=str(output_dir), TRAIN_ITERS=str(train_iters),
               PYTHON=python, MASTER_PORT=str(free_port()),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for k, v in layout.items():
        env[k.upper()] = str(v)
    return env


def launch(env: Dict[str, str], extra: List[str] = (), *, log_path: Path, timeout: float = 600.0) -> subprocess.Popen:
    """Start ``pretrain_vlm_moe.sh --config tiny_cpu.sh`` in its own process group."""
    log = open(log_path, "w")
    return subprocess.Popen(["bash", str(LAUNCHER), "--config", str(CONFIG), *extra], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(env: Dict[str, str], extra: List[str] = (), *, log_path: Path, timeout: float = 600.0) -> Run:
    """Run the launcher to completion (killing its whole process group at ``timeout``)."""
    t0 = time.monotonic()
    proc = launch(env, extra, log_path=log_path)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        rc = -9
    finally:
        kill_group(proc)  # no rank outlives its launcher
    log = log_path.read_text(errors="replace")
    return Run(rc=rc, wall_s=time.monotonic() - t0, log=log,
               losses=parse_losses(log), moved=parse_moved(log), prefetched=parse_prefetched(log))


def max_rel_diff(a: Dict[int, float], b: Dict[int, float], iters) -> float:
    return max(abs(a[i] - b[i]) / max(abs(b[i]), 1e-12) for i in iters)


def loss_table(runs: Dict[str, Run]) -> str:
    """Iterations as rows, runs as columns (for failure messages and the docs)."""
    names = list(runs)
    iters = sorted(set().union(*(r.losses for r in runs.values())))
    lines = ["iter " + " ".join(f"{n:>14}" for n in names)]
    for i in iters:
        lines.append(f"{i:>4} " + " ".join(
            f"{runs[n].losses[i]:>14.6E}" if i in runs[n].losses else f"{'-':>14}" for n in names))
    return "\n".join(lines)


def check_resume(full: "Run", first: "Run", second: "Run", label: str, rel_tol: float) -> str:
    """Assert that a job stopped after iteration 3 and resumed from the same OUTPUT_DIR
    equals the uninterrupted run (iterations 1-3 and 4-6), with the energon dataloader
    state restored and packs still moving; returns the loss table."""
    table = loss_table({"uninterrupted": full, "first job": first, "resumed": second})
    print(f"\n{label}:\n{table}")
    assert full.rc == 0 and first.rc == 0 and second.rc == 0, (
        f"exit {full.rc}/{first.rc}/{second.rc}\n{second.tail()}")
    assert sorted(first.losses) == [1, 2, 3], table
    assert sorted(second.losses) == [4, 5, 6], f"the second job did not resume at iteration 4\n{table}"
    assert "restored dataset state" in second.log, "energon dataloader state was not restored"
    assert max_rel_diff(first.losses, full.losses, [1, 2, 3]) <= rel_tol, table
    diff = max_rel_diff(second.losses, full.losses, [4, 5, 6])
    assert diff <= rel_tol, f"resumed iterations differ by {diff:.2e}\n{table}"
    assert sum(second.moved.values()) > 0, "no packs moved after the resume"
    # The loader (energon, with save_state) was read ahead across global batches: every
    # telemetry line after a job's first covers only batches its exchange thread had pulled
    # before the training loop asked for them, and the checkpoint was still exact.
    for name, run in (("uninterrupted", full), ("first job", first), ("resumed", second)):
        later = [run.prefetched[i] for i in sorted(run.prefetched)[1:]]
        assert later and all(v == 1.0 for v in later), (
            f"{name}: global batches not prefetched: {run.prefetched}")
    print(f"prefetched share per telemetry line: uninterrupted {full.prefetched}, "
          f"first job {first.prefetched}, resumed {second.prefetched}")
    return table
