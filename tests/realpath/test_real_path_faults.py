"""Faults with nothing lost, on the user's path: ``scripts/pretrain_vlm_moe.sh --config
configs/megatron/tiny_cpu.sh`` (patched Megatron-LM core_v0.16.1, DP=2 x EP=2 on 4 CPU
ranks, ``--mm-balance``), a checkpoint every iteration, ``--mm-balance-record-samples``.

One job is started and hit by a fault; the job resumed from its last checkpoint with that
fault removed is hit by the next one, and so on; the last resumed job finishes the
6 iterations. So each fault is followed by a resume, and six jobs cover the five cases:

1. ``killed_rank``: rank 1 SIGKILLed when its exchange of iteration 3's micro-step 1 starts;
2. ``loader_raises``: rank 2's data source raises in the middle of iteration 3's global batch;
3. ``contradicting_metadata``: a pack whose ``num_tiles`` contradicts its image tiles (rank 3,
   iteration 4): refused before anything moves, the error naming its samples;
4. ``pack_too_long``: packs longer than the sequence (``--packing-seq-length 1536`` against
   ``--decoder-seq-length 1024``, a misconfiguration Megatron's LLaVA would silently truncate):
   refused before anything moves, naming the samples;
5. ``data_ends``: rank 1's data ends after one pack of iteration 5's global batch.

The faults are injected through ``MM_BALANCE_FAULT`` (``megatron_mm_balance/runtime/faults.py``,
a test hook), except the over-long packs, which are the user's flag. Each case must end
the job with an error line on every rank naming the iteration and the micro-step (or the
rank whose data ended and how much was read), within the exchange timeout of the first
such line, and the next job must resume from the last checkpoint. Finally the sample
records of all six jobs (an iteration a later job repeated counted once, the later job's)
must equal, rank by rank and iteration by iteration, those of the uninterrupted run: every
sample consumed exactly once, nothing lost, nothing duplicated.

The uninterrupted run is the session's balanced DP=2 x EP=2 6-iteration run
(``runner("dp2_ep2", True, 6)``, shared with test_real_path.py). Slow: ``python -m pytest
tests/realpath/test_real_path_faults.py -m realpath -s``.
"""
from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

import realpath_util as rp

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(2400)]

ITERS = 6
EXCHANGE_TIMEOUT_S = 30
#: flags of every job of the chain (and nothing that changes the data or the model)
COMMON = ["--save-interval", "1", "--mm-balance-timeout", str(EXCHANGE_TIMEOUT_S)]


@dataclass(frozen=True)
class Case:
    name: str
    fault: Optional[str]                  # MM_BALANCE_FAULT, None: no injected fault
    extra: tuple = ()
    #: what the error lines must show (regular expressions over the job's log)
    expect: tuple = ()


CASES = [
    Case("killed_rank", "kill:rank=1:iteration=3:microstep=1",
         expect=(r"\[mm-balance\] rank 1: MM_BALANCE_FAULT=kill:rank=1:iteration=3:microstep=1: SIGKILL during "
                 r"the exchange of micro-step 1 at global batch \d+ \(iteration 3\)",
                 r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9")),
    Case("loader_raises", "raise:rank=2:iteration=3:microstep=1",
         expect=(r"\[mm-balance\] rank 2: training stops at iteration 3: InjectedFault: .*\| rank 2, global "
                 r"batch \d+ \(iteration 3\), micro-step 1: the data source raised",
                 r"\[mm-balance\] rank 0: training stops at iteration 3: PeerFailure: rank 0: global batch \d+ "
                 r"\(iteration 3\) aborted before anything moved: rank 2's data source raised: micro-step 1: ")),
    Case("contradicting_metadata", "corrupt:rank=3:iteration=4:microstep=0",
         expect=(r"\[mm-balance\] rank 3: training stops at iteration 4: BadPack: mm-balance refuses a pack of "
                 r"samples \[train_\d+.*\]: num_tiles \[.*\] sums to \d+ tiles but imgs holds \d+ \| rank 3, "
                 r"global batch \d+ \(iteration 4\), micro-step 0 \(samples train_\d+",
                 r"\[mm-balance\] rank 1: training stops at iteration 4: PeerFailure: .*rank 3's pack check "
                 r"refused a pack: micro-step 0 \(samples train_\d+")),
    Case("pack_too_long", None, extra=("--packing-seq-length", "1536"),
         expect=(r"\[mm-balance\] rank \d: training stops at iteration \d: BadPack: mm-balance refuses a pack of "
                 r"samples \[train_\d+.*\]: the packed sample is \d+ positions long \(cu_lengths: text and "
                 r"image embeddings\), longer than the sequence length 1024 \| rank \d, global batch \d+ "
                 r"\(iteration \d\), micro-step \d",)),
    Case("data_ends", "end:rank=1:iteration=5:microstep=1",
         expect=(r"\[mm-balance\] rank 0: training stops at iteration 5: StopIteration: data source exhausted at "
                 r"global batch \d+ \(iteration 5\): the source of rank 1 after 1 of 2 packs ended; 7 packs "
                 r"pulled for this global batch \(per rank \[2, 1, 2, 2\]\) are not delivered",)),
]
#: a line of ours that says why a rank stopped (or that it was killed)
STOP_LINE = re.compile(r"\[mm-balance\] rank (\d+): (training stops|stopped by |MM_BALANCE_FAULT=kill)"
                       r"(.*)$", re.M)
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")


@dataclass
class Job:
    """One job of the chain: how it went, the checkpoint it resumed from and the one it left."""

    case: Optional[Case]
    run: rp.Run
    resumed_from: int
    last_checkpoint: int
    stop_to_exit_s: Optional[float]       # first stop line seen -> launcher exit
    records: List[dict] = field(default_factory=list)


def _record_lines(samples: Path) -> Dict[str, List[dict]]:
    """Every record of ``--mm-balance-record-samples``, per file (one per rank): each job
    appends its own lines to each rank's file."""
    import json
    if not samples.is_dir():
        return {}
    return {p.name: [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
            for p in sorted(samples.glob("samples-rank*.jsonl"))}


def _latest_checkpoint(out: Path) -> int:
    f = out / "checkpoints" / "latest_checkpointed_iteration.txt"
    return int(f.read_text().strip()) if f.is_file() else 0


def _run_job(env, extra, log_path: Path, samples: Path) -> Tuple[rp.Run, Optional[float]]:
    """Run the launcher to its end, noting when the first stop line appeared in its log."""
    t0 = time.monotonic()
    proc = rp.launch(env, extra, log_path=log_path)
    first_stop = None
    try:
        while proc.poll() is None:
            if first_stop is None and STOP_LINE.search(log_path.read_text(errors="replace")):
                first_stop = time.monotonic()
            if time.monotonic() - t0 > rp.RUN_TIMEOUT_S:
                break
            time.sleep(0.2)
        try:
            rc = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            rc = -9
    finally:
        rp.kill_group(proc)
    end = time.monotonic()
    log = log_path.read_text(errors="replace")
    if first_stop is None and STOP_LINE.search(log):
        first_stop = end
    run = rp.Run(rc=rc, wall_s=end - t0, log=log, log_path=log_path, samples_dir=samples,
                 losses=rp.parse_losses(log), moved=rp.parse_moved(log))
    return run, (None if first_stop is None else end - first_stop)


@pytest.fixture(scope="module")
def chain(megatron_lm, dataset, runs_dir) -> List[Job]:
    """The five faulted jobs and the one that finishes, all in one OUTPUT_DIR (see the module
    docstring). Each job's records are the lines it appended to the shared sample files."""
    out = runs_dir / "faults"
    samples = out / "samples"
    jobs: List[Job] = []
    for case in [*CASES, None]:
        seen = {name: len(lines) for name, lines in _record_lines(samples).items()}
        env = rp.launcher_env(megatron_lm, dataset, mm_balance=True, output_dir=out, train_iters=ITERS)
        env.pop("MM_BALANCE_FAULT", None)
        if case is not None and case.fault:
            env["MM_BALANCE_FAULT"] = case.fault
        extra = [*COMMON, *(case.extra if case else ()), "--mm-balance-record-samples", str(samples)]
        name = case.name if case else "finish"
        run, stop_s = _run_job(env, extra, runs_dir / f"faults-{name}.log", samples)
        loaded = [int(x) for x in LOADED.findall(run.log)]
        new = [r for fname, lines in _record_lines(samples).items() for r in lines[seen.get(fname, 0):]]
        jobs.append(Job(case, run, loaded[0] if loaded else 0, _latest_checkpoint(out), stop_s, new))
        print(f"\n{name}: exit {run.rc} after {run.wall_s:.0f} s; resumed from {jobs[-1].resumed_from}, "
              f"last checkpoint {jobs[-1].last_checkpoint}; first stop line -> exit "
              f"{'-' if stop_s is None else f'{stop_s:.1f} s'}")
        for m in STOP_LINE.finditer(run.log):
            print("   ", m.group(0)[:400])
    return jobs


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_fault_ends_the_job_with_a_clear_error_on_every_rank(chain, case):
    """The job exits non-zero; every rank printed a stop line naming an iteration and where in
    it (the micro-step, or for the data's end how much each rank read); the case's own lines
    are there; the launcher exited within the exchange timeout of the first stop line."""
    job = next(j for j in chain if j.case is not None and j.case.name == case)
    log = job.run.log
    assert job.run.rc != 0, f"{case}: the job exited 0\n{job.run.tail()}"
    lines: Dict[int, List[str]] = {}
    for m in STOP_LINE.finditer(log):
        lines.setdefault(int(m.group(1)), []).append(m.group(0))
    assert sorted(lines) == [0, 1, 2, 3], f"{case}: stop lines from ranks {sorted(lines)}\n{job.run.tail(80)}"
    for rank, found in lines.items():
        assert any(re.search(r"iteration \d+", s) and re.search(r"micro-step|\d+ of \d+ packs", s) for s in found), (
            f"{case}: rank {rank}'s stop line names no iteration and micro-step: {found}")
    for pattern in job.case.expect:
        assert re.search(pattern, log), f"{case}: no line matches {pattern!r}\n{job.run.tail(80)}"
    assert job.stop_to_exit_s is not None and job.stop_to_exit_s <= EXCHANGE_TIMEOUT_S, (
        f"{case}: {job.stop_to_exit_s} s from the first stop line to the launcher's exit")


@pytest.mark.parametrize("case", ["contradicting_metadata", "pack_too_long", "loader_raises", "data_ends"])
def test_nothing_of_the_faulted_global_batch_is_consumed(chain, case):
    """No rank consumed a micro-batch of the iteration the fault hit (nor any later one): the
    refusal (or the failed or short pull) came at that global batch's agreement, before its
    exchange; the ranks had trained every iteration before it in full."""
    job = next(j for j in chain if j.case is not None and j.case.name == case)
    hit = int(re.search(r"training stops at iteration (\d+)", job.run.log).group(1))
    its = sorted({r["iteration"] for r in job.records})
    assert all(it < hit for it in its), f"{case}: iteration {hit} was hit, records of {its}"
    assert its == list(range(job.resumed_from + 1, hit)), (case, job.resumed_from, hit, its)
    assert len(job.records) == 8 * len(its), f"{case}: {len(job.records)} records for iterations {its}"


def test_each_job_resumes_from_the_last_checkpoint(chain):
    """Job k+1 loads the checkpoint job k left (the dataloader state too), and the chain
    moves forward: the last job finishes the run."""
    for prev, job in zip(chain, chain[1:]):
        name = job.case.name if job.case else "finish"
        assert job.resumed_from == prev.last_checkpoint, (name, prev.last_checkpoint, job.resumed_from)
        if job.resumed_from:
            assert "restored dataset state" in job.run.log, f"{name}: energon's state was not restored"
        assert {r["job_start"] for r in job.records} <= {job.resumed_from}, (name, job.resumed_from)
    last = chain[-1]
    assert last.run.rc == 0 and last.last_checkpoint == ITERS, f"exit {last.run.rc}\n{last.run.tail()}"
    assert sorted(last.run.losses)[-1] == ITERS, sorted(last.run.losses)


def test_every_sample_is_consumed_exactly_once_over_the_interrupted_and_resumed_jobs(chain, runner):
    """The records of the six jobs (an iteration repeated by a later job counted once: the
    later job's) equal the uninterrupted run's, rank by rank and iteration by iteration, keys
    and content digests; the multiset of samples over the whole run is the same too. Some
    iterations were indeed repeated (the test is one that can fail)."""
    from collections import Counter
    full = runner("dp2_ep2", True, ITERS)
    assert full.rc == 0, full.tail()
    samples = chain[-1].run.samples_dir
    print(rp.check_samples(full, samples, range(1, ITERS + 1), "faults chain vs uninterrupted"))
    a, b = rp.consumed(full.samples_dir), rp.consumed(samples)
    per_sample = lambda c: Counter(k for mbs in c.values() for keys, _ in mbs for key in keys for k in key.split(","))
    assert per_sample(a) == per_sample(b)
    recorded = Counter(r["iteration"] for job in chain for r in job.records)
    repeated = sorted(it for it, n in recorded.items() if n > 8)
    print(f"records per iteration over the six jobs {dict(sorted(recorded.items()))}; "
          f"iterations run again after a fault: {repeated}")
    assert repeated, "no iteration was repeated: the faults hit no job after its last checkpoint"
    # The losses agree too: each iteration as the last job that trained it logged it.
    runs = {(j.case.name if j.case else "finish"): j.run for j in chain}
    print(rp.loss_table({"uninterrupted": full, **runs}))
    last_seen = {it: v for j in chain for it, v in j.run.losses.items()}
    assert sorted(last_seen) == list(range(1, ITERS + 1))
    assert rp.max_rel_diff(last_seen, full.losses, range(1, ITERS + 1)) <= 1e-5
