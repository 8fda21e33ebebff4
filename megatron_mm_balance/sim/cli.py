"""``mm-balance simulate``: what image-token imbalance costs, and what each fix recovers.

    mm-balance simulate TRACE --dp 64,256,1024 --ga 16 --seq-len 8192 \\
        --sync microstep [--timing FILE|NAME] [--batches N] --out DIR

TRACE is a trace file (JSON Lines or OmniBal-style JSON array) or the name of a
built-in mixture (``megatron_mm_balance.data.mixtures.MIXTURES``), or a training job's
per-pack timing directory (``--mm-balance-timing-dir``): then its own global batches
are simulated as the job laid them out, with ``--timing run`` a timing model fitted
from the job's own timings (:mod:`.run_trace`). Writes
``DIR/report.json`` and PNG plots, prints a table. Bad input exits with status 2
and a one-line message.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

from ..cost.pack import DEFAULT_TOKENS_PER_TILE
from ..data.mixtures import MIXTURES, make_mixture
from ..data.traces import TraceError, load_trace, summarize
from .engine import BALANCE_COSTS, SimConfig, simulate_dp
from .pool import DRAW_MODES, build_pool, pool_stats
from .progress import Progress
from .report import format_table, write_report
from .strategies import DEFAULT_STRATEGIES, STRATEGIES
from .timing import TimingError, load_timing

PROG = "mm-balance simulate"
DEFAULT_BUDGET_FRACTIONS = (0.25, 0.375, 0.5, 0.75)
MAX_DP = 65536


class SimInputError(ValueError):
    """Bad command-line input for the simulator."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE",
                   help=f"trace file, a built-in mixture ({', '.join(MIXTURES)}), or a job's "
                        f"--mm-balance-timing-dir (its own layout; --timing run fits the timing model)")
    p.add_argument("--dp", default="64,256,1024",
                   help="data-parallel sizes, comma separated (default 64,256,1024)")
    p.add_argument("--ga", default="16", help="micro-steps per global batch (default 16)")
    p.add_argument("--seq-len", default=None,
                   help="packed sequence length (default 8192; a job's layout: its longest pack)")
    p.add_argument("--sync", default="microstep",
                   help="where ranks meet: microstep (MoE expert parallel) or step (pure DP)")
    p.add_argument("--ep", default=None,
                   help="microstep: expert-parallel sizes, comma separated (a number, or dp): "
                        "ranks meet per micro-step in groups of EP consecutive data-parallel "
                        "ranks, data parallelism once per step; a run per DP and EP "
                        "(default: dp, every rank meets every micro-step)")
    p.add_argument("--frame-plan-ms", default="0",
                   help="redistribute-images/-frames: the frame plan's time per micro-step and "
                        "group in ms, run ahead on the exchange thread before the micro-step's "
                        "transfers (benchmarks/bench_frame_plan.py measures it; default 0)")
    p.add_argument("--pp", default="1",
                   help="pipeline stages; the vision encoder sits on the first (default 1)")
    p.add_argument("--timing", default="default",
                   help="timing model: a YAML/JSON file or a name in configs/ "
                        "(default, vlm_2b_dense, vlm_30b_moe); with a job's timing directory also "
                        "'run': fitted from its own timings")
    p.add_argument("--timing-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one timing value, e.g. exchange.link_gbps=40 (repeatable)")
    p.add_argument("--llm-params", default=None,
                   help="sweep the LLM size: active parameters in billions, comma separated")
    p.add_argument("--batches", default="10", help="global batches per run (default 10)")
    p.add_argument("--budgets", default=None,
                   help="image-token budgets for the 2D packer, comma separated "
                        "(default 1/4, 3/8, 1/2, 3/4 of the sequence length)")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help="strategies to run, comma separated (default: all)")
    p.add_argument("--balance-cost", default="auto",
                   help="cost the placement balances: two-phase (vision and language time "
                        "per pack, both maxima of every micro-step), time (pack ms), "
                        "image-tokens, or auto (default: two-phase when the timing model "
                        "has both phases, else time)")
    p.add_argument("--ranks-per-node", default="8",
                   help="ranks per node: moves prefer node-mates, inter-node bytes are "
                        "reported (default 8; 1 = flat)")
    p.add_argument("--prefetch", action="store_true",
                   help="redistribute-overlap: micro-step 0's exchange hides behind the "
                        "previous global batch's last micro-step, as the runtime does when "
                        "it may run across global batches (default: exposed)")
    p.add_argument("--draw", default="iid",
                   help="how ranks draw packs from the packed pool: iid or contiguous")
    p.add_argument("--buffer", default="1024", help="packing buffer size (default 1024)")
    p.add_argument("--skip-iterations", default="2",
                   help="a job's timing directory: leave out its first N iterations (default 2, the "
                        "two Megatron averages into its second log line)")
    p.add_argument("--samples", default=None,
                   help="samples to draw for a synthetic mixture (default: the mixture's own)")
    p.add_argument("--pool-samples", default="30000",
                   help="pack at most the first N samples of the trace into each pool "
                        "(default 30000; 0 = all); global batches resample the pool")
    p.add_argument("--tokens-per-tile", default=str(DEFAULT_TOKENS_PER_TILE),
                   help=f"image tokens per tile for OmniBal-style traces (default {DEFAULT_TOKENS_PER_TILE})")
    p.add_argument("--seed", default="0", help="seed of the mixture and the pack draws")
    p.add_argument("--heatmap-ranks", default="64", help="ranks shown in the heat map")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-floors", action="store_true",
                   help="skip the bound rows (perfect balance and the floors of whole packs and "
                        "of whole frames on the same global batches)")
    prog = p.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="always show the progress bar")
    prog.add_argument("--no-progress", dest="progress", action="store_false",
                      help="never show the progress bar")


def _one_line_error(message: str):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``simulate`` to the ``mm-balance`` sub-commands."""
    p = subparsers.add_parser("simulate", help="simulate imbalance and the fixes at scale",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.error = _one_line_error
    p.set_defaults(func=run)
    return p


def _int(name, text, lo=1, hi=None):
    try:
        v = int(str(text).strip())
    except ValueError:
        raise SimInputError(f"{name} must be an integer, got {text!r}") from None
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise SimInputError(f"{name} must be {rng}, got {v}")
    return v


def _int_list(name, text, lo=1, hi=None):
    items = [s for s in str(text).split(",") if s.strip()]
    if not items:
        raise SimInputError(f"{name} needs at least one value")
    vals = [_int(name, s, lo, hi) for s in items]
    if len(set(vals)) != len(vals):
        raise SimInputError(f"{name} lists a value twice: {text}")
    return vals


def _float_list(name, text, zero=False):
    out = []
    for s in str(text).split(","):
        if not s.strip():
            continue
        try:
            v = float(s)
        except ValueError:
            raise SimInputError(f"{name} must be numbers, got {s!r}") from None
        if not (v >= 0 if zero else v > 0) or v != v or v == float("inf"):
            raise SimInputError(f"{name} must be {'>= 0' if zero else '> 0'}, got {v}")
        out.append(v)
    if not out:
        raise SimInputError(f"{name} needs at least one value")
    return out


def _ep_list(text):
    """``--ep``: a list of positive integers and ``dp`` (None: EP = DP)."""
    if text is None:
        return [None]
    out = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if not item:
            continue
        out.append(None if item == "dp" else _int("--ep", item))
    if not out:
        raise SimInputError("--ep needs at least one value")
    if len(set(out)) != len(out):
        raise SimInputError(f"--ep lists a value twice: {text}")
    return out


def _choice(name, text, choices):
    if text not in choices:
        raise SimInputError(f"{name} must be one of {', '.join(choices)}, got {text!r}")
    return text


def load_samples(spec: str, *, samples=None, seed=0, tokens_per_tile=DEFAULT_TOKENS_PER_TILE):
    """(samples, cache key, description) for a trace file or a mixture name."""
    if os.path.exists(spec):
        st = os.stat(spec)
        data = load_trace(spec, tokens_per_tile=tokens_per_tile)
        return data, ("file", os.path.abspath(spec), st.st_mtime_ns, tokens_per_tile), spec
    if spec in MIXTURES:
        data = make_mixture(spec, n=samples, seed=seed)
        if not data:
            raise SimInputError(f"mixture {spec!r} with {samples} samples is empty")
        return data, ("mixture", spec, samples, seed), f"mixture:{spec}"
    raise SimInputError(f"TRACE {spec!r} is neither a file nor a built-in mixture "
                        f"({', '.join(MIXTURES)})")


def run(args) -> int:
    try:
        return _run(args)
    except (SimInputError, TraceError, TimingError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
              file=sys.stderr)
        return 2
    except ValueError as exc:        # e.g. nothing could be packed
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    if os.path.isdir(args.trace):
        return _run_layout(args)
    t_start = time.perf_counter()
    dps = _int_list("--dp", args.dp, 1, MAX_DP)
    ga = _int("--ga", args.ga)
    seq_len = _int("--seq-len", args.seq_len or "8192")
    pp = _int("--pp", args.pp)
    batches = _int("--batches", args.batches)
    buffer = _int("--buffer", args.buffer)
    seed = _int("--seed", args.seed, 0)
    tpt = _int("--tokens-per-tile", args.tokens_per_tile)
    heat_ranks = _int("--heatmap-ranks", args.heatmap_ranks)
    n_samples = None if args.samples is None else _int("--samples", args.samples)
    pool_samples = _int("--pool-samples", args.pool_samples, 0)
    sync = _choice("--sync", args.sync, ("microstep", "step"))
    eps = _ep_list(args.ep)
    if args.ep is not None and sync != "microstep":
        raise SimInputError(f"--ep needs --sync microstep (expert parallelism), got --sync {sync}")
    for D in dps:
        for ep in eps:
            if ep is not None and D % ep:
                raise SimInputError(f"--ep {ep} does not divide --dp {D}")
    frame_plan_ms = _float_list("--frame-plan-ms", args.frame_plan_ms, zero=True)[0]
    balance_cost = _choice("--balance-cost", args.balance_cost, BALANCE_COSTS)
    ranks_per_node = _int("--ranks-per-node", args.ranks_per_node)
    draw = _choice("--draw", args.draw, DRAW_MODES)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        _choice("--strategies", s, STRATEGIES)
    if not strategies:
        raise SimInputError("--strategies needs at least one strategy")
    if "none" not in strategies:
        strategies.insert(0, "none")          # every throughput is relative to it
    if args.budgets is None:
        budgets = sorted({max(256, int(seq_len * f) // 256 * 256)
                          for f in DEFAULT_BUDGET_FRACTIONS})
    else:
        budgets = _int_list("--budgets", args.budgets, 1)
    if "budget" not in strategies:
        budgets = []

    timing = load_timing(args.timing, args.timing_set)
    timings = [timing]
    if args.llm_params is not None:
        timings = [timing.with_llm_params(n) for n in _float_list("--llm-params", args.llm_params)]

    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise SimInputError(f"--out {out}: exists and is not a directory")
    os.makedirs(out, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise SimInputError(f"--out {out}: not writable")

    samples, key, desc = load_samples(args.trace, samples=n_samples, seed=seed,
                                      tokens_per_tile=tpt)
    if pool_samples and len(samples) > pool_samples:
        samples = samples[:pool_samples]
        key = (*key, pool_samples)
    total_slots = sum(dps) * ga * batches * len(timings)
    show = args.progress if args.progress is not None else (
        total_slots >= 1_000_000 or (bool(budgets) and len(samples) >= 20_000))
    bar = Progress(len(dps) * len(eps) * len(timings) * batches, enabled=show, label="packing")

    t0 = time.perf_counter()
    pool = build_pool(samples, seq_len, buffer_size=buffer, cache_key=key)
    budget_pools = {}
    for b in budgets:
        bar.set_label(f"packing with image budget {b}")
        budget_pools[b] = build_pool(samples, seq_len, budget=b, buffer_size=buffer,
                                     cache_key=key)
    pack_s = time.perf_counter() - t0

    cfg = SimConfig(dps=dps, ga=ga, seq_len=seq_len, sync=sync, pp=pp, batches=batches,
                    seed=seed, strategies=tuple(strategies), balance_cost=balance_cost,
                    draw=draw, heatmap_ranks=heat_ranks,
                    ranks_per_node=ranks_per_node if ranks_per_node > 1 else None,
                    prefetch=bool(args.prefetch), floors=not args.no_floors,
                    frame_plan_ms=frame_plan_ms)
    runs, heat = [], None
    t1 = time.perf_counter()
    for t in timings:
        for D in dps:
            for ep in eps:
                bar.set_label(f"dp={D}" + ("" if ep is None else f" ep={ep}")
                              + (f" llm={t.llm_params_b:g}B" if len(timings) > 1 else ""))
                keep = D == max(dps) and t is timings[0] and ep == eps[0]
                r, h = simulate_dp(replace(cfg, ep=ep), D, t, pool, budget_pools, progress=bar,
                                   keep_heatmap=keep)
                runs.extend(r)
                if h:
                    heat = h
    sim_s = time.perf_counter() - t1
    bar.close()

    title = f"({desc}, {timing.name}, GA={ga}, {seq_len // 1024}K, sync={sync}" + \
        ("" if args.ep is None else f", EP={args.ep}") + \
        (f", PP={pp}" if pp > 1 else "") + ")"
    plots = []
    if not args.no_plots:
        from .plots import plot_all
        plots = [os.path.basename(p) for p in
                 plot_all(out, runs, heat, title=title, heatmap_ranks=heat_ranks)]
    meta = {
        "trace": desc, "trace_summary": summarize(samples),
        "config": {**cfg.__dict__, "budgets": budgets, "buffer": buffer,
                   "pool_samples": pool_samples},
        "timing": [t.to_dict() for t in timings],
        "pools": {"greedy": pool_stats(pool),
                  **{f"budget_{b}": pool_stats(p) for b, p in budget_pools.items()}},
        "resampling": "packs of each global batch are drawn by seeded resampling of the "
                      "pool the trace was packed into once per strategy",
        "elapsed_s": {"packing": pack_s, "simulation": sim_s,
                      "total": time.perf_counter() - t_start},
        "plots": plots,
    }
    write_report(out, runs, meta)
    print(format_table(runs))
    if pool.dropped:
        print(f"\nnote: {pool.dropped} of {pool.samples} samples are longer than --seq-len "
              f"{seq_len} and were left out of every pool (see meta.pools in report.json)")
    print(f"\n{len(runs)} runs, {batches} global batches each; packing {pack_s:.1f} s, "
          f"simulation {sim_s:.1f} s; report: {os.path.join(out, 'report.json')}")
    return 0


def _run_layout(args) -> int:
    """``mm-balance simulate RUN_TIMING_DIR``: the job's own global batches as it laid them out."""
    from .run_trace import LAYOUT_STRATEGIES, RunTraceError, fit_timing_model, load_run, simulate_layout, \
        timing_file
    from .timing import apply_overrides, model_from_dict
    t_start = time.perf_counter()
    try:
        run = load_run(args.trace, skip_iterations=_int("--skip-iterations", args.skip_iterations, 0))
    except RunTraceError as exc:
        raise SimInputError(str(exc)) from None
    I, D, G = run.shape
    if args.ep is not None:
        raise SimInputError("--ep applies to a trace or a mixture, not to a job's timing directory "
                            "(its own layout)")
    seq_len = None if args.seq_len is None else _int("--seq-len", args.seq_len)
    sync = _choice("--sync", args.sync, ("microstep", "step"))
    balance_cost = _choice("--balance-cost", args.balance_cost, BALANCE_COSTS)
    asked = [s.strip() for s in args.strategies.split(",") if s.strip()]
    strategies = [s for s in asked if s in LAYOUT_STRATEGIES]
    skipped = [s for s in asked if s not in LAYOUT_STRATEGIES]
    if "none" not in strategies:
        strategies.insert(0, "none")
    if args.timing == "run":
        fitted, fit_report = fit_timing_model(run, seq_len=seq_len)
        timing = model_from_dict(apply_overrides(timing_file(fitted), args.timing_set), name="run")
    else:
        timing, fit_report = load_timing(args.timing, args.timing_set), None
    os.makedirs(args.out, exist_ok=True)
    ranks_per_node = _int("--ranks-per-node", args.ranks_per_node)
    runs = simulate_layout(run, timing, sync=sync, balance_cost=balance_cost, strategies=strategies,
                           prefetch=bool(args.prefetch), seq_len=seq_len,
                           ranks_per_node=ranks_per_node if ranks_per_node > 1 else None)
    meta = {"trace": args.trace, "layout": {"iterations": run.iterations, "ranks": run.ranks,
                                            "microsteps": G},
            "timing": [timing.to_dict()], "timing_fit": fit_report,
            "skipped_strategies": skipped,
            "resampling": "none: the job's own global batches in the order it computed them",
            "elapsed_s": {"total": time.perf_counter() - t_start}}
    write_report(args.out, runs, meta)
    print(format_table(runs))
    if skipped:
        print(f"\nnote: {', '.join(skipped)} left out: a job's layout is simulated with "
              f"{', '.join(LAYOUT_STRATEGIES)} only (budget packing would re-pack its data)")
    print(f"\n{len(runs)} runs on the job's {I} global batches of DP={D} x GA={G}; "
          f"report: {os.path.join(args.out, 'report.json')}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mm-balance")
    parser.error = _one_line_error
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
