"""``mm-balance``: pack traces, place global batches, simulate, benchmark, demo, compare logs.

Every bad input ends in one line on stderr (``mm-balance: error: ...``) and a
non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np

from .data import mixtures, packing
from .data.jsonl import json_lines
from .solver import placement
from .data.traces import DEFAULT_TOKENS_PER_TILE, TraceError, load_trace

# Modules that add subcommands through ``register(subparsers)``.
EXTENSIONS = ("megatron_mm_balance.sim.cli", "megatron_mm_balance.timeline.cli",
              "megatron_mm_balance.bench.runtime", "megatron_mm_balance.bench.realpath",
              "megatron_mm_balance.bridge.bench", "megatron_mm_balance.reference")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise CliError(f"{self.prog}: {message}")


# ---------------------------------------------------------------------------
# inputs

def read_samples(trace: str, tokens_per_tile: int):
    """A trace file, or the name of a built-in mixture (see ``mixtures.MIXTURES``)."""
    if not os.path.exists(trace) and trace in mixtures.MIXTURES:
        return mixtures.make_mixture(trace)
    if not os.path.exists(trace):
        raise CliError(f"{trace}: no such file (nor a built-in mixture: {', '.join(mixtures.MIXTURES)})")
    return load_trace(trace, tokens_per_tile=tokens_per_tile)


def read_pack_costs(path: str) -> np.ndarray:
    """Image tokens of every pack in a PACKS.jsonl file, validated line by line."""
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file")
    costs = []
    with open(path, encoding="utf-8") as f:
        for lineno, rec in json_lines(f, path, CliError):
            if not isinstance(rec, dict):
                raise CliError(f"{path}:{lineno}: expected a JSON object")
            if "image_tokens" in rec:
                v = rec["image_tokens"]
            elif "images" in rec:
                v = rec["images"]
                if not isinstance(v, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in v):
                    raise CliError(f"{path}:{lineno}: 'images' must be a list of integers")
                if any(n < 0 for n in v):
                    raise CliError(f"{path}:{lineno}: negative image token count")
                v = sum(v)
            else:
                raise CliError(f"{path}:{lineno}: missing 'image_tokens' (or 'images')")
            if isinstance(v, bool) or not isinstance(v, int):
                raise CliError(f"{path}:{lineno}: 'image_tokens' must be an integer, got {v!r}")
            if v < 0:
                raise CliError(f"{path}:{lineno}: 'image_tokens' must be >= 0, got {v}")
            costs.append(v)
    return np.asarray(costs, dtype=np.int64)


# ---------------------------------------------------------------------------
# pack

def cmd_pack(args) -> int:
    if args.seq_len < 1:
        raise CliError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.buffer < 1:
        raise CliError(f"--buffer must be >= 1, got {args.buffer}")
    if args.packer == "budget" and args.image_budget is None:
        raise CliError("--packer budget needs --image-budget N")
    if args.image_budget is not None and args.image_budget < 0:
        raise CliError(f"--image-budget must be >= 0, got {args.image_budget}")
    samples = read_samples(args.trace, args.tokens_per_tile)
    budget = args.image_budget if args.packer == "budget" else None
    result = packing.pack_greedy(samples, args.seq_len, buffer_size=args.buffer,
                                 image_budget=budget, on_overlong=args.on_overlong)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for p in result.packs:
                f.write(json.dumps(p.to_json()) + "\n")
    report = {"trace": args.trace, "packer": args.packer, "image_budget": budget, **result.report()}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['samples']} samples -> {report['packs']} packs of {args.seq_len} tokens, "
              f"efficiency {report['efficiency']:.4f}, dropped {report['dropped']} overlong; "
              f"image tokens per pack mean {report['image_tokens_per_pack_mean']:.0f}, "
              f"max {report['image_tokens_per_pack_max']}")
    return 0


# ---------------------------------------------------------------------------
# place

def place_batches(costs: np.ndarray, dp: int, ga: int, sync: str, tolerance: float,
                  out=None, ranks_per_node: int | None = None) -> dict:
    """Plan consecutive global batches of ``costs`` (batch b, rank r, index m holds
    pack ``b*dp*ga + r*ga + m``) exactly as the runtime delivers them
    (:func:`placement.plan_placement`: solve, then order the micro-steps) and
    aggregate the metrics; ``--out`` gets each batch's delivered slots."""
    per = dp * ga
    n_batches = len(costs) // per
    from .solver.topology import traffic
    times, metrics, ms_num, base_ms_num, denom, inter = [], [], 0, 0, 0.0, 0
    for b in range(n_batches):
        c = costs[b * per:(b + 1) * per].reshape(dp, ga)
        t0 = time.perf_counter()
        pl = placement.plan_placement(c, sync=sync, balance_tolerance=tolerance,
                                      ranks_per_node=ranks_per_node)
        times.append((time.perf_counter() - t0) * 1000.0)
        st = placement.PlanStats.of(c, pl)
        metrics.append(st.metrics())
        inter += traffic(pl.src_rank, ranks_per_node)["inter_node_packs"]
        # The micro-step ratio aggregates over batches: sum of objectives / sum of ideals.
        ms_num += st.microstep_cost_after
        base_ms_num += st.microstep_cost_before
        denom += st.rank_total_mean
        if out is not None:
            out.write(json.dumps({"batch": b, "slots": pl.slots().tolist()}) + "\n")
    return {
        "dp": dp, "ga": ga, "sync": sync, "balance_tolerance": tolerance,
        "packs": int(len(costs)), "global_batches": n_batches,
        "skipped_packs": int(len(costs) - n_batches * per),
        "solver_ms_p50": float(np.median(times)), "solver_ms_max": float(np.max(times)),
        "moved_fraction": sum(m["moved"] for m in metrics) / (n_batches * per),
        "ranks_per_node": ranks_per_node,
        "inter_node_fraction": inter / (n_batches * per),
        "microstep_ratio": float(ms_num / denom) if denom else 1.0,
        "rank_ratio": max(m["rank_ratio"] for m in metrics),
        "baseline_microstep_ratio": float(base_ms_num / denom) if denom else 1.0,
        "baseline_rank_ratio": max(m["baseline_rank_ratio"] for m in metrics),
        "microstep_vs_optimum_max": max(m["microstep_vs_optimum"] for m in metrics),
    }


def cmd_place(args) -> int:
    if args.dp < 1 or args.ga < 1:
        raise CliError(f"--dp and --ga must be >= 1, got --dp {args.dp} --ga {args.ga}")
    if args.balance_tolerance < 0:
        raise CliError(f"--balance-tolerance must be >= 0, got {args.balance_tolerance}")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise CliError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    costs = read_pack_costs(args.packs)
    if len(costs) < args.dp * args.ga:
        raise CliError(f"{args.packs}: {len(costs)} packs, fewer than one global batch "
                       f"(--dp {args.dp} x --ga {args.ga} = {args.dp * args.ga})")
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    try:
        report = place_batches(costs, args.dp, args.ga, args.sync, args.balance_tolerance, out,
                               ranks_per_node=args.ranks_per_node)
    finally:
        if out is not None:
            out.close()
    if args.json:
        print(json.dumps(report))
    else:
        print(_place_summary(report))
    return 0


def _place_summary(r: dict) -> str:
    lines = [
        f"{r['global_batches']} global batches of DP={r['dp']} x GA={r['ga']} packs (sync={r['sync']}), "
        f"{r['skipped_packs']} trailing packs skipped",
        f"  micro-step objective / ideal : {r['baseline_microstep_ratio']:.4f} -> {r['microstep_ratio']:.4f}"
        + (f"  (optimum reached within {r['microstep_vs_optimum_max']:.4f})" if r["sync"] == "microstep"
           else "  (step mode evens rank totals only)"),
        f"  max rank total / mean        : {r['baseline_rank_ratio']:.4f} -> {r['rank_ratio']:.4f}",
        f"  packs moved                  : {100 * r['moved_fraction']:.1f}%"
        + (f" ({100 * r['inter_node_fraction']:.1f}% across nodes of {r['ranks_per_node']} ranks)"
           if r.get("ranks_per_node") else ""),
        f"  solver time                  : p50 {r['solver_ms_p50']:.2f} ms, max {r['solver_ms_max']:.2f} ms",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# demo

def cmd_demo(args) -> int:
    if args.real_iters < 2 or args.real_iters % 2:
        raise CliError(f"demo: --real-iters must be even and >= 2 (pairs of iterations), got {args.real_iters}")
    print(f"== pack: built-in mixture 'mixed' (AI2D + ChartQA real statistics, 40% text-only, "
          f"10% multi-image documents) into {args.seq_len}-token sequences")
    samples = mixtures.mixed(seed=0)
    greedy = packing.pack_greedy(samples, args.seq_len)
    rep = greedy.report()
    print(f"   {rep['samples']} samples -> {rep['packs']} packs, efficiency {rep['efficiency']:.4f}, "
          f"image tokens per pack: mean {rep['image_tokens_per_pack_mean']:.0f}, "
          f"min {rep['image_tokens_per_pack_min']}, max {rep['image_tokens_per_pack_max']}")
    budget = int(round(rep["image_tokens_per_pack_mean"]))
    b = packing.pack_budget(samples, args.seq_len, budget)
    spread = lambda packs: float(np.std([p.image_tokens for p in packs]))  # noqa: E731
    print(f"   2D packing baseline (image budget {budget}/pack): efficiency {b.efficiency:.4f}, "
          f"std of image tokens per pack {spread(greedy.packs):.0f} -> {spread(b.packs):.0f} "
          f"(balances packs, empties sequences: the seed's trade-off)")
    costs = np.array([p.image_tokens for p in greedy.packs], dtype=np.int64)
    dp, ga = args.dp, args.ga
    if len(costs) < dp * ga:
        raise CliError(f"demo: {len(costs)} packs are fewer than DP={dp} x GA={ga}")
    placed = {}
    for sync in ("microstep", "step"):
        print(f"== place: DP={dp}, GA={ga}, sync={sync}")
        placed[sync] = place_batches(costs, dp, ga, sync, placement.DEFAULT_BALANCE_TOLERANCE)
        print(_place_summary(placed[sync]))
    return _demo_training(args, placed["microstep"])


def _demo_training(args, placed: dict) -> int:
    """The demo's training runs, each its own program of the opt-in CPU harness (testing/),
    not part of the product: the real crossover runs through the launcher (the headline),
    then the emulated-accelerator training; then one labelled line per figure."""
    out = os.path.abspath(args.out)
    real_json, emulated_json = os.path.join(out, "real.json"), os.path.join(out, "emulated.json")
    if args.real or args.train:
        os.makedirs(out, exist_ok=True)
    for path in (real_json, emulated_json):
        if os.path.exists(path):
            os.remove(path)
    rc = 0
    if args.real:
        sys.stdout.flush()
        rc = subprocess.run([sys.executable, "-m", "megatron_mm_balance.testing.real_demo", "--out",
                             os.path.join(out, "real"), "--iters", str(args.real_iters), "--json", real_json,
                             *sum((["--set", kv] for kv in args.real_set or []), [])], check=False).returncode
        if rc == 2:           # no tree or a failed run: the program said why, in one line
            return rc
    if args.train:
        print("== emulated: the tiny CPU VLM + MoE with megatron-core, accelerator time emulated by sleeps",
              flush=True)
        cmd = [sys.executable, "-m", "megatron_mm_balance.testing.train_demo", *DEMO_EMULATED_DEFAULTS,
               "--json", emulated_json, *args.train_args]
        rc = max(rc, subprocess.run(cmd, check=False).returncode)
    print("== summary")
    for path in (real_json, emulated_json):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                print(json.load(f)["summary"])
    print(f"PLACEMENT (the solver on real AI2D + ChartQA statistics, DP={placed['dp']} x GA={placed['ga']}): "
          f"micro-step objective / ideal {placed['baseline_microstep_ratio']:.3f} -> "
          f"{placed['microstep_ratio']:.3f}, packs moved {100 * placed['moved_fraction']:.1f}%")
    return rc


#: The emulated training's length in the demo (the program's own defaults are longer);
#: options after ``mm-balance demo`` override them.
DEMO_EMULATED_DEFAULTS = ("--steps", "3", "--microbatches", "6")


def _make_dataset_arguments(parser) -> None:
    from .data import make_dataset
    make_dataset.add_arguments(parser)


def cmd_make_dataset(args) -> int:
    from .data import make_dataset
    if args.format != "bridge-qwen-vl":
        return make_dataset.run(args)
    if args.mix not in ("default", "native-res") or args.tile_size != make_dataset.DEFAULT_TILE_SIZE:
        raise make_dataset.MakeDatasetError("--tile-size and --mix vision-heavy apply to --format "
                                            "megatron-multimodal; bridge-qwen-vl images come at their own "
                                            "resolutions (--mix default or native-res)")
    try:
        if args.mix == "native-res":
            from .bridge.native_dataset import make_native_res_dataset
            lines = make_native_res_dataset(args.out_dir, samples=args.samples, seed=args.seed)
        else:
            from .bridge.dataset import make_qwen_vl_dataset
            lines = make_qwen_vl_dataset(args.out_dir, samples=args.samples, seed=args.seed)
    except ImportError as exc:
        raise make_dataset.MakeDatasetError(f"make-dataset needs {exc.name or exc} (pip install "
                                            "megatron-energon pillow tokenizers)") from None
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------------
# compare-logs

def cmd_compare_logs(args) -> int:
    from .megatron import logs
    if not args.rtol >= 0:
        raise CliError(f"--rtol must be >= 0, got {args.rtol}")
    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    a = logs.read_log_files(args.a.split(","), args.format)
    b = logs.read_log_files(args.b.split(","), args.format)
    if columns:
        unknown = [c for c in columns if c not in a.columns() and c not in b.columns()]
        if unknown:
            raise CliError(f"--columns: neither log has {', '.join(map(repr, unknown))} "
                           f"(columns: {', '.join(a.columns())})")
    if args.control:
        return _compare_with_control(args, a, b, columns)
    cmp = logs.compare(a, b, columns, rtol=args.rtol)
    if args.json:
        print(json.dumps({"equal": cmp.equal, "max_relative_difference": cmp.max_rel, "rtol": cmp.rtol,
                          "columns": cmp.columns, "compared": [label for label, _ in cmp.rows],
                          "only_a": cmp.only_a, "only_b": cmp.only_b,
                          "recomputed": {"a": [s.label for s in a.spans if s.recomputed],
                                         "b": [s.label for s in b.spans if s.recomputed]}}))
    else:
        print(logs.report(args.a, a, args.b, b, cmp))
    return 0 if cmp.equal else 1


def _compare_with_control(args, off, on, columns) -> int:
    """``compare-logs OFF ON --control CONTROL``: on vs off against the control's band."""
    from .megatron import band, logs
    if not args.band_k >= 1:
        raise CliError(f"--band-k must be >= 1, got {args.band_k}")
    if not args.band_floor >= 0:
        raise CliError(f"--band-floor must be >= 0, got {args.band_floor}")
    runs, controls = [], []
    for name in args.control:
        paths = name.split(",")
        runs.append(band.check_control_log(logs.read_texts(paths), name))
        controls.append(logs.read_log_files(paths, args.format))
    cmp = band.compare_with_control(off, on, controls, columns, k=args.band_k, floor=args.band_floor)
    if args.json:
        print(json.dumps({
            "verdict": cmp.verdict, "k": cmp.k, "floor": cmp.floor, "columns": cmp.columns,
            "controls": [{"log": name, "telemetry_lines": run.lines, "packs_reordered": run.packs_reordered}
                         for name, run in zip(args.control, runs)],
            "rows": [{"iteration": label, **{c: {"off": x.off, "on": x.on, "control": x.control,
                                                  "on_diff": x.on_diff, "control_diff": x.control_diff, "band": x.band,
                                                  "verdict": x.verdict}
                                              for c, x in row.items()}} for label, row in cmp.rows],
            "missing": cmp.missing}))
    else:
        print(band.band_report((args.a, args.b, args.control), cmp, runs))
    return 1 if cmp.verdict == band.DIFFERENT else 0


def cmd_compare_checkpoints(args) -> int:
    from .megatron import checkpoints
    cmp = checkpoints.compare_checkpoints(args.a, args.b, everything=args.optimizer)
    if args.json:
        print(json.dumps({"identical": cmp.identical, "same": len(cmp.same), "different": cmp.different,
                          "max_relative_difference": cmp.max_relative_difference,
                          "norm_relative_difference": cmp.norm_relative_difference,
                          "only_a": cmp.only_a, "only_b": cmp.only_b}))
    else:
        print(cmp.summary())
    return 0 if cmp.identical else 1


# ---------------------------------------------------------------------------
# replay

def _vision_shape(text):
    """``LAYERS,HIDDEN,HEADS,FFN`` (the ``MM_BALANCE_CPU_VIT`` form) as four ints > 0."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"expected LAYERS,HIDDEN,HEADS,FFN (four integers > 0), got {text!r}")
    return shape


def cmd_replay(args) -> int:
    import dataclasses

    from .cost import replay as rp
    from .sim.run_trace import read_records
    if args.skip_iterations < 0:
        raise CliError(f"--skip-iterations must be >= 0, got {args.skip_iterations}")
    options = rp.ReplayOptions(sync=args.sync, balance_tolerance=args.balance_tolerance,
                               ranks_per_node=args.ranks_per_node, holdout=args.holdout,
                               margin=args.margin, min_records=args.min_records, r2_floor=args.r2_floor,
                               vision_shape=args.vision_shape)
    names = [n.strip() for n in args.candidates.split(",") if n.strip()] if args.candidates else None
    recs = read_records(args.timing_dir)
    options = dataclasses.replace(options, features=_replay_features(args, recs))
    if args.ranks_per_node:              # nodes from the global ranks, as the runtime places them
        options = dataclasses.replace(options, ranks=tuple(sorted({int(r["rank"]) for r in recs})))
    result = rp.replay(recs, options, skip_iterations=args.skip_iterations, candidates=names)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print("\n".join(result.table()))
    return 0


def _replay_features(args, records):
    """What the records are to the cost models: Qwen-VL frames when they carry ``grids``
    (``--features auto``), with the FLOP-derived model of ``--vision-config``, else the one
    the run wrote beside its records; tiles otherwise."""
    import os

    from .cost import features as ft
    from .cost.replay import FLOPS_MODEL_FILE
    if args.features == "tiles":
        if args.vision_config is not None:
            raise CliError("--vision-config is for Qwen-VL records (--features frames); tiles take --vision-shape")
        return ft.TileFeatures()
    saved = os.path.join(args.timing_dir, FLOPS_MODEL_FILE)
    model, note = None, (f"no --vision-config JSON|PRESET given and no {FLOPS_MODEL_FILE} in "
                         f"{args.timing_dir}")
    if args.vision_config is not None:
        model, note = _flops_model_of(args.vision_config, args.flops_per_ms), ""
    elif os.path.isfile(saved):
        from .cost.model import load_cost_file
        try:
            model, note = load_cost_file(saved), ""
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.features == "frames":
        return ft.QwenVLFeatures(flops_model=model, flops_note=note)
    try:
        found = ft.features_for_records(records, flops_model=model, flops_note=note)
    except ValueError as exc:
        raise CliError(f"{args.timing_dir}: {exc}") from None
    if args.vision_config is not None and isinstance(found, ft.TileFeatures):
        raise CliError(f"{args.timing_dir}: the records have no grids (tiled images): --vision-config is "
                       "for Qwen-VL records; tiles take --vision-shape")
    return found


def _flops_model_of(text: str, flops_per_ms):
    """The FLOP-derived model of a vision config given as a preset name, a JSON file or JSON
    text (Hugging Face field names); every part trained, no language terms."""
    import os

    from .cost import flops
    if text in flops.VISION_PRESETS:
        config = flops.VISION_PRESETS[text]
        default = flops.CPU_FLOPS_PER_MS if text in flops.CPU_PRESETS else flops.DEFAULT_FLOPS_PER_MS
    else:
        try:
            if os.path.isfile(text):
                with open(text, encoding="utf-8") as f:
                    config = json.load(f)
            else:
                config = json.loads(text)
        except (OSError, json.JSONDecodeError) as exc:
            raise CliError(f"--vision-config: not a preset ({', '.join(flops.VISION_PRESETS)}), a JSON file "
                           f"or JSON text: {text!r} ({exc})") from None
        if isinstance(config, dict) and isinstance(config.get("vision_config"), dict):
            config = config["vision_config"]              # a whole Hugging Face model config
        default = flops.DEFAULT_FLOPS_PER_MS
    if not isinstance(config, dict):
        raise CliError(f"--vision-config: expected a JSON object, got {type(config).__name__}")
    try:
        return flops.vision_cost_model(config, flops_per_ms=default if flops_per_ms is None else flops_per_ms,
                                        where="--vision-config")
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _replay_arguments(rp_parser) -> None:
    from .cost import replay as rp
    rp_parser.add_argument("timing_dir", metavar="TIMING_DIR",
                           help="a run's --mm-balance-timing-dir or mm_balance.timing_dir (timing-rank*.jsonl "
                                "of every rank; the ranks are taken as its data-parallel ranks: TP = PP = 1)")
    rp_parser.add_argument("--sync", choices=placement.SYNC_MODES, default="microstep",
                           help="the run's sync mode (microstep: two-phase costs, judged per micro-step; "
                                "step: one cost, judged by rank totals)")
    rp_parser.add_argument("--balance-tolerance", type=float, default=None,
                           help="the run's --mm-balance-tolerance (default: the planner's)")
    rp_parser.add_argument("--ranks-per-node", type=int, default=None)
    rp_parser.add_argument("--holdout", type=float, default=rp.DEFAULT_HOLDOUT,
                           help="share of the iterations held out for scoring, the last ones "
                                "(default %(default)s)")
    rp_parser.add_argument("--margin", type=float, default=rp.DEFAULT_MARGIN,
                           help="how much lower a candidate's held-out max/mean must be than image "
                                "tokens' to be chosen (default %(default)s)")
    rp_parser.add_argument("--skip-iterations", type=int, default=2,
                           help="first iterations left out: start-up (default %(default)s)")
    rp_parser.add_argument("--min-records", type=int, default=rp.MIN_RECORDS)
    rp_parser.add_argument("--r2-floor", type=float, default=rp.R2_FLOOR,
                           help="lowest vision R^2 a fitted candidate may have (default %(default)s)")
    rp_parser.add_argument("--vision-shape", type=_vision_shape, default=None,
                           metavar="LAYERS,HIDDEN,HEADS,FFN",
                           help="the tiled vision encoder's shape, for the vit-flops candidate")
    rp_parser.add_argument("--features", choices=("auto", "tiles", "frames"), default="auto",
                           help="what a record is to the cost models: tiles (per-image tokens, the "
                                "Megatron-LM path) or frames (Qwen-VL grids, Megatron-Bridge); auto: frames "
                                "when the records have grids (default)")
    rp_parser.add_argument("--vision-config", default=None, metavar="JSON|PRESET",
                           help="a Qwen-VL vision config (Hugging Face names; a JSON file, JSON text or "
                                "one of qwen3-vl-30b-a3b, qwen2.5-vl-7b, qwen3-vl-tiny-cpu) for the flops "
                                "candidate; default: the flops_cost_model.json the run wrote beside its records")
    rp_parser.add_argument("--flops-per-ms", type=float, default=None,
                           help="the throughput that turns --vision-config's FLOPs into milliseconds "
                                "(default 4e11; 5e7 for qwen3-vl-tiny-cpu): only the costs' rounding "
                                "depends on it")
    rp_parser.add_argument("--candidates", default=None,
                           help="comma-separated candidates (default: the features' own; known: "
                                f"{', '.join(rp.CANDIDATES)})")
    rp_parser.add_argument("--json", action="store_true", help="print one JSON object")


# ---------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mm-balance", description="Image-token load balancing for Megatron-LM VLM pretraining: "
                "pack traces, place global batches, simulate, benchmark, demo.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pk = sub.add_parser("pack", help="pack a trace into fixed-length sequences")
    pk.add_argument("trace", help="trace file (JSON Lines or OmniBal JSON array) or mixture name")
    pk.add_argument("--seq-len", type=int, default=8192)
    pk.add_argument("--packer", choices=("greedy", "budget"), default="greedy")
    pk.add_argument("--image-budget", type=int, default=None, help="image tokens per pack (budget packer)")
    pk.add_argument("--buffer", type=int, default=packing.DEFAULT_BUFFER, help="packing buffer, samples")
    pk.add_argument("--tokens-per-tile", type=int, default=DEFAULT_TOKENS_PER_TILE)
    pk.add_argument("--on-overlong", choices=("drop", "error"), default="drop")
    pk.add_argument("--out", help="write PACKS.jsonl")
    pk.add_argument("--json", action="store_true", help="print one JSON object")
    pk.set_defaults(func=cmd_pack)

    pl = sub.add_parser("place", help="balance consecutive global batches of packs")
    pl.add_argument("packs", help="PACKS.jsonl (from 'mm-balance pack --out')")
    pl.add_argument("--dp", type=int, required=True, help="data-parallel ranks")
    pl.add_argument("--ga", type=int, required=True, help="micro-batches per global batch")
    pl.add_argument("--sync", choices=placement.SYNC_MODES, default="microstep")
    pl.add_argument("--balance-tolerance", type=float, default=placement.DEFAULT_BALANCE_TOLERANCE)
    pl.add_argument("--ranks-per-node", type=int, default=None,
                    help="ranks per node: prefer intra-node moves (default: one node, no preference)")
    pl.add_argument("--out", help="write PLACEMENT.jsonl")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(func=cmd_place)

    dm = sub.add_parser("demo", help="the main job on the embedded default")
    dm.add_argument("--seq-len", type=int, default=8192)
    dm.add_argument("--dp", type=int, default=64)
    dm.add_argument("--ga", type=int, default=16)
    dm.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                    help="run Megatron-LM's examples/multimodal/train.py through scripts/pretrain_vlm_moe.sh "
                         "on configs/megatron/vision_heavy_cpu.sh, two jobs each balancing the iterations of one "
                         "parity (--mm-balance-mode crossover-even, crossover-odd), real compute: balancing's "
                         "gain with a paired interval (default: on; needs MEGATRON_LM_DIR or the release archive "
                         "in ../shared/megatron-lm)")
    dm.add_argument("--real-iters", type=int, default=8,
                    help="measured iterations per real job, even (default 8: 4 pairs)")
    dm.add_argument("--real-set", action="append", metavar="VAR=VALUE",
                    help="launcher/config environment override of the real runs, e.g. GBS=8 (repeatable)")
    dm.add_argument("--out", default="runs/demo", help="the demo's runs and dataset (default %(default)s)")
    dm.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                    help="also train the tiny CPU VLM + MoE (DP=2 x EP=2, 4 processes) with "
                         "balancing off vs on and emulated accelerator time (default: on); other options "
                         "go to it, see 'python -m megatron_mm_balance.testing.train_demo --help'")
    dm.set_defaults(func=cmd_demo)

    md = sub.add_parser("make-dataset", help="write a small synthetic energon VLM dataset and tokenizer "
                        "for Megatron-LM's examples/multimodal")
    _make_dataset_arguments(md)
    md.set_defaults(func=cmd_make_dataset)

    cl = sub.add_parser("compare-logs", help="compare two Megatron-LM training logs iteration by "
                        "iteration (a job's first-iteration averaging undone); exit 0 if equal")
    cl.add_argument("a", metavar="A.log", help="the reference run's log (FILE[,FILE...]: one per job, in order)")
    cl.add_argument("b", metavar="B.log", help="the other run's log (FILE[,FILE...], e.g. a stopped and a "
                    "resumed job)")
    cl.add_argument("--rtol", type=float, default=1e-5, help="largest relative difference called equal "
                    "(default 1e-5)")
    cl.add_argument("--columns", default=None, help="comma-separated columns to compare (default: every "
                    "loss column both logs print), e.g. 'lm loss,grad norm'")
    cl.add_argument("--control", metavar="CONTROL.log", action="append", default=None, help="a control "
                    "run's log (--mm-balance-mode control / mm_balance.mode=control; FILE[,FILE...]; "
                    "repeat for several controls: the band is the widest): judge B (balancing on) "
                    "against A (off) within the control's arithmetic-order band; verdict EQUAL, "
                    "WITHIN BAND or DIFFERENT (exit 1); --rtol is then not used")
    from .megatron.band import DEFAULT_FLOOR, DEFAULT_K
    cl.add_argument("--band-k", type=float, default=DEFAULT_K, help="with --control: B may differ from A "
                    "by this many times the band (default %(default)s)")
    cl.add_argument("--band-floor", type=float, default=DEFAULT_FLOOR, help="with --control: the least band, a "
                    "relative difference (default %(default)s)")
    cl.add_argument("--format", choices=("megatron", "bridge"), default="megatron", help="whose training "
                    "log: 'megatron' (Megatron-LM: a job's second line also averages its first "
                    "iteration, undone) or 'bridge' (Megatron-Bridge: every line as printed)")
    cl.add_argument("--json", action="store_true", help="print one JSON object")
    cl.set_defaults(func=cmd_compare_logs)

    cc = sub.add_parser("compare-checkpoints", help="compare two torch_dist checkpoints bit for bit "
                        "(every tensor's SHA-256); exit 0 if identical")
    cc.add_argument("a", metavar="A", help="a checkpoint directory (iter_NNNNNNN) or save directory")
    cc.add_argument("b", metavar="B", help="the other checkpoint")
    cc.add_argument("--optimizer", action="store_true", help="also compare the optimizer's tensors "
                    "(the distributed optimizer's flat buckets save their padding as uninitialised memory)")
    cc.add_argument("--json", action="store_true", help="print one JSON object")
    cc.set_defaults(func=cmd_compare_checkpoints)

    rpl = sub.add_parser("replay", help="judge cost models by replaying a run's per-pack timings: the "
                         "balance each cost's placements reach on held-out iterations")
    _replay_arguments(rpl)
    rpl.set_defaults(func=cmd_replay)

    for name in EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise
            continue
        module.register(sub)
    return p


def main(argv=None) -> int:
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if args.command == "demo":
            args.train_args = extra
        elif extra:
            raise CliError(f"mm-balance {args.command}: unrecognized arguments: {' '.join(extra)}")
        return args.func(args)
    except (CliError, TraceError, packing.OverlongSampleError, ValueError, OSError) as exc:
        msg = str(exc)
        if not msg.startswith("mm-balance"):
            msg = f"mm-balance: error: {msg}"
        print(msg.splitlines()[0] if msg else "mm-balance: error", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
