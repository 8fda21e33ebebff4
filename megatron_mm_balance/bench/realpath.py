"""``mm-balance bench-realpath``: Megatron-LM's own ``elapsed time per iteration``, off vs on.

Runs ``scripts/pretrain_vlm_moe.sh --config configs/megatron/vision_heavy_cpu.sh`` (the
user's launcher and Megatron-LM's ``examples/multimodal/train.py``, real vision-encoder
and language-model compute) on a ``make-dataset --mix vision-heavy`` dataset, in
interleaved rounds of these modes, on identical data (every other round in reverse
order, so that load drifting over the rounds falls on every mode alike):

* ``off``: ``MM_BALANCE=0``;
* ``sync``: ``--mm-balance --no-mm-balance-overlap`` (the exchange inside ``next()``);
* ``overlap``: ``--mm-balance`` (the exchange on its background thread);
* ``auto``: ``--mm-balance --mm-balance-cost auto`` (costs fitted from the job's own
  timings after ``--calibration-iters`` iterations);
* ``images`` (only when asked for in ``--modes``): ``overlap`` with
  ``--mm-balance-vision images`` (tiles also balanced across ranks every micro-step);
* ``untimed`` (only when asked for in ``--modes``): ``off`` without the timing hooks,
  which measures what the hooks cost;
* ``crossover-even``, ``crossover-odd`` (only when asked for in ``--modes``): ``sync`` at the
  iterations of that parity, the others as drawn (``--mm-balance-mode crossover-*``); the two
  time every iteration balanced and not inside the same jobs (``benchmarks/crossover_gain.py``);
* ``sync-all`` (only when asked for in ``--modes``): ``sync`` placed as if all data-parallel ranks
  met every micro-step (``--mm-balance-sync microstep``) instead of by the job's meeting groups;
* ``groups-crossover-even``, ``groups-crossover-odd`` (only when asked for in ``--modes``): ``sync``
  placed by the meeting groups at the iterations of that parity and as ``sync-all`` at the
  others; the two time both placements inside the same jobs (``crossover_gain.py --pair
  groups-crossover``).

``--bridge`` runs the same bench on Megatron-Bridge (:class:`~megatron_mm_balance.bridge.bench.BridgeFramework`):
``scripts/pretrain_bridge_vlm.sh --config configs/bridge/qwen3_vl_moe_native_res_cpu.sh`` on a
``make-dataset --format bridge-qwen-vl --mix native-res`` dataset, Bridge's own ``elapsed
time per iteration``, modes ``off``, ``packs`` (pack placement, ``mm_balance.cost`` =
``--cost``), ``model`` (pack placement with the FLOP-derived cost, ``mm_balance.cost=model``)
and ``images`` (``mm_balance.vision=images``, where the installed ``mm_balance`` config has
that field). What differs per framework (launcher, config, modes and their overrides, the
data set, how the log prints losses) is one small object (:class:`MegatronLMFramework`,
:class:`~megatron_mm_balance.bridge.bench.BridgeFramework`); the runs, the analysis and the simulation are shared.
``--holdout-seed`` adds a round of ``off`` and the first balanced mode on a data set of
another seed (``--holdout-rounds N``: N of them, each after the main round of its number),
and the simulator's timing model fitted on the main ``off`` runs predicts those runs'
measured iteration times (:func:`predict_holdout`: the median over all their iterations).

Every run has ``--mm-balance-timing-dir`` (per-pack timings, JSON Lines per rank). From
Megatron's log: the median ``elapsed time per iteration`` and its spread per mode, after
dropping the warm-up iterations (Megatron prints the mean of a job's first two
iterations on its second line), and every iteration's ``lm loss``, which must equal the
same round's ``off`` run (relative difference <= ``--loss-tolerance``). From our
telemetry: consumer wait (exposed exchange), exchange time and the exchange thread's
CPU time (``time.thread_time``) per iteration. From the per-pack timings: the predicted
iteration time of the unbalanced packs, of our placement, and of perfect balance
(every micro-step's maximum equal to its mean). And the simulator on the runs' own
layout with a timing model fitted from their timings (``mm-balance simulate RUN_DIR
--timing run``), side by side with the measurements.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "scripts" / "pretrain_vlm_moe.sh"
CONFIG = REPO / "configs" / "megatron" / "vision_heavy_cpu.sh"
MODES = ("off", "sync", "overlap", "auto")
#: Not in the default rounds: pack and tile balancing together, ``off`` without the
#: timing hooks (to measure what they cost), and the crossover pair.
EXTRA_MODES = ("images", "untimed", "crossover-even", "crossover-odd", "sync-all", "groups-crossover-even",
               "groups-crossover-odd")
DEFAULTS = dict(rounds=3, iters=6, warmup=2, calibration_iters=3, samples=512, seed=0,
                timeout=1800.0, loss_tolerance=1e-5)

#: Megatron's per-iteration log line.
ITER_RE = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                     r".*?\blm loss: ([0-9.Ee+-]+)")
#: The cost-fit line of --mm-balance-cost auto.
FIT_RE = re.compile(r"\[mm-balance\] cost auto: (.*)$", re.M)
#: The tile-balance line of --mm-balance-vision images (megatron/vision.py).
VISION_RE = re.compile(r"\[mm-balance\] vision images: micro-steps \d+-\d+: tiles (\d+), moved (\d+) .*?"
                       r"per micro-step ([0-9.]+) -> ([0-9.]+) \(even split ([0-9.]+)\)", re.M)
#: Telemetry fields read, by meaning (a renamed field is looked up under each name).
FIELDS = {"consumer_wait_ms": ("consumer_wait_ms",), "exchange_ms": ("exchange_ms",),
          "exchange_cpu_ms": ("exchange_cpu_ms",), "packs_moved": ("packs_moved",)}


class BenchError(RuntimeError):
    """The benchmark cannot run or a run failed: one line for the user."""


def free_port() -> int:
    from .runtime import free_port as _fp
    return _fp()


@dataclass
class RunResult:
    mode: str
    round: int
    rc: int
    wall_s: float
    out_dir: str
    elapsed_ms: Dict[int, float] = field(default_factory=dict)
    losses: Dict[int, float] = field(default_factory=dict)
    telemetry: Dict[int, dict] = field(default_factory=dict)
    fit_line: str = ""
    #: --mm-balance-vision images: per log window (tiles, moved, max before, max after, even)
    vision: List[tuple] = field(default_factory=list)

    @property
    def timing_dir(self) -> str:
        return os.path.join(self.out_dir, "timing")


def parse_log(text: str, *, first_two_averaged: bool = True):
    """(elapsed ms per iteration, lm loss per iteration, telemetry per iteration, fit line).

    Megatron does not reset its accumulators after a job's first iteration, so its second
    line prints the mean of the first two iterations; that iteration's own loss is
    ``2 * printed - first`` (its elapsed time stays the mean: warm-up drops it).
    Megatron-Bridge resets them at every line (``first_two_averaged=False``): each line is
    its iteration's own loss and time."""
    from ..runtime.log_line import read_lines
    elapsed, losses = {}, {}
    for m in ITER_RE.finditer(text):
        elapsed[int(m.group(1))] = float(m.group(2))
        losses[int(m.group(1))] = float(m.group(3))
    its = sorted(losses)
    if first_two_averaged and len(its) >= 2 and its[1] == its[0] + 1:
        losses[its[1]] = 2 * losses[its[1]] - losses[its[0]]
    tele = {it: fields for it, chunk, fields in read_lines(text) if chunk == 0}
    fit = FIT_RE.findall(text)
    return elapsed, losses, tele, (fit[-1] if fit else "")


def _field(rec: dict, meaning: str) -> Optional[float]:
    for name in FIELDS[meaning]:
        if name in rec:
            return rec[name]
    return None


def mode_flags(mode: str, calibration_iters: int) -> tuple:
    """(MM_BALANCE, extra Megatron flags) of a mode."""
    if mode in ("off", "untimed"):
        return "0", []
    if mode == "sync":
        return "1", ["--no-mm-balance-overlap"]
    if mode == "overlap":
        return "1", []
    if mode == "images":
        return "1", ["--mm-balance-vision", "images"]
    if mode == "auto":
        return "1", ["--mm-balance-cost", "auto", "--mm-balance-calibration-iters", str(calibration_iters)]
    if mode in ("crossover-even", "crossover-odd", "groups-crossover-even", "groups-crossover-odd"):
        return "1", ["--no-mm-balance-overlap", "--mm-balance-mode", mode]
    if mode == "sync-all":
        return "1", ["--no-mm-balance-overlap", "--mm-balance-sync", "microstep"]
    raise BenchError(f"unknown mode {mode!r} (choose from {', '.join(MODES + EXTRA_MODES)})")


# -- frameworks ---------------------------------------------------------------------------

#: What ``--host`` sets in the ranks' environment (both frameworks' harnesses read it,
#: ``testing/host_side.py``). ``gpu-node`` (Bridge's default) runs the host side as a GPU node
#: does, where it is not on the training loop's cores: the train loader's micro-batches drawn
#: before the first iteration (on 2 cores the data workers otherwise take the cores the ranks
#: compute on, more of them the less the ranks wait for each other), and glibc's allocator
#: keeping the memory it frees (no mmap per large tensor, no trimming), as CUDA's caching
#: allocator keeps its blocks: without it
#: every large activation is mapped, faulted in page by page and unmapped again, which on
#: this job cost about a third of each iteration; and that allocator's pool warm from the
#: start (3 GiB of each rank's heap faulted in at setup, above the job's peak): without it a
#: rank that meets a larger frame than any before stalls for hundreds of milliseconds while
#: its heap grows. ``shared``: the harness as it runs by default (data workers and ranks
#: share the cores; glibc's defaults).
HOST_ENV = {
    "gpu-node": {"MM_BALANCE_CPU_PREDRAW": "all", "MALLOC_MMAP_MAX_": "0",
                 "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MM_BALANCE_CPU_HEAP_MB": "3072"},
    "shared": {},
}


@dataclass
class MegatronLMFramework:
    """Megatron-LM's examples/multimodal through ``scripts/pretrain_vlm_moe.sh``."""

    megatron_lm: Optional[str] = None
    calibration_iters: int = DEFAULTS["calibration_iters"]
    #: the ranks' host side (``--host``, :data:`HOST_ENV`); ``shared`` by default, as this
    #: bench's published figures ran
    host: str = "shared"
    name: ClassVar[str] = "megatron-lm"
    launcher: ClassVar[Path] = LAUNCHER
    config: ClassVar[Path] = CONFIG
    #: the log's second line is the mean of a job's first two iterations
    first_two_averaged: ClassVar[bool] = True
    #: a record's images are whole images (tiles of one size): the cost unit is the image
    frames: ClassVar[bool] = False
    #: the simulator's strategies and the modes they stand for
    simulated: ClassVar[Dict[str, str]] = {"none": "off", "redistribute-sync": "sync",
                                           "redistribute-overlap": "overlap"}
    defaults: ClassVar[dict] = {}
    #: the bench's options left unset take these
    bench_defaults: ClassVar[dict] = DEFAULTS

    @classmethod
    def from_args(cls, a) -> "MegatronLMFramework":
        return cls(megatron_lm=a.megatron_lm or os.environ.get("MEGATRON_LM_DIR"),
                   calibration_iters=a.calibration_iters, host=getattr(a, "host", None) or cls.host)

    def all_modes(self) -> tuple:
        return MODES + EXTRA_MODES

    def default_modes(self) -> tuple:
        return MODES

    def check(self) -> None:
        if not self.megatron_lm:
            raise BenchError("set --megatron-lm (or MEGATRON_LM_DIR) to a Megatron-LM checkout with our patches")
        if not (Path(self.megatron_lm) / "examples" / "multimodal" / "train.py").is_file():
            raise BenchError(f"{self.megatron_lm}: no examples/multimodal/train.py")
        if self.host not in HOST_ENV:
            raise BenchError(f"--host must be one of {', '.join(HOST_ENV)}, got {self.host!r}")

    def environment(self) -> dict:
        """The launcher's tree variable, as an absolute path (the launcher runs elsewhere), and
        the host side's settings of ``--host`` (:data:`HOST_ENV`)."""
        return {**HOST_ENV[self.host], "MEGATRON_LM_DIR": os.path.abspath(self.megatron_lm)}

    def mode_args(self, mode: str) -> tuple:
        return mode_flags(mode, self.calibration_iters)

    def timing_args(self, directory: Path) -> list:
        return ["--mm-balance-timing-dir", str(directory)]

    def make_data(self, out: Path, samples: int, seed: int) -> dict:
        return make_data(out, samples, seed)

    def auto_switch(self) -> int:
        return self.calibration_iters + 2


#: Frameworks by name (``name`` attribute); Megatron-LM's is this module's, Megatron-Bridge's
#: registers itself from :mod:`megatron_mm_balance.bridge.bench` (the CLI loads it).
FRAMEWORKS: Dict[str, type] = {}


def register_framework(cls: type) -> type:
    """Add a framework class (its ``name``, ``from_args(a)`` and the members of
    :class:`MegatronLMFramework`)."""
    FRAMEWORKS[cls.name] = cls
    return cls


register_framework(MegatronLMFramework)


def run_launcher(mode: str, rnd: int, *, data: dict, out: Path, train_iters: int, env_overrides: dict,
                 timeout: float, python: str, megatron_lm: Optional[str] = None, calibration_iters: int = 3,
                 config: Optional[Path] = None, framework=None, name: Optional[str] = None,
                 log=lambda m: print(m, flush=True)) -> RunResult:
    """One launcher run, as a user runs it; its whole process group is killed at ``timeout``.
    ``framework``: :class:`MegatronLMFramework` (default, from ``megatron_lm``) or
    ``BridgeFramework`` (bridge/bench.py); ``name``: the run's directory under ``out`` (``roundR-MODE``)."""
    fw = framework or MegatronLMFramework(megatron_lm=megatron_lm, calibration_iters=calibration_iters)
    run_dir = out / (name or f"round{rnd}-{mode}")
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    balance, extra = fw.mode_args(mode)
    env = dict(os.environ)
    env.update(fw.defaults)
    env.update(fw.environment())
    env.update(data)
    env.update(MM_BALANCE=balance, OUTPUT_DIR=str(run_dir), TRAIN_ITERS=str(train_iters), LOG_INTERVAL="1",
               PYTHON=python, MASTER_PORT=str(free_port()),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.update(env_overrides)
    timing = [] if mode == "untimed" else fw.timing_args(run_dir / "timing")
    cmd = ["bash", str(fw.launcher), "--config", str(config or fw.config), *timing, *extra]
    log_path = run_dir / "train.log"
    t0 = time.monotonic()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=str(REPO),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = -9
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)      # no rank outlives its launcher
            except ProcessLookupError:
                pass
            proc.wait()
    wall = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    elapsed, losses, tele, fit = parse_log(text, first_two_averaged=fw.first_two_averaged)
    res = RunResult(mode, rnd, rc, wall, str(run_dir), elapsed, losses, tele, fit, parse_vision(text))
    med = statistics.median([elapsed[i] for i in sorted(elapsed)[2:]]) if len(elapsed) > 2 else float("nan")
    log(f"  {run_dir.name:<16} exit {rc}, {wall:6.0f} s wall, median iteration {med:8.1f} ms"
        + (f"  [{fit[:90]}]" if fit else ""))
    if rc != 0:
        tail = "\n".join(text.splitlines()[-30:])
        raise BenchError(f"{run_dir.name}: the launcher exited {rc} (log {log_path}):\n{tail}")
    return res


def make_data(out: Path, samples: int, seed: int) -> dict:
    """``mm-balance make-dataset OUT --mix vision-heavy`` (skipped when OUT already has it)."""
    from ..data.make_dataset import make_dataset
    if not (out / "dataset.yaml").is_file():
        make_dataset(out, samples=samples, seed=seed, mix="vision-heavy")
    return {"DATA_PATH": str(out / "dataset.yaml"), "TOKENIZER_MODEL": str(out / "tokenizer")}


# -- analysis ---------------------------------------------------------------------------

def _stats(values: List[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def parse_vision(text: str) -> List[tuple]:
    """The ``--mm-balance-vision images`` log windows: (tiles, moved, most tiles on one rank
    per micro-step before, after, even split)."""
    return [(int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4)), float(m.group(5)))
            for m in VISION_RE.finditer(text)]


def measured_window(res: RunResult, warmup: int, switch: Optional[int] = None) -> List[int]:
    """The iterations a run's speed is read from: after the warm-up (and, for ``auto``, from
    the iteration its fitted costs take effect)."""
    first = max(warmup + 1, switch or 0)
    return [i for i in sorted(res.elapsed_ms) if i >= first]


#: The placement objective on the off runs' measured packs (ms per iteration, :func:`reachable`):
#: as laid out, by the image-token, the FLOP-cost and the measured-time placements, the floor of
#: whole packs, the frames spread after the image-token and after the heaviest-frame placements
#: (``vision=images``), the floor of whole frames, and perfect balance.
REACHABLE = ("unbalanced", "image_tokens", "flop_cost", "measured", "floor_packs",
             "frames_after_image_tokens", "frames_after_heaviest_frame", "floor_frames", "perfect")


def reachable(trace, timing_dir: str) -> dict:
    """Per iteration (ms) of a Qwen-VL ``off`` run's measured packs, the objective a placement
    decides (:func:`~megatron_mm_balance.sim.run_trace.objective_ms`: each micro-step's vision
    maximum plus its language maximum): as the run laid them out; by the placement on image
    tokens (``mm_balance.cost=image-tokens``), on the FLOP-derived cost the run wrote beside
    its records (:data:`~megatron_mm_balance.cost.replay.FLOPS_MODEL_FILE`,
    ``mm_balance.cost=model``) and on the packs' measured times (a cost that knew them); the
    floors no placement of whole packs, or of whole frames, goes below (frames weighed by
    that cost); the least the frame exchange (``vision=images``) can reach after the packs'
    placement on image tokens, and after their placement on the heaviest frame
    (``image_pack_cost=heaviest-frame``); and perfect balance. Empty where the run wrote no
    such cost."""
    from ..cost.model import load_cost_file
    from ..cost.replay import FLOPS_MODEL_FILE
    from ..sim.run_trace import (frame_ms_of, frames_objective_ms, heaviest_frame_costs, measured_costs,
                                 model_costs, objective_ms, placement_order, predicted_floors)
    path = os.path.join(timing_dir, FLOPS_MODEL_FILE)
    if not os.path.isfile(path):
        return {}
    model = load_cost_file(path)
    frame_ms = frame_ms_of(model)
    floors = predicted_floors(trace, frame_ms)
    by_heaviest = placement_order(trace, costs=heaviest_frame_costs(trace, frame_ms))
    return {"unbalanced": objective_ms(trace), "image_tokens": objective_ms(trace, placement_order(trace)),
            "flop_cost": objective_ms(trace, placement_order(trace, costs=model_costs(trace, model))),
            "measured": objective_ms(trace, placement_order(trace, costs=measured_costs(trace))),
            "floor_packs": floors["floor_packs_ms"],
            "frames_after_image_tokens": frames_objective_ms(trace, frame_ms, placement_order(trace)),
            "frames_after_heaviest_frame": frames_objective_ms(trace, frame_ms, by_heaviest),
            "floor_frames": floors["floor_frames_ms"],
            "perfect": floors["perfect_ms"]}


def objective_gains(objective: Optional[dict]) -> dict:
    """``objective``: :func:`reachable`'s figures (mean ms per iteration) -> the report's
    ``objective`` entry: each figure, its gain over the unbalanced layout, and its share of
    perfect balance's gain."""
    if not objective:
        return {}
    base, perfect = objective["unbalanced"], objective["perfect"]
    best = base / perfect - 1.0
    return {"objective": {key: {"ms": objective[key], "gain": base / objective[key] - 1.0,
                                "share_of_perfect": (base / objective[key] - 1.0) / best if best > 0 else None}
                          for key in REACHABLE}}


def analyze(results: List[RunResult], *, warmup: int, loss_tolerance: float,
            auto_switch: Optional[int] = None, frames: bool = False) -> dict:
    """Everything the table and ``--json`` report (see the module docstring). ``frames``:
    read the timing records' images as frames (Qwen-VL grids, :func:`~megatron_mm_balance.
    sim.run_trace.frames_view`)."""
    from ..sim.run_trace import load_run, placement_order, predicted_times, time_breakdown, vision_share
    by_mode: Dict[str, List[RunResult]] = {}
    for r in results:
        by_mode.setdefault(r.mode, []).append(r)
    report = {"modes": {}, "losses": [], "predicted": {}, "simulated": {}}
    off_by_round = {r.round: r for r in by_mode.get("off", [])}

    for mode, runs in by_mode.items():
        its, waits, exch, cpu, moved = [], [], [], [], []
        for r in runs:
            window = measured_window(r, warmup, auto_switch if mode == "auto" else None)
            its += [r.elapsed_ms[i] for i in window]
            for i in window:
                t = r.telemetry.get(i)
                if t is None:
                    continue
                for acc, key in ((waits, "consumer_wait_ms"), (exch, "exchange_ms"),
                                 (cpu, "exchange_cpu_ms"), (moved, "packs_moved")):
                    v = _field(t, key)
                    if v is not None:
                        acc.append(v)
        report["modes"][mode] = {
            "iteration_ms": _stats(its), "iterations": its,
            "consumer_wait_ms_per_iteration": _stats(waits), "exchange_ms_per_iteration": _stats(exch),
            "exchange_cpu_ms_per_iteration": _stats(cpu), "packs_moved_per_iteration": _stats(moved),
            "runs": [{"round": r.round, "wall_s": r.wall_s, "out_dir": r.out_dir,
                      "elapsed_ms": r.elapsed_ms, "fit": r.fit_line} for r in runs]}
        windows = [w for r in runs for w in r.vision]
        if windows:
            report["modes"][mode]["tiles"] = {
                "moved_fraction": sum(w[1] for w in windows) / max(1, sum(w[0] for w in windows)),
                "max_per_microstep_before": statistics.mean(w[2] for w in windows),
                "max_per_microstep_after": statistics.mean(w[3] for w in windows),
                "even_split": statistics.mean(w[4] for w in windows)}
        if mode != "off":
            for r in runs:
                off = off_by_round.get(r.round)
                if off is None:
                    continue
                common = sorted(set(off.losses) & set(r.losses))
                diff = max((abs(r.losses[i] - off.losses[i]) / max(abs(off.losses[i]), 1e-12)
                            for i in common), default=float("nan"))
                report["losses"].append({"mode": mode, "round": r.round, "iterations": len(common),
                                         "max_rel_diff": diff,
                                         "equal": bool(common) and diff <= loss_tolerance})
    off_ms = report["modes"].get("off", {}).get("iteration_ms", {}).get("median")
    for mode, m in report["modes"].items():
        med = m["iteration_ms"]["median"]
        m["gain_vs_off"] = (off_ms / med - 1.0) if off_ms and med else None

    # Predicted from the per-pack timings.
    pred = {}
    for mode, runs in by_mode.items():
        laid, perfect, span, shares, placed, parts = [], [], [], [], [], []
        reach = {}
        for r in runs:
            switch = auto_switch if mode == "auto" else None
            try:
                trace = load_run(r.timing_dir, skip_iterations=warmup, frames=frames)
            except ValueError:
                continue
            keep = [k for k, it in enumerate(trace.iterations) if it >= (switch or 0)]
            if not keep:
                continue
            p = predicted_times(trace)
            laid += [float(p["laid_out_ms"][k]) for k in keep]
            perfect += [float(p["perfect_ms"][k]) for k in keep]
            span += [float(p["measured_span_ms"][k]) for k in keep]
            shares.append(vision_share(trace))
            parts.append(time_breakdown(trace))
            if mode == "off":        # the same measured packs, laid out by the runtime's placement
                q = predicted_times(trace, order=placement_order(trace))
                placed += [float(q["laid_out_ms"][k]) for k in keep]
                if frames:
                    for key, values in reachable(trace, r.timing_dir).items():
                        reach.setdefault(key, []).extend(float(values[k]) for k in keep)
        if laid:
            pred[mode] = {"laid_out_ms": statistics.median(laid), "perfect_ms": statistics.median(perfect),
                          "timed_span_ms": statistics.median(span),
                          "vision_share": statistics.median(shares),
                          "where_the_time_goes_ms": {k: statistics.mean(x[k] for x in parts if k in x)
                                                     for k in parts[0]}}
            if placed:
                pred[mode]["placed_ms"] = statistics.median(placed)
            if reach:
                pred[mode]["objective_ms"] = {key: statistics.mean(v) for key, v in reach.items()}
    if "off" in pred:
        off_p = pred["off"]["laid_out_ms"]
        report["predicted"] = {
            "unbalanced_ms": off_p, "perfect_ms": pred["off"]["perfect_ms"],
            "perfect_gain": off_p / pred["off"]["perfect_ms"] - 1.0,
            "placement_ms": pred["off"].get("placed_ms"),
            "placement_gain": (off_p / pred["off"]["placed_ms"] - 1.0) if pred["off"].get("placed_ms") else None,
            "vision_share_at_mean_pack": pred["off"]["vision_share"],
            **objective_gains(pred["off"].get("objective_ms")),
            **{f"{mode}_placement_ms": v["laid_out_ms"] for mode, v in pred.items() if mode != "off"},
            **{f"{mode}_placement_gain": off_p / v["laid_out_ms"] - 1.0 for mode, v in pred.items()
               if mode != "off"},
            "per_mode": pred}
    return report


def simulate_against(results: List[RunResult], report: dict, *, warmup: int, frames: bool = False,
                     simulated: Optional[Dict[str, str]] = None) -> dict:
    """The simulator on each round's ``off`` layout, with a timing model fitted from that
    run's timings, and the synchronous exchange's costs measured on the ``sync`` runs
    against the ``off`` runs: the longer iteration tail (the first ``next()`` of a global
    batch pulls it, all-gathers and solves) per batch, and the longer host gaps between
    micro-batches spread over the micro-steps whose packs move. ``simulated``: the
    simulator's strategies and the modes they are compared with (default Megatron-LM's:
    ``none`` off, ``redistribute-sync`` sync, ``redistribute-overlap`` overlap)."""
    from ..sim.run_trace import fit_timing_model, load_run, placement_order, simulate_layout
    per_mode = report.get("predicted", {}).get("per_mode", {})

    def part(mode, key):
        return per_mode.get(mode, {}).get("where_the_time_goes_ms", {}).get(key)

    sync_batch = latency = None
    if part("sync", "tail_ms") is not None and part("off", "tail_ms") is not None:
        sync_batch = max(0.0, part("sync", "tail_ms") - part("off", "tail_ms"))
        extra_gaps = max(0.0, part("sync", "host_gap_ms") - part("off", "host_gap_ms"))
    names = simulated or MegatronLMFramework.simulated
    sims = {strategy: [] for strategy in names}
    fits = []
    for r in results:
        if r.mode != "off":
            continue
        trace = load_run(r.timing_dir, skip_iterations=warmup, frames=frames)
        if sync_batch is not None:
            order = placement_order(trace)
            home = np.arange(trace.shape[1])[None, :, None] * trace.shape[2]
            moved_steps = float(((order // trace.shape[2]) != home // trace.shape[2]).any(axis=1).sum(axis=1).mean())
            latency = extra_gaps / max(moved_steps, 1.0)
        t, fit = fit_timing_model(trace, exchange_latency_ms=latency or 0.0, sync_batch_ms=sync_batch or 0.0)
        fits.append(fit)
        for run in simulate_layout(trace, t, strategies=tuple(sims)):
            sims[run["strategy"]].append(run["time_per_batch_ms"])
    if not fits:
        return {}
    out = {"timing_fit": fits, "exchange_latency_ms": latency, "sync_batch_ms": sync_batch}
    off_meas = report["modes"].get("off", {}).get("iteration_ms", {}).get("median")
    off_sim = statistics.median(sims["none"]) if sims["none"] else None
    for strat, mode in names.items():
        if not sims[strat]:
            continue
        sim_ms = statistics.median(sims[strat])
        meas = report["modes"].get(mode, {}).get("iteration_ms", {}).get("median")
        out[mode] = {"simulated_ms": sim_ms, "measured_ms": meas,
                     "rel_error": (sim_ms / meas - 1.0) if meas else None,
                     "simulated_gain": (off_sim / sim_ms - 1.0) if off_sim else None,
                     "measured_gain": (off_meas / meas - 1.0) if off_meas and meas else None}
    return out


#: :data:`REACHABLE`'s figures as the table names them
OBJECTIVE_LABELS = (("unbalanced", "unbalanced"), ("image_tokens", "image tokens"), ("flop_cost", "FLOP cost"),
                    ("measured", "measured times"), ("floor_packs", "floor of whole packs"),
                    ("frames_after_image_tokens", "frames after image tokens"),
                    ("frames_after_heaviest_frame", "frames after heaviest frame"),
                    ("floor_frames", "floor of whole frames"), ("perfect", "perfect"))


def _objective_figure(label: str, v: dict) -> str:
    """``label ms (+gain%, share of perfect)``; the unbalanced layout without the gain,
    perfect balance without the share."""
    if label == "unbalanced":
        return f"{label} {v['ms']:.0f}"
    share = "" if v["share_of_perfect"] is None or label == "perfect" else f", {v['share_of_perfect']:.0%}"
    return f"{label} {v['ms']:.0f} ({100 * v['gain']:+.1f}%{share})"


def format_report(rep: dict) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    lines = ["", "mode      iteration ms: median [min-max] (n)   gain vs off   consumer wait   exchange   "
                 "exchange-thread CPU   packs moved   (ms per iteration)"]
    for mode, m in rep["modes"].items():
        it = m["iteration_ms"]
        lines.append(
            f"{mode:<8} {f(it['median']):>10} [{f(it['min'])}-{f(it['max'])}] ({it['n']:>2})"
            f"   {f(None if m['gain_vs_off'] is None else 100 * m['gain_vs_off'], '+.1f'):>7}%"
            f"   {f(m['consumer_wait_ms_per_iteration']['median']):>12}"
            f"   {f(m['exchange_ms_per_iteration']['median']):>8}"
            f"   {f(m['exchange_cpu_ms_per_iteration']['median']):>18}"
            f"   {f(m['packs_moved_per_iteration']['median'], '.0f'):>11}")
    for mode, m in rep["modes"].items():
        t = m.get("tiles")
        if t:
            lines.append(f"{mode}: tiles moved {100 * t['moved_fraction']:.1f}%, most tiles on one rank per "
                         f"micro-step {t['max_per_microstep_before']:.2f} -> {t['max_per_microstep_after']:.2f} "
                         f"(even split {t['even_split']:.2f})")
    p = rep.get("predicted") or {}
    if p:
        lines.append("")
        lines.append(f"predicted from the off runs' per-pack timings (ms per iteration): unbalanced "
                     f"{p['unbalanced_ms']:.0f}, our placement {f(p['placement_ms'], '.0f')} "
                     f"({f(None if p['placement_gain'] is None else 100 * p['placement_gain'], '+.1f')}%), "
                     f"perfect balance {p['perfect_ms']:.0f} ({100 * p['perfect_gain']:+.1f}%); vision share "
                     f"of a micro-batch at the mean pack {100 * p['vision_share_at_mean_pack']:.0f}%")
        if p.get("objective"):
            o = p["objective"]
            lines.append("  the placement objective on the same packs (each micro-step's vision and language maxima, "
                         "ms per iteration; share of perfect balance's gain):")
            lines.append("    " + ", ".join(_objective_figure(label, o[key]) for key, label in OBJECTIVE_LABELS))
        lines.append("  each mode's own timings laid out as it ran: "
                     + ", ".join(f"{k[:-len('_placement_ms')]} {v:.0f}" for k, v in p.items()
                                 if k.endswith("_placement_ms")))
        lines.append("where the time goes (ms per iteration and rank; vision per 1k image tokens):")
        lines.append(f"  {'mode':<8} {'vision':>8} {'per 1k':>7} {'LM compute':>10} {'waiting':>8} "
                     f"{'host gaps':>9} {'tail':>6}")
        for mode, v in p["per_mode"].items():
            w = v["where_the_time_goes_ms"]
            lines.append(f"  {mode:<8} {w['vision_ms']:>8.0f} {w['vision_ms_per_1k_image_tokens']:>7.0f} "
                         f"{w['lm_compute_ms']:>10.0f} {w['waiting_ms']:>8.0f} {w['host_gap_ms']:>9.0f} "
                         f"{w['tail_ms']:>6.0f}")
        split = [(mode, v["where_the_time_goes_ms"]) for mode, v in p["per_mode"].items()
                 if "exchange_ms" in v["where_the_time_goes_ms"]]
        if split:
            lines.append("the image-level exchange's share of the vision forward (ms per iteration and rank; "
                         "host clock):")
            lines.append(f"  {'mode':<8} {'exchange':>8} {'gathers':>8} {'plan':>6} {'tower':>7} {'rest':>6} "
                         f"{'tower calls per micro-batch':>28}")
            for mode, w in split:
                lines.append(f"  {mode:<8} {w['exchange_ms']:>8.0f} {w['exchange_gather_ms']:>8.0f} "
                             f"{w['exchange_plan_ms']:>6.1f} {w['exchange_tower_ms']:>7.0f} "
                             f"{w['exchange_rest_ms']:>6.0f} {w['tower_calls_per_microbatch']:>28.2f}")
    s = rep.get("simulated") or {}
    if s:
        lines.append("simulated (mm-balance simulate OFF_RUN/timing --timing run) vs measured:")
        for mode in [m for m in s if isinstance(s[m], dict) and "simulated_ms" in s[m]]:
            if mode in s:
                v = s[mode]
                lines.append(f"  {mode:<8} simulated {v['simulated_ms']:.0f} ms, measured {f(v['measured_ms'], '.0f')} ms "
                             f"({f(None if v['rel_error'] is None else 100 * v['rel_error'], '+.1f')}%); gain "
                             f"simulated {f(None if v['simulated_gain'] is None else 100 * v['simulated_gain'], '+.1f')}%, "
                             f"measured {f(None if v['measured_gain'] is None else 100 * v['measured_gain'], '+.1f')}%")
    h = rep.get("holdout") or {}
    if any(isinstance(v, dict) and "simulated_ms" in v for v in h.values()):
        lines.append(f"hold-out data set (seed {h.get('seed')}): the timing model fitted on the main off runs' "
                     f"per-pack timings, on the hold-out off run's global batches, vs measured:")
        for mode, v in h.items():
            if isinstance(v, dict) and "simulated_ms" in v:
                lines.append(f"  {mode:<8} simulated {v['simulated_ms']:.0f} ms ({v['strategy']}), measured "
                             f"{f(v['measured_ms'], '.0f')} ms ({v['iterations']} iterations): "
                             f"{f(None if v['rel_error'] is None else 100 * v['rel_error'], '+.1f')}%")
    elif h.get("error"):
        lines.append(f"hold-out prediction: {h['error']}")
    if rep.get("losses"):
        worst = max(x["max_rel_diff"] for x in rep["losses"])
        ok = all(x["equal"] for x in rep["losses"])
        lines.append(f"losses equal off vs on in every run: {'yes' if ok else 'NO'} (max relative "
                     f"difference {worst:.2e} over {len(rep['losses'])} runs)")
    return "\n".join(lines)


def predict_holdout(main: List[RunResult], holdout: List[RunResult], *, warmup: int, frames: bool,
                    simulated: Dict[str, str]) -> dict:
    """The simulator's timing model fitted on each main ``off`` run's per-pack timings
    (:func:`~megatron_mm_balance.sim.run_trace.fit_timing_model`), run on the hold-out
    ``off`` run's own global batches (another data seed): ``none`` against the hold-out
    ``off`` run's measured median iteration time, the balanced strategy against the
    hold-out balanced run's (both read the same global batches). Medians over the fits."""
    from ..sim.run_trace import fit_timing_model, load_run, simulate_layout
    off_b = [r for r in holdout if r.mode == "off"]
    if not off_b:
        return {}
    trace_b = load_run(off_b[0].timing_dir, skip_iterations=warmup, frames=frames)
    sims: Dict[str, List[float]] = {k: [] for k in simulated}
    fitted_on = []
    for r in main:
        if r.mode != "off":
            continue
        t, _ = fit_timing_model(load_run(r.timing_dir, skip_iterations=warmup, frames=frames))
        fitted_on.append(r.out_dir)
        for run in simulate_layout(trace_b, t, strategies=tuple(simulated)):
            sims[run["strategy"]].append(run["time_per_batch_ms"])
    out = {"fitted_on": fitted_on, "predicted_run": off_b[0].out_dir}
    for strategy, mode in simulated.items():
        runs = [r for r in holdout if r.mode == mode]
        if not runs or not sims[strategy]:
            continue
        its = [r.elapsed_ms[i] for r in runs for i in measured_window(r, warmup)]
        meas = statistics.median(its) if its else None
        pred = statistics.median(sims[strategy])
        out[mode] = {"strategy": strategy, "simulated_ms": pred, "measured_ms": meas,
                     "rel_error": (pred / meas - 1.0) if meas else None, "iterations": len(its)}
    return out


def framework_of(a):
    """The framework the arguments ask for (``--bridge``: Megatron-Bridge; else Megatron-LM)."""
    name = "bridge" if getattr(a, "bridge", None) is not None else MegatronLMFramework.name
    if name not in FRAMEWORKS:
        raise BenchError(f"no {name} support loaded (import megatron_mm_balance.bridge.bench, as "
                         f"mm-balance does)")
    return FRAMEWORKS[name].from_args(a)


def resolve_defaults(a, fw) -> None:
    """Fill the options left unset with the framework's defaults (in place)."""
    d = fw.bench_defaults
    for key in ("rounds", "iters", "warmup", "samples", "seed"):
        if getattr(a, key) is None:
            setattr(a, key, d[key])
    if a.config is None:
        a.config = str(fw.config)
    if a.python is None:
        a.python = fw.python() if hasattr(fw, "python") else sys.executable


def run_bench(a) -> dict:
    fw = framework_of(a)
    resolve_defaults(a, fw)
    fw.check()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()] if a.modes else list(fw.default_modes())
    for m in modes:
        if m not in fw.all_modes():
            raise BenchError(f"--modes: unknown mode {m!r} (choose from {', '.join(fw.all_modes())})")
        fw.mode_args(m)                              # refuses a mode this installation cannot run
    if "off" not in modes:
        raise BenchError("--modes must include off (gains and losses are measured against it)")
    if a.rounds < 1 or a.iters < 1 or a.warmup < 2:
        raise BenchError("--rounds and --iters must be >= 1 and --warmup >= 2 (the first iterations carry "
                         "start-up costs; Megatron averages a job's first two into its second log line)")
    balanced = [m for m in modes if m not in ("off", "untimed")]
    if a.holdout_rounds < 1:
        raise BenchError(f"--holdout-rounds must be >= 1 (got {a.holdout_rounds})")
    if a.holdout_seed is not None and a.holdout_seed == a.seed:
        raise BenchError(f"--holdout-seed {a.holdout_seed}: must differ from --seed (a data set the timing "
                         f"model was not fitted on)")
    overrides = {}
    for kv in a.set or []:
        if "=" not in kv:
            raise BenchError(f"--set {kv!r}: expected VAR=VALUE")
        k, v = kv.split("=", 1)
        overrides[k] = v
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    data = fw.make_data(Path(a.data).absolute() if a.data else out / "data", a.samples, a.seed)
    train_iters = a.warmup + a.iters
    if "auto" in modes and a.calibration_iters + 2 > train_iters:
        raise BenchError(f"--calibration-iters {a.calibration_iters}: the fit takes effect at iteration "
                         f"{a.calibration_iters + 2}, after the last ({train_iters}); lower it or raise --iters")
    print(f"bench-realpath ({fw.name}): {a.rounds} rounds x {', '.join(modes)}, {train_iters} iterations per run "
          f"(first {a.warmup} dropped), config {a.config}"
          + (f"; {a.holdout_rounds} hold-out round(s) on seed {a.holdout_seed}: off, {balanced[0]}"
             if a.holdout_seed is not None
             and balanced else "") + f"; host {fw.host}; {_uptime()}", flush=True)
    t0 = time.monotonic()
    run = dict(out=out, train_iters=train_iters, env_overrides=overrides, timeout=a.timeout, python=a.python,
               config=Path(a.config), framework=fw)
    results, holdout = [], []
    hdata = (fw.make_data(out / f"data-seed{a.holdout_seed}", a.samples, a.holdout_seed)
             if a.holdout_seed is not None and balanced else None)
    for rnd in range(1, max(a.rounds, a.holdout_rounds if hdata else 0) + 1):
        if rnd <= a.rounds:
            for mode in (modes if rnd % 2 else modes[::-1]):
                results.append(run_launcher(mode, rnd, data=data, **run))
        if hdata is not None and rnd <= a.holdout_rounds:
            for mode in (("off", balanced[0]) if rnd % 2 else (balanced[0], "off")):
                holdout.append(run_launcher(mode, rnd, data=hdata, name=holdout_dir(mode, rnd), **run))
    return report_of(results, a, modes, fw, holdout=holdout, data=data, overrides=overrides,
                     wall_s=time.monotonic() - t0, train_iters=train_iters)


def holdout_dir(mode: str, rnd: int) -> str:
    """A hold-out run's directory: ``holdout-MODE`` for the first round, ``holdoutR-MODE`` after."""
    return f"holdout-{mode}" if rnd == 1 else f"holdout{rnd}-{mode}"


def report_of(results, a, modes, fw, holdout=(), **meta) -> dict:
    """Analysis, simulation and metadata of finished runs (``holdout``: the hold-out round's)."""
    # --mm-balance-cost auto decides at iteration K + 2 (cost/calibration.py): its speed is read
    # from there on, whether the fit was accepted or refused.
    rep = analyze(results, warmup=a.warmup, loss_tolerance=a.loss_tolerance, auto_switch=fw.auto_switch(),
                  frames=fw.frames)
    try:
        rep["simulated"] = simulate_against(results, rep, warmup=a.warmup, frames=fw.frames,
                                            simulated=fw.simulated)
    except ValueError as exc:
        rep["simulated"] = {"error": str(exc)}
    if holdout:
        balanced = [m for m in modes if m not in ("off", "untimed")]
        try:
            rep["holdout"] = predict_holdout(results, holdout, warmup=a.warmup, frames=fw.frames,
                                             simulated={"none": "off",
                                                        "redistribute-overlap": balanced[0]})
        except ValueError as exc:
            rep["holdout"] = {"error": str(exc)}
        rep["holdout"]["seed"] = a.holdout_seed
        rep["holdout"]["runs"] = [{"mode": r.mode, "out_dir": r.out_dir, "elapsed_ms": r.elapsed_ms}
                                  for r in holdout]
    rep["meta"] = {"framework": fw.name, "rounds": a.rounds, "modes": modes, "warmup": a.warmup,
                   "calibration_iters": a.calibration_iters, "config": str(a.config), "seed": a.seed,
                   "samples": a.samples, "host": fw.host, **meta, "load_after": _uptime()}
    return rep


def _result_of(d: Path, mode: str, rnd: int, fw) -> RunResult:
    text = (d / "train.log").read_text(errors="replace")
    elapsed, losses, tele, fit = parse_log(text, first_two_averaged=fw.first_two_averaged)
    return RunResult(mode, rnd, 0, 0.0, str(d), elapsed, losses, tele, fit, parse_vision(text))


def reanalyze(a) -> dict:
    """``--reanalyze``: the report of the runs already in ``--out`` (``roundR-MODE/``, and the
    hold-out round's ``holdout-MODE/``)."""
    fw = framework_of(a)
    resolve_defaults(a, fw)
    out = Path(a.out)
    results, holdout = [], []
    for d in sorted(out.glob("round*-*")):
        m = re.fullmatch(r"round(\d+)-(.+)", d.name)
        if m and (d / "train.log").is_file():
            results.append(_result_of(d, m.group(2), int(m.group(1)), fw))
    for d in sorted(out.glob("holdout*-*")):
        m = re.fullmatch(r"holdout(\d*)-(.+)", d.name)
        if m and (d / "train.log").is_file():
            holdout.append(_result_of(d, m.group(2), int(m.group(1) or 1), fw))
    if not results:
        raise BenchError(f"--reanalyze: no roundN-MODE/train.log under {out}")
    order = [m for m in fw.all_modes() if any(r.mode == m for r in results)]
    results.sort(key=lambda r: (order.index(r.mode), r.round))
    holdout.sort(key=lambda r: (r.mode != "off", r.round))
    return report_of(results, a, order, fw, holdout=holdout, reanalyzed=True, runs=len(results),
                     host=host_of_logs(out))


#: the line the CPU harness prints when it drew the batches before the first iteration
PREDRAWN_RE = re.compile(r"drew \d+ micro-batches before the first iteration")


def host_of_logs(out: Path) -> str:
    """``gpu-node`` when the runs under ``out`` drew their batches first (the harness's line
    in ``train.log``), else ``shared``: what ``--reanalyze`` reports, whatever ``--host`` says."""
    logs = sorted(out.glob("round*-*/train.log"))
    drawn = [bool(PREDRAWN_RE.search(p.read_text(errors="replace"))) for p in logs]
    return "gpu-node" if drawn and all(drawn) else "shared"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        return ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megatron-lm", default=None, metavar="DIR",
                   help="patched Megatron-LM checkout (default: $MEGATRON_LM_DIR); with --bridge: the "
                        "Megatron-LM Bridge pins (default: the launcher's choice)")
    p.add_argument("--bridge", nargs="?", const="", default=None, metavar="DIR",
                   help="run on Megatron-Bridge: the patched checkout or installed package DIR (default: "
                        "$MEGATRON_BRIDGE_DIR, else the Bridge that --python imports), the native-res "
                        "config and data")
    p.add_argument("--out", default="runs/bench-realpath", help="runs, logs and timings (default %(default)s)")
    p.add_argument("--data", default=None,
                   help="the data set (default: OUT/data, made when missing: make-dataset --mix vision-heavy, "
                        "with --bridge --format bridge-qwen-vl --mix native-res)")
    p.add_argument("--config", default=None, help=f"launch config (default {CONFIG.relative_to(REPO)}, with "
                                                   f"--bridge configs/bridge/qwen3_vl_moe_native_res_cpu.sh)")
    p.add_argument("--modes", default=None,
                   help=f"modes per round (default {','.join(MODES)}; with --bridge off,packs,model, and "
                        f"images where mm_balance.vision exists)")
    p.add_argument("--cost", default="image-tokens", choices=("image-tokens", "model"),
                   help="--bridge: mm_balance.cost of the packs and images modes (default %(default)s)")
    p.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {DEFAULTS['rounds']})")
    p.add_argument("--iters", type=int, default=None,
                   help=f"measured iterations per run (default {DEFAULTS['iters']}; --bridge 8)")
    p.add_argument("--warmup", type=int, default=None, help="iterations dropped (>= 2; default 2)")
    p.add_argument("--calibration-iters", type=int, default=DEFAULTS["calibration_iters"],
                   help="--mm-balance-calibration-iters of the auto mode (default %(default)s)")
    p.add_argument("--samples", type=int, default=None,
                   help=f"dataset samples (default {DEFAULTS['samples']}; --bridge 256)")
    p.add_argument("--seed", type=int, default=None, help="dataset seed (default 0)")
    p.add_argument("--holdout-seed", type=int, default=None, metavar="SEED",
                   help="also run off and the first balanced mode on a data set of this seed, and predict "
                        "their iteration times with the timing model fitted on the main off runs")
    p.add_argument("--holdout-rounds", type=int, default=1, metavar="N",
                   help="hold-out rounds, each run after the main round of the same number (so the machine's "
                        "drift over the bench reaches both alike); default %(default)s")
    p.add_argument("--host", default=None, choices=("gpu-node", "shared"),
                   help="the ranks' host side; gpu-node (the --bridge default): the batches drawn before the "
                        "first iteration and the allocator keeping what it frees, as on a GPU node; shared "
                        "(the Megatron-LM default): data workers and ranks on the same cores, glibc's "
                        "defaults (docs/notes/2026-12-04-host-side-as-gpu-node.md)")
    p.add_argument("--set", action="append", metavar="VAR=VALUE",
                   help="launcher/config environment override, e.g. GBS=8 (repeatable)")
    p.add_argument("--timeout", type=float, default=DEFAULTS["timeout"], help="seconds per run")
    p.add_argument("--loss-tolerance", type=float, default=DEFAULTS["loss_tolerance"])
    p.add_argument("--python", default=None,
                   help="interpreter for the ranks (default this one; --bridge: .venv-bridge/bin/python "
                        "when it exists)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the whole report as JSON")
    p.add_argument("--reanalyze", action="store_true",
                   help="run nothing: report the runs already in --out")


def cmd(a) -> int:
    try:
        rep = reanalyze(a) if a.reanalyze else run_bench(a)
    except BenchError as exc:
        print(f"mm-balance bench-realpath: {exc}", file=sys.stderr)
        return 1
    print(format_report(rep))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=1, default=str)
    losses_ok = all(x["equal"] for x in rep["losses"])
    return 0 if losses_ok else 3


def register(subparsers) -> None:
    p = subparsers.add_parser("bench-realpath", help="Megatron-LM's (--bridge: Megatron-Bridge's) own iteration "
                              "time, balancing off vs on, real CPU compute (docs/results.md)",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=cmd)
