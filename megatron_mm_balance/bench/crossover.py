"""Balancing's gain measured inside the same jobs: the crossover runs of a real-path bench.

Read by ``benchmarks/crossover_gain.py OUT [--warmup 2] [--pair crossover|images-crossover]``,
which prints :func:`report`, and by the demo (:mod:`megatron_mm_balance.testing.real_demo`),
which adds the paired interval (:func:`paired_gains`, :func:`paired_interval`) and the gain
the runs' own timings predict (:func:`predicted_gains`).

``OUT`` is a ``mm-balance bench-realpath [--bridge] --modes crossover-even,crossover-odd --out OUT``
directory (Megatron-Bridge's or Megatron-LM's; the iteration times read are each iteration's
own from the third on, in both frameworks' logs). In round ``R``, ``roundR-crossover-even``
balances the global batches of even training iterations and runs the odd ones as drawn
(gathered and solved, nothing moved);
``roundR-crossover-odd`` the other way round. Both read the same data, so every measured
iteration is timed once balanced and once not, and each job runs half its iterations each way.
``--pair images-crossover`` reads the ``images-crossover-even`` / ``images-crossover-odd`` runs
instead (``mm_balance.vision=images`` with the same parities: packs and frames balanced at one
parity, the plain tower and the drawn packs at the other). ``--pair groups-crossover`` reads the
``groups-crossover-even`` / ``-odd`` runs: packs moved at every iteration, placed by the job's
meeting groups (the expert-parallel groups) at one parity and as if all data-parallel ranks met
every micro-step at the other, so "balanced" reads "the group objective" and "not" reads
"today's objective", and the gain is the group objective's over today's.

A job's own speed (the machine's state while it ran, which on a shared 2-core host drifts by
5-10% between jobs of the same work) multiplies all its iterations alike. Per round, with
``on``/``off`` the summed iteration times of the iterations each job balanced or not:

    even = off_odd_job(even iterations) / on_even_job(even iterations)
    odd  = off_even_job(odd iterations) / on_odd_job(odd iterations)
    gain = sqrt(even * odd) - 1

The two jobs' speeds enter ``even`` and ``odd`` as reciprocal factors and cancel in the product;
the data enters each ratio on both sides. Prints each round's gain, their geometric mean, and
the mean over rounds of the paired per-iteration gains beside them; and the consumer's wait per
iteration (gather, plan and exchange inside ``next()``) on the balanced and the unbalanced
iterations, which shows the unbalanced iterations' overhead over a job without balancing (the
cost gather and the plan).

Where ``OUT`` also has ``off`` runs (``roundR-off``), it checks the design's premise: each
crossover iteration's time over the ``off`` job's same iteration, in the same round, averaged
over the unbalanced and over the balanced iterations. Unbalanced iterations near 1.0 mean a
crossover job's unbalanced iterations run as a job without balancing does, so the crossover
gain is balancing's gain over ``off``; above 1.0, the crossover job's own data path costs its
unbalanced iterations too (e.g. a whole batch pulled inside ``next()`` while the loader's
workers share the cores), and the crossover gain is over that, not over ``off``.

That comparison is between jobs, so it carries their speeds. Where the runs kept their per-pack
timings (``ROUND/timing``), each job's language-model compute per iteration (the language phase
of the rank that reached it last, :func:`~megatron_mm_balance.sim.run_trace.measured_phases`:
every pack costs the language model about the same, balanced or not) over the ``off`` job's
same iterations gives the job's own speed against ``off``; the premise is printed again with
that speed divided out.
"""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from .realpath import RunResult, measured_window, parse_log
from ..sim.run_trace import RunTraceError, load_run, measured_phases


class CrossoverError(ValueError):
    """Crossover runs that cannot be read as a pair: one line."""


PARITIES = ("even", "odd")
#: the pairs of crossover modes a bench may have run: pack placement, or packs and frames
PAIRS = ("crossover", "images-crossover", "groups-crossover")


def load(out: Path, rnd: int, mode: str) -> RunResult:
    """Round ``rnd``'s run of ``mode``: the framework's per-iteration times and our telemetry
    (iteration 2's loss left as printed: only times are read)."""
    d = out / f"round{rnd}-{mode}"
    elapsed, losses, tele, fit = parse_log((d / "train.log").read_text(errors="replace"),
                                           first_two_averaged=False)
    return RunResult(mode, rnd, 0, 0.0, str(d), elapsed, losses, tele, fit)


def balanced(parity: str, iteration: int) -> bool:
    """Whether the ``crossover-<parity>`` job balanced ``iteration``."""
    return iteration % 2 == PARITIES.index(parity)


def round_gain(even: RunResult, odd: RunResult, warmup: int) -> dict:
    """One round's crossover gain (module docstring), its two ratios, and the paired
    per-iteration gains (off time over on time, minus 1) on the iterations both jobs measured."""
    its = sorted(set(measured_window(even, warmup)) & set(measured_window(odd, warmup)))
    if not any(i % 2 == 0 for i in its) or not any(i % 2 for i in its):
        raise CrossoverError(f"round {even.round}: the two jobs share no measured iteration of each parity")
    ratios = {}
    for parity, on_run, off_run in (("even", even, odd), ("odd", odd, even)):
        mine = [i for i in its if balanced(parity, i)]
        ratios[parity] = sum(off_run.elapsed_ms[i] for i in mine) / sum(on_run.elapsed_ms[i] for i in mine)
    paired = []
    for i in its:
        on_run, off_run = (even, odd) if balanced("even", i) else (odd, even)
        paired.append(off_run.elapsed_ms[i] / on_run.elapsed_ms[i] - 1)
    return dict(round=even.round, gain=math.sqrt(ratios["even"] * ratios["odd"]) - 1, ratios=ratios,
                paired_mean=statistics.fmean(paired), iterations=len(its))


def consumer_wait(run: RunResult, warmup: int) -> dict:
    """Mean ``consumer_wait_ms`` per measured iteration, over the iterations the run balanced
    and over those it did not (None where the telemetry lacks it)."""
    parity = run.mode.rsplit("-", 1)[1]
    out = {}
    for on in (True, False):
        waits = [run.telemetry[i].get("consumer_wait_ms") for i in measured_window(run, warmup)
                 if balanced(parity, i) == on and i in run.telemetry]
        waits = [w for w in waits if w is not None]
        out["on" if on else "off"] = statistics.fmean(waits) if waits else None
    return out


def off_times(out: Path, rounds) -> dict:
    """``{round: {iteration: ms}}``: the ``off`` run's iteration times of each round that has one."""
    return {rnd: load(out, rnd, "off").elapsed_ms for rnd in rounds
            if (out / f"round{rnd}-off" / "train.log").is_file()}


def against_off(runs: dict, offs: dict, warmup: int, speeds: dict | None = None) -> dict:
    """Mean over rounds' iterations of a crossover iteration's time over the ``off`` run's same
    iteration (same round), for the unbalanced and the balanced iterations; {} without ``off``
    runs. ``runs``: each round's crossover runs, ``{round: (even, odd)}``; ``offs``:
    :func:`off_times`. ``speeds`` (:func:`job_speeds`): each ratio divided by its job's speed,
    rounds without one left out."""
    ratios = {"unbalanced": [], "balanced": []}
    for rnd, pair in runs.items():
        if rnd not in offs or (speeds is not None and not all((rnd, p) in speeds for p in PARITIES)):
            continue
        off = offs[rnd]
        for parity, run in zip(PARITIES, pair):
            speed = 1.0 if speeds is None else speeds[(rnd, parity)]
            for i in measured_window(run, warmup):
                if i in off:
                    key = "balanced" if balanced(parity, i) else "unbalanced"
                    ratios[key].append(run.elapsed_ms[i] / off[i] / speed)
    return {k: (statistics.fmean(v), len(v)) for k, v in ratios.items() if v}


def timing_traces(out: Path, rounds, warmup: int, pair: str = PAIRS[0]) -> dict:
    """``{(round, mode): RunTrace}``: the per-pack timings of each round's ``off`` run and its
    two ``pair`` runs, read once for every figure that uses them; a run without them left out."""
    traces = {}
    for rnd in rounds:
        for mode in ("off",) + tuple(f"{pair}-{parity}" for parity in PARITIES):
            try:
                traces[(rnd, mode)] = load_run(str(out / f"round{rnd}-{mode}" / "timing"), skip_iterations=warmup)
            except RunTraceError:
                pass
    return traces


def lm_compute(trace) -> dict:
    """``{iteration: ms}``: the language-model compute of each measured iteration (summed over
    its micro-steps) from a run's per-pack timings (a ``RunTrace``); {} for None."""
    if trace is None:
        return {}
    per_iteration = measured_phases(trace).lm[:, 0, :].sum(axis=1)
    return dict(zip(trace.iterations, (float(x) for x in per_iteration)))


def job_speeds(traces: dict, rounds, pair: str = PAIRS[0]) -> dict:
    """Each crossover job's language-model compute over the ``off`` job's on the same iterations
    (same round), ``{(round, parity): ratio}``: above 1, the job ran slower than ``off`` on the
    same work. {} without ``off`` runs or timings. ``traces``: :func:`timing_traces`."""
    speeds = {}
    for rnd in rounds:
        off = lm_compute(traces.get((rnd, "off")))
        for parity in PARITIES:
            mine = lm_compute(traces.get((rnd, f"{pair}-{parity}")))
            common = [i for i in mine if i in off and off[i] > 0]
            if common:
                speeds[(rnd, parity)] = statistics.fmean(mine[i] / off[i] for i in common)
    return speeds


def phases_by_balance(traces: dict, rounds, pair: str = PAIRS[0]) -> dict:
    """Where a crossover job's time goes at its balanced and at its unbalanced iterations:
    ``{"balanced" | "unbalanced": {"vision", "lm_compute", "waiting": ms per iteration and
    rank}}`` from the per-pack timings of every round's two jobs (the vision tower's forward
    and backward, the frames' exchange inside the forward; the language model's compute, the
    language phase of the rank that reached it last; the rest of the language phase, waiting
    in its collectives). {} without timings. ``traces``: :func:`timing_traces`."""
    sums = {key: {"vision": [], "lm_compute": [], "waiting": []} for key in ("balanced", "unbalanced")}
    for rnd in rounds:
        for parity in PARITIES:
            trace = traces.get((rnd, f"{pair}-{parity}"))
            if trace is None:
                continue
            lm = measured_phases(trace).lm.sum(axis=2)                        # [I, D]
            vision = (trace.vf + trace.vb).sum(axis=2)
            waiting = (trace.lf + trace.lb).sum(axis=2) - lm
            for k, iteration in enumerate(trace.iterations):
                cell = sums["balanced" if balanced(parity, iteration) else "unbalanced"]
                cell["vision"].append(float(vision[k].mean()))
                cell["lm_compute"].append(float(lm[k].mean()))
                cell["waiting"].append(float(waiting[k].mean()))
    return {key: {name: statistics.fmean(v) for name, v in cell.items()}
            for key, cell in sums.items() if cell["vision"]}


def rounds_in(out: Path, pair: str = PAIRS[0]) -> list:
    """The rounds that have both runs of ``pair`` (``roundR-<pair>-even`` and ``-odd``)."""
    name = re.compile(rf"round(\d+)-{re.escape(pair)}-even")
    found = sorted(int(m.group(1)) for p in out.glob("round*") if (m := name.fullmatch(p.name)))
    return [r for r in found if (out / f"round{r}-{pair}-odd" / "train.log").is_file()]


def report(out: Path, warmup: int, pair: str = PAIRS[0]) -> dict:
    rounds = rounds_in(out, pair)
    if not rounds:
        raise CrossoverError(f"{out}: no round with both {pair}-even and {pair}-odd runs")
    runs = {rnd: tuple(load(out, rnd, f"{pair}-{parity}") for parity in PARITIES) for rnd in rounds}
    per_round, waits = [], []
    for even, odd in runs.values():
        per_round.append(round_gain(even, odd, warmup))
        waits += [consumer_wait(even, warmup), consumer_wait(odd, warmup)]
    overall = math.exp(statistics.fmean(math.log1p(r["gain"]) for r in per_round)) - 1

    def mean_wait(key):
        values = [w[key] for w in waits if w[key] is not None]
        return statistics.fmean(values) if values else None
    traces = timing_traces(out, rounds, warmup, pair)
    speeds = job_speeds(traces, rounds, pair)
    offs = off_times(out, runs)
    return dict(rounds=per_round, gain=overall, wait_on_ms=mean_wait("on"), wait_off_ms=mean_wait("off"),
                against_off=against_off(runs, offs, warmup), speeds=speeds,
                against_off_at_speed=against_off(runs, offs, warmup, speeds),
                phases=phases_by_balance(traces, rounds, pair))


# -- the demo's figures: a paired interval, and what the runs' own timings predict ------------

#: Student's t quantile at 0.975 (a two-sided 95% interval) by degrees of freedom
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086)


def paired_gains(even: RunResult, odd: RunResult, warmup: int) -> list:
    """``[(iteration, next iteration, gain)]``: per pair of consecutive measured iterations
    that both jobs timed, ``sqrt(r_e * r_o) - 1`` with ``r_i`` iteration ``i``'s unbalanced time
    over its balanced one. Each job's speed enters ``r_e`` and ``r_o`` as reciprocal factors,
    so every pair's gain is free of it (as long as a job's speed holds for two iterations)."""
    its = sorted(set(measured_window(even, warmup)) & set(measured_window(odd, warmup)))

    def ratio(i):
        on_run, off_run = (even, odd) if balanced("even", i) else (odd, even)
        return off_run.elapsed_ms[i] / on_run.elapsed_ms[i]
    out = []
    for a, b in zip(its[0::2], its[1::2]):          # (3, 4), (5, 6), ...: one of each parity
        if b == a + 1:
            out.append((a, b, math.sqrt(ratio(a) * ratio(b)) - 1.0))
    return out


def paired_interval(gains) -> tuple:
    """``(mean, low, high)`` of pair gains (:func:`paired_gains`' third items): the mean of
    their logarithms and its 95% Student interval, as gains; ``low``/``high`` None with fewer
    than two pairs."""
    logs = [math.log1p(g) for g in gains]
    if not logs:
        raise CrossoverError("no pair of measured iterations (one even, one odd) in both jobs")
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.expm1(mean), None, None
    df = len(logs) - 1
    t = T_975[df - 1] if df <= len(T_975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.expm1(mean), math.expm1(mean - half), math.expm1(mean + half)


def predicted_gains(traces: dict) -> dict:
    """What the per-pack timings of the unbalanced iterations predict (``traces``:
    ``{parity: RunTrace}`` of the two jobs, ``load_run``): the placement the runtime computes
    on image tokens, and perfect balance, laid out in the simulator's micro-step timeline
    (:func:`~megatron_mm_balance.sim.run_trace.predicted_times`), as gains over the packs as
    drawn; ``{}`` without timings."""
    from ..sim.run_trace import placement_order, predicted_times
    laid = placed = perfect = 0.0
    for parity, trace in traces.items():
        keep = [k for k, it in enumerate(trace.iterations) if not balanced(parity, it)]
        if not keep:
            continue
        as_drawn, by_placement = predicted_times(trace), predicted_times(trace, order=placement_order(trace))
        laid += float(as_drawn["laid_out_ms"][keep].sum())
        perfect += float(as_drawn["perfect_ms"][keep].sum())
        placed += float(by_placement["laid_out_ms"][keep].sum())
    if not laid:
        return {}
    return {"placement_gain": laid / placed - 1.0, "perfect_gain": laid / perfect - 1.0}
