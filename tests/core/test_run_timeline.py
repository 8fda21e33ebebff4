"""``mm-balance timeline`` and the timing files it reads: per rank or per node, sampled.

The records are written as the timing hooks write them (a :class:`TimingFileWriter` per
rank, node files appended by separate processes); the figure is rendered to PNG and SVG
and its text read back."""
from __future__ import annotations

import json
import multiprocessing as mp
import re

import numpy as np
import pytest

from megatron_mm_balance.cli import main
from megatron_mm_balance.cost.timing_files import (TimingFileError, TimingFileWriter, node_file_name,
                                                   read_timing_records, timing_paths)
from megatron_mm_balance.timeline import layout
from megatron_mm_balance.timeline.records import read_run

D, G = 8, 4
HEAVY_RANK, HEAVY_ITERATION = 5, 4
LM_COMPUTE = 100.0


def batch_records(iteration: int, vision: list, *, node_of=lambda r: f"host n{r // 4}") -> list:
    """One global batch as the hooks record it under expert parallelism: every rank's
    language phase lasts until the last rank has arrived, plus the compute."""
    out, clock = [], [0.0] * len(vision)
    for g in range(len(vision[0])):
        arrival = [clock[r] + 2.0 + vision[r][g] for r in range(len(vision))]
        for r, row in enumerate(vision):
            vf, wait = row[g], max(arrival) - arrival[r]
            lf, lb, vb = 35.0 + wait, LM_COMPUTE - 35.0, 2 * vf
            start = clock[r] + 2.0
            end = start + vf + lf + lb + vb
            out.append(dict(iteration=iteration, microbatch=g, rank=r, images=[int(vf * 10)], lengths=[1024],
                            vision_forward_ms=vf, vision_backward_ms=vb, lm_forward_ms=lf, lm_backward_ms=lb,
                            start_s=(1000.0 * iteration + start) / 1e3, end_s=(1000.0 * iteration + end) / 1e3,
                            node=node_of(r)))
            clock[r] = end
    return out


def vision_of(iteration: int, balanced: bool) -> list:
    rng = np.random.default_rng(iteration)
    v = rng.choice([20.0, 40.0, 200.0], size=(D, G))
    if iteration == HEAVY_ITERATION:
        v[HEAVY_RANK] = 400.0
    if balanced:                                     # every rank the mean: what balancing aims at
        v = np.full((D, G), v.mean())
    return v.tolist()


def write_run(directory, *, balanced=False, layout_="rank", every=1, iterations=range(1, 7)) -> None:
    writers = {r: TimingFileWriter(str(directory), rank=r, layout=layout_, node=f"host n{r // 4}", every=every)
               for r in range(D)}
    for it in iterations:
        for rec in batch_records(it, vision_of(it, balanced)):
            writers[rec["rank"]].write(rec)
    for w in writers.values():
        w.close()


# -- the timing files ------------------------------------------------------------------------

def _append_node_file(directory, rank, n):
    w = TimingFileWriter(directory, rank=rank, layout="node", node="gpu-node 7")
    for it in range(n):
        w.write(dict(iteration=it, microbatch=0, rank=rank, images=[1] * 200, lengths=[4096],
                     vision_forward_ms=1.0, vision_backward_ms=2.0, lm_forward_ms=3.0, lm_backward_ms=4.0))
        if it % 7 == 0:
            w.flush()
    w.close()


def test_a_node_file_holds_every_line_of_its_ranks_whole(tmp_path):
    procs = [mp.get_context("fork").Process(target=_append_node_file, args=(str(tmp_path), r, 300))
             for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [p.rsplit("/", 1)[1] for p in timing_paths(str(tmp_path))] == ["timing-node-gpu-node-7.jsonl"]
    recs = read_timing_records(str(tmp_path))                  # every line parses: none torn
    assert sorted((r["rank"], r["iteration"]) for r in recs) == [(r, i) for r in range(4) for i in range(300)]
    assert {r["node"] for r in recs} == {"gpu-node 7"}


def test_sampling_writes_whole_global_batches_of_every_nth_iteration(tmp_path):
    write_run(tmp_path / "s", every=3)
    recs = read_timing_records(str(tmp_path / "s"))
    assert sorted({r["iteration"] for r in recs}) == [3, 6]
    assert len(recs) == 2 * D * G
    assert len(timing_paths(str(tmp_path / "s"))) == D


def test_the_recorder_writes_the_sampled_iterations_to_its_nodes_file(tmp_path):
    from megatron_mm_balance.megatron.timing import TimingRecorder
    rec = TimingRecorder(rank=3, out_dir=str(tmp_path), files="node", every=2, node="slurm node 1")
    for it in (1, 2, 3, 4):
        rec.set_iteration(it)
        for _ in range(2):
            rec.backward_started(rec.begin([256], [1024]))
    rec.close()
    recs = read_timing_records(str(tmp_path))
    assert [(r["iteration"], r["microbatch"]) for r in recs] == [(2, 0), (2, 1), (4, 0), (4, 1)]
    assert {r["node"] for r in recs} == {"slurm node 1"} and {r["rank"] for r in recs} == {3}
    assert rec.path.endswith("timing-node-slurm-node-1.jsonl")
    assert len(rec.records(1, 4)) == 8                       # the calibration still sees every record


def test_the_reader_takes_both_layouts_and_names_a_bad_line(tmp_path):
    write_run(tmp_path / "r")
    write_run(tmp_path / "n", layout_="node")
    assert len(timing_paths(str(tmp_path / "n"))) == 2                       # 8 ranks on 2 nodes
    assert read_timing_records(str(tmp_path / "r")) == read_timing_records(str(tmp_path / "n"))
    (tmp_path / "n" / node_file_name("host n9")).write_text('{"iteration": 1}\n')
    with pytest.raises(TimingFileError, match=r"timing-node-host-n9.jsonl:1: missing \['images'"):
        read_timing_records(str(tmp_path / "n"))
    with pytest.raises(TimingFileError, match="no timing-rank"):
        timing_paths(str(tmp_path))
    with pytest.raises(ValueError, match="needs the node's name"):
        TimingFileWriter(str(tmp_path), rank=0, layout="node")


# -- the layout ------------------------------------------------------------------------------

def test_waiting_is_the_language_phase_beyond_the_last_arrivals_and_the_steps_end():
    run = read_run_of(batch_records(1, vision_of(HEAVY_ITERATION, False)))
    p = run.phases[0]                                                        # [D, G, P]
    heavy = p[HEAVY_RANK]
    assert heavy[:, layout.WAITING].sum() == pytest.approx(0.0, abs=1e-6)    # it arrived last every time
    assert p[:, :, layout.LANGUAGE] == pytest.approx(np.full((D, G), LM_COMPUTE))
    # a light rank waits, per micro-step, for the heavy rank's vision (the backward of the
    # step before and the forward of this one) beyond its own
    light = 0
    v = np.array(vision_of(HEAVY_ITERATION, False))
    ahead = (v[HEAVY_RANK] - v[light]) + np.concatenate([[0.0], 2 * (v[HEAVY_RANK] - v[light])[:-1]])
    assert p[light, :, layout.WAITING] == pytest.approx(ahead, abs=1e-3)
    spans = layout.spans_ms(p)
    assert spans.argmax() == HEAVY_RANK
    tl = layout.batch_timeline(p, iteration=1, title="off", slowest=2)
    assert tl.labels[0] == f"rank {HEAVY_RANK} (slowest)" and tl.labels[-1].endswith("(median)")
    assert tl.final_wait[0] == pytest.approx(0.0) and (tl.final_wait >= 0).all()
    ends = layout.spans_ms(tl.phases) + tl.final_wait
    assert ends == pytest.approx(np.full(len(ends), tl.step_ms))            # every row ends at the step's end


def read_run_of(records, tmp=None):
    import tempfile
    d = tempfile.mkdtemp(prefix="timeline-")
    by_rank = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r)
    for rank, recs in by_rank.items():
        with open(f"{d}/timing-rank{rank:05d}.jsonl", "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
    return read_run(d, skip_iterations=0)


def test_step_sync_counts_no_waiting_inside_the_language_model():
    p = layout.phase_durations([[[10.0]], [[50.0]]], [[[60.0]], [[40.0]]], [[[0.0]], [[0.0]]],
                               [[[0.0]], [[0.0]]], [[[0.0]], [[0.0]]], [[[40.0]], [[40.0]]], sync="step")
    assert p[..., layout.WAITING].sum() == 0.0
    assert p[0, 0, 0, layout.LANGUAGE] == 60.0
    with pytest.raises(ValueError, match="sync must be one of"):
        layout.phase_durations([1.0], [1.0], [1.0], [1.0], [0.0], [1.0], sync="sometimes")


def test_nodes_are_their_ranks_mean_and_the_worst_batch_is_the_most_waiting(tmp_path):
    write_run(tmp_path / "off")
    run = read_run(str(tmp_path / "off"))
    assert run.nodes == ("host n0",) * 4 + ("host n1",) * 4
    assert run.iterations[layout.worst_batch(run.phases)] == HEAVY_ITERATION
    k = run.index(HEAVY_ITERATION)
    tl = layout.batch_timeline(run.phases[k], iteration=HEAVY_ITERATION, title="off", nodes=run.nodes)
    assert tl.unit == "node" and len(tl.labels) == 2
    assert tl.labels[0] == "node host n1 (slowest), mean of 4"                 # rank 5's node
    assert tl.phases[0] == pytest.approx(run.phases[k][4:].mean(axis=0))


# -- the command -----------------------------------------------------------------------------

def test_the_command_draws_off_above_on_at_the_worst_batch(tmp_path, capsys):
    write_run(tmp_path / "off")
    write_run(tmp_path / "on", balanced=True, layout_="node")
    rc = main(["timeline", str(tmp_path / "off"), str(tmp_path / "on"), "--slowest", "2",
               "--title", "test run", "--out", str(tmp_path / "fig" / "t.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"off, iteration {HEAVY_ITERATION}: step" in out and f"--mm-balance, iteration {HEAVY_ITERATION}" in out
    assert f"rank {HEAVY_RANK} (slowest)" in out
    png, svg = tmp_path / "fig" / "t.png", tmp_path / "fig" / "t.svg"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = svg.read_text()
    # matplotlib writes text as glyph paths with the string in a comment: the labels a person reads
    for label in (f"rank {HEAVY_RANK} (slowest)", "(median)", "vision forward", "language model",
                  "vision backward", "waiting for other ranks", "test run"):
        assert f"<!-- {label}" in text or label in text, label
    gain = float(re.search(r"\(([-+][0-9.]+)% vs off\)", out).group(1))
    assert gain < -30                                                        # balanced: much shorter step


def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    write_run(tmp_path / "off", iterations=range(1, 5))
    for args, message in ((["--iteration", "99"], "no complete global batch at iteration 99 (complete: 3-4)"),
                          (["--slowest", "0"], "--slowest must be >= 1"),
                          ([str(tmp_path / "nothing")], "no such timing directory")):
        assert main(["timeline", str(tmp_path / "off"), *args, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
