"""Helpers for the real-path acceptance tests: a patched Megatron-LM, a dataset, launcher runs.

Everything here drives the user's commands as subprocesses (``scripts/apply_patches.sh``,
``mm-balance make-dataset``, ``scripts/pretrain_vlm_moe.sh``) and reads what they print;
nothing imports Megatron-LM into the test process.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from megatron_mm_balance.bench.runtime import free_port
from megatron_mm_balance.megatron import logs as megatron_logs
from megatron_mm_balance.runtime.log_line import read_lines
from megatron_mm_balance.testing import megatron_tree

REPO = Path(__file__).resolve().parents[2]
TAG = megatron_tree.DEFAULT_TAG
#: The release archive: ``shared/megatron-lm/`` beside the clone (CI), or beside its parent.
archive = megatron_tree.archive
ARCHIVE = archive(TAG)
#: Unpacked, patched trees (gitignored; .megatron-lm/ is the glue tests' git checkout).
CACHE = megatron_tree.CACHE
LAUNCHER = REPO / "scripts" / "pretrain_vlm_moe.sh"
#: how long one launcher run of the real-path tests may take before it is killed
RUN_TIMEOUT_S = 600
CONFIG = REPO / "configs" / "megatron" / "tiny_cpu.sh"



def megatron_lm_dir(tag: str = TAG) -> Optional[Path]:
    """A Megatron-LM tree of ``tag`` with ``patches/`` applied, or None if there is none.

    For core_v0.16.1, ``MEGATRON_LM_DIR`` when set (used as is: the launcher refuses it if
    patches are pending); otherwise the release archive, unpacked and patched once into
    ``.megatron-lm-cache/<tag>-<digest of patches/>``, the tree the demo uses too
    (:mod:`megatron_mm_balance.testing.megatron_tree`).
    """
    return megatron_tree.user_tree(tag) if tag == TAG else megatron_tree.patched_tree(tag)


def release_tree_or_skip(tag: str) -> Path:
    """The patched tree of Megatron-LM release ``tag`` (:func:`megatron_lm_dir`); the test is
    skipped, naming the archive to provide, when there is none."""
    t = megatron_lm_dir(tag)
    if t is None:
        import pytest
        pytest.skip(f"no Megatron-LM {tag}: provide {archive(tag)}")
    return t


def cached_launcher_runs(tree: Path, data: Dict[str, str], runs_dir: Path, *, tag: str, iters: int,
                         python: str, timeout: float):
    """``go(name, mm_balance, extra=(), output=None, mlm=None, **env)``: the launcher's run
    ``name`` on ``tree`` (``mlm``: another tree), ``iters`` iterations, every rank's samples
    recorded; each name runs once and its :class:`Run` is shared by the tests that ask again."""
    cache = {}

    def go(name, mm_balance, extra=(), output=None, mlm=None, **env):
        if name not in cache:
            out = output or runs_dir / f"{tag}-{name}"
            e = launcher_env(mlm or tree, data, mm_balance=mm_balance, output_dir=out, train_iters=iters,
                             python=python)
            e.update(env)
            cache[name] = run(e, [*extra, "--mm-balance-record-samples", str(out / "samples")],
                              log_path=runs_dir / f"{tag}-{name}.log", timeout=timeout,
                              samples_dir=out / "samples")
        return cache[name]

    return go


def make_dataset(out: Path, samples: Optional[int] = 128, seed: Optional[int] = 0,
                 python: str = sys.executable) -> Dict[str, str]:
    """``mm-balance make-dataset OUT [--samples N] [--seed S]`` (None: the command's default);
    returns its KEY=VALUE lines."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    opts = [*(["--samples", str(samples)] if samples is not None else []),
            *(["--seed", str(seed)] if seed is not None else [])]
    res = subprocess.run([python, "-m", "megatron_mm_balance.cli", "make-dataset", str(out), *opts],
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
    log_path: Optional[Path] = None
    samples_dir: Optional[Path] = None        # --mm-balance-record-samples DIR, when given
    losses: Dict[int, float] = field(default_factory=dict)
    prefetched: Dict[int, float] = field(default_factory=dict)
    moved: Dict[int, int] = field(default_factory=dict)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def parse_losses(log: str) -> Dict[int, float]:
    """Per-iteration lm loss from Megatron's iteration lines (``--log-interval 1``), as
    ``mm-balance compare-logs`` reads them (:mod:`megatron_mm_balance.megatron.logs`): the
    second line of a job, which Megatron prints as the mean of the job's first two
    iterations, is recomputed, so that a resumed job's iterations compare one to one with
    an uninterrupted run's."""
    try:
        return megatron_logs.read_log(log).values("lm loss")
    except megatron_logs.LogError:
        return {}


def parse_moved(log: str) -> Dict[int, int]:
    """Packs moved per iteration (our telemetry line's ``packs_moved``)."""
    return {it: int(v) for it, v in telemetry_field(log, "packs_moved").items()}


def parse_prefetched(log: str) -> Dict[int, float]:
    """The share of each iteration's global batches the exchange thread pulled before the
    training loop asked for them (``prefetched: 1``: all of them)."""
    return telemetry_field(log, "prefetched")


def launcher_env(mlm: Path, data: Dict[str, str], *, mm_balance: bool, output_dir: Path,
                 train_iters: int, python: str = sys.executable, **layout: int) -> Dict[str, str]:
    env = dict(os.environ)
    # The suite's jobs import Megatron (and Bridge) from the same cached trees: with their
    # bytecode written by the first job, every later one reads it instead of compiling
    # (a 4-rank Bridge job of the tiny config: 23.5 -> 19 s on 2 cores).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
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


def run(env: Dict[str, str], extra: List[str] = (), *, log_path: Path, timeout: float = 600.0,
        samples_dir: Optional[Path] = None) -> Run:
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
    return Run(rc=rc, wall_s=time.monotonic() - t0, log=log, log_path=log_path, samples_dir=samples_dir,
               losses=parse_losses(log), moved=parse_moved(log), prefetched=parse_prefetched(log))


def telemetry_field(log: str, name: str) -> Dict[int, float]:
    """``{iteration: value}`` of one field of our telemetry lines (``... | name: value | ...``,
    the first model chunk's), as ``runtime/log_line.read_lines``, their one reader, reads them."""
    return {it: fields[name] for it, chunk, fields in read_lines(log) if chunk == 0 and name in fields}


def run_nodes(env: Dict[str, str], nnodes: int, nproc_per_node: int, extra: List[str] = (), *,
              log_dir: Path, name: str, timeout: float = 600.0) -> Run:
    """One job as ``nnodes`` launcher processes on this machine (``NNODES``, ``NODE_RANK``,
    ``MASTER_ADDR=127.0.0.1``, one ``MASTER_PORT``; ``NPROC_PER_NODE`` ranks each), as a user
    starts it on every node; all killed at ``timeout``. The Run's ``rc`` is the first non-zero
    exit (0 when every launcher exits 0), its log the nodes' logs in node order
    (``log_dir/<name>-node<N>.log``): Megatron prints its iteration lines on the last rank's
    node, our telemetry on the first's."""
    t0 = time.monotonic()
    procs, paths = [], []
    for node in range(nnodes):
        paths.append(log_dir / f"{name}-node{node}.log")
        node_env = dict(env, NNODES=str(nnodes), NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                        NPROC_PER_NODE=str(nproc_per_node))
        procs.append(launch(node_env, extra, log_path=paths[-1]))
    rcs = []
    try:
        for proc in procs:
            try:
                rcs.append(proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0))))
            except subprocess.TimeoutExpired:
                rcs.append(-9)
    finally:
        for proc in procs:
            kill_group(proc)
            proc.wait()
    log = "".join(f"==> node {n} ({p.name})\n" + p.read_text(errors="replace") for n, p in enumerate(paths))
    return Run(rc=next((rc for rc in rcs if rc != 0), 0), wall_s=time.monotonic() - t0, log=log,
               log_path=paths[0], losses=parse_losses(log), moved=parse_moved(log),
               prefetched=parse_prefetched(log))


def max_rel_diff(a: Dict[int, float], b: Dict[int, float], iters) -> float:
    return max(abs(a[i] - b[i]) / max(abs(b[i]), 1e-12) for i in iters)


def tb_scalars(tensorboard_dir: Path, tag: str = "lm loss") -> Dict[int, float]:
    """``{iteration: value}`` of one scalar in a run's TensorBoard events (the full-precision
    values the logged line rounds; Megatron and Bridge write them on the last rank). Our own
    ``*.mm_balance`` events files are skipped."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out: Dict[int, float] = {}
    for path in sorted(Path(tensorboard_dir).glob("events.out.tfevents.*")):
        if path.name.endswith(".mm_balance"):
            continue
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def tree_digest(root: Path) -> str:
    """A hash of every path under ``root`` (directories too: a ``__pycache__`` written there shows)
    and every file's mode and bytes."""
    import hashlib
    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*")):
        h.update(f"{p.relative_to(root)}\0{p.stat().st_mode:o}\0".encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def loss_table(runs: Dict[str, Run]) -> str:
    """Iterations as rows, runs as columns (for failure messages and the docs)."""
    names = list(runs)
    iters = sorted(set().union(*(r.losses for r in runs.values())))
    lines = ["iter " + " ".join(f"{n:>14}" for n in names)]
    for i in iters:
        lines.append(f"{i:>4} " + " ".join(
            f"{runs[n].losses[i]:>14.6E}" if i in runs[n].losses else f"{'-':>14}" for n in names))
    return "\n".join(lines)


def consumed(samples_dir: Path) -> Dict[tuple, list]:
    """``{(rank, iteration): [(keys, digest) per micro-batch]}`` from the records of
    ``--mm-balance-record-samples`` (a later job's records of an iteration replace an
    earlier job's)."""
    from megatron_mm_balance.megatron.samples import read_records
    out: Dict[tuple, dict] = {}
    for r in read_records(str(samples_dir)):
        slot = out.setdefault((r["rank"], r["iteration"]), {})
        if slot and max(j for j, _ in slot) < r["job_start"]:
            slot.clear()
        slot[(r["job_start"], r["microbatch"])] = (tuple(r["keys"] or ()), r["digest"])
    return {k: [v[m] for m in sorted(v)] for k, v in out.items()}


def global_batch(c: Dict[tuple, list], iteration: int) -> list:
    """Every micro-batch the data-parallel group consumed at ``iteration``, as a sorted multiset."""
    return sorted(x for (_, it), mbs in c.items() if it == iteration for x in mbs)


def check_samples(full: "Run", resumed_dir: Path, iters, label: str) -> str:
    """The resumed run (both jobs' records) consumed, rank by rank and iteration by iteration,
    exactly the micro-batches (keys and content digests) of the uninterrupted run."""
    a, b = consumed(full.samples_dir), consumed(resumed_dir)
    want = {it for it in iters}
    assert {it for _, it in a} == want and {it for _, it in b} == want, (sorted(a), sorted(b))
    ranks = sorted({r for r, _ in a})
    assert ranks == [0, 1, 2, 3] and set(a) == set(b), f"{label}: ranks {ranks} / {sorted(set(b) ^ set(a))}"
    assert all(keys for mbs in a.values() for keys, _ in mbs), f"{label}: a micro-batch without keys"
    for it in sorted(want):
        assert global_batch(a, it) == global_batch(b, it), f"{label}: iteration {it}: other micro-batches"
        for r in ranks:
            assert a[(r, it)] == b[(r, it)], (f"{label}: rank {r} iteration {it} consumed "
                                              f"{b[(r, it)]}, uninterrupted {a[(r, it)]}")
    n = sum(len(v) for v in a.values())
    return f"{label}: {n} micro-batches on {len(ranks)} ranks over iterations {min(want)}-{max(want)} identical"


def check_resume(full: "Run", first: "Run", second: "Run", label: str, rel_tol: float,
                 balanced: bool = True) -> str:
    """Assert that a job stopped after iteration 3 and resumed from the same OUTPUT_DIR
    equals the uninterrupted run (iterations 1-3 and 4-6): losses, the samples every rank
    consumed per iteration (when recorded), ``mm-balance compare-logs``, the energon
    dataloader state restored; with balancing, packs still moving; returns the loss table."""
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
    if full.samples_dir is not None:
        assert first.samples_dir == second.samples_dir
        print(check_samples(full, second.samples_dir, range(1, 7), label))
    if balanced:
        assert sum(second.moved.values()) > 0, "no packs moved after the resume"
        # The loader (energon, with save_state) was read ahead across global batches: every
        # telemetry line after a job's first covers only batches its exchange thread had
        # pulled before the training loop asked for them, and the checkpoint was still exact.
        for name, run in (("uninterrupted", full), ("first job", first), ("resumed", second)):
            later = [run.prefetched[i] for i in sorted(run.prefetched)[1:]]
            assert later and all(v == 1.0 for v in later), (
                f"{name}: global batches not prefetched: {run.prefetched}")
        print(f"prefetched share per telemetry line: uninterrupted {full.prefetched}, "
              f"first job {first.prefetched}, resumed {second.prefetched}")
    else:
        assert not (full.moved or first.moved or second.moved), "balancer telemetry with MM_BALANCE=0"
    # The user's tool says the same: the resumed run (both jobs' logs) equals the uninterrupted one.
    cmp = compare_logs(full.log_path, f"{first.log_path},{second.log_path}", "--rtol", str(rel_tol))
    assert cmp.returncode == 0 and cmp.stdout.strip().endswith(": equal"), cmp.stdout + cmp.stderr
    print(cmp.stdout)
    # Our first telemetry line of the resumed job says how Megatron logs its first iterations.
    if balanced:
        assert "resumed_from: 3" in second.log and "resumed_from" not in first.log, second.tail()
    return table


def check_band(off: "Run", on: "Run", control: "Run", label: str) -> str:
    """Off, on and control (``--mm-balance-mode control``) of one job: all exit 0, the control
    moved no pack across ranks (its telemetry, and every rank consumed exactly its own
    micro-batches of the off run, reordered) and reordered some, and ``mm-balance compare-logs
    OFF ON --control CONTROL`` does not answer DIFFERENT. Returns its report."""
    for name, r in (("off", off), ("on", on), ("control", control)):
        assert r.rc == 0, f"{label} {name}: exit {r.rc}\n{r.tail()}"
    assert control.moved and not any(control.moved.values()), f"{label}: the control moved packs {control.moved}"
    assert sum(on.moved.values()) > 0, f"{label}: balancing moved no pack"
    if off.samples_dir is not None and control.samples_dir is not None:
        a, c = consumed(off.samples_dir), consumed(control.samples_dir)
        assert set(a) == set(c), f"{label}: ranks/iterations {sorted(set(a) ^ set(c))}"
        for key in sorted(a):
            assert sorted(a[key]) == sorted(c[key]), (
                f"{label}: rank {key[0]} iteration {key[1]}: the control consumed other micro-batches")
        assert any(a[k] != c[k] for k in a), f"{label}: the control reordered nothing"
    res = compare_logs(off.log_path, on.log_path, "--control", str(control.log_path))
    report = res.stdout + res.stderr
    print(f"\n{label}: off/on/control wall {off.wall_s:.0f}/{on.wall_s:.0f}/{control.wall_s:.0f} s\n{report}")
    assert res.returncode == 0 and not report.strip().endswith("DIFFERENT"), report
    return report


def compare_logs(a, b, *options: str) -> subprocess.CompletedProcess:
    """``mm-balance compare-logs A B [options]``."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "compare-logs", str(a), str(b),
                           *options], capture_output=True, text=True, timeout=120, env=env)


@dataclass
class FreshVenv:
    """A virtual environment set up by scripts/setup_env.sh, and what that took."""

    python: str
    built: bool          # created by this test run (False: reused)
    setup_s: float       # wall time of venv creation + setup_env.sh in this test run
    setup_log: str


FRESH_VENV = Path(os.environ.get("MM_BALANCE_FRESH_VENV") or REPO / ".venv-fresh")


def fresh_venv(megatron_lm: Path, path: Path = FRESH_VENV, timeout: float = 2400.0) -> FreshVenv:
    """``python -m venv PATH`` (no system site-packages) when PATH does not exist, then
    ``PYTHON=PATH/bin/python MEGATRON_LM_DIR=megatron_lm bash scripts/setup_env.sh``; raises
    AssertionError with the script's output if it fails. The torch pair's files are
    hard-linked from this test run's own environment when it has exactly the pinned pair
    (``MM_BALANCE_TORCH_FROM``, scripts/share_torch.py: 5.5 GB not written twice); every
    other package is installed from nothing."""
    t0 = time.monotonic()
    python = path / "bin" / "python"
    built = not python.exists()
    if built:
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(path)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHON=str(python), MEGATRON_LM_DIR=str(megatron_lm))
    env.setdefault("MM_BALANCE_TORCH_FROM", sys.prefix)
    res = subprocess.run(["bash", str(REPO / "scripts" / "setup_env.sh")], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=str(REPO))
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"scripts/setup_env.sh in {path} failed:\n{log[-4000:]}"
    return FreshVenv(python=str(python), built=built, setup_s=time.monotonic() - t0, setup_log=log)
