"""What each placement moved in a real-path bench's runs: packs, packs across meeting groups, and
the group objective, from the runs' own ``[mm-balance]`` lines.

    python benchmarks/group_moves.py OUT [--modes sync,sync-all]

``OUT`` is a ``mm-balance bench-realpath [--bridge] --modes off,sync,sync-all --out OUT``
directory (Bridge: ``packs-sync,packs-sync-all``) of a job whose expert-parallel groups are
smaller than its data-parallel group (e.g. ``--set GPUS_PER_NODE=4``: DP=4 x EP=2). ``sync``
places by the meeting groups the job has (``auto`` sync), ``sync-all`` as if all data-parallel
ranks met every micro-step (today's objective); both read the same data. Per run, over every
iteration's line (the placement of every global batch counts, the warm-up included): the share
of slots that train a pack drawn elsewhere, the packs that changed meeting group per global
batch, and the group objective (the slowest meeting group's sum of its per-micro-step maxima,
in the cost's unit per micro-step) as drawn and as trained. Needs a run per mode whose
telemetry names the groups (``step_groups``), i.e. whose meeting groups split the group.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from megatron_mm_balance.runtime.log_line import read_lines


def run_figures(log: str, ranks: int) -> dict:
    """The figures of one run's log (chunk 0's lines; ``ranks``: data-parallel ranks)."""
    lines = [fields for _, chunk, fields in read_lines(log) if chunk == 0 and "step_groups" in fields]
    if not lines:
        raise ValueError("no [mm-balance] line names meeting groups (step_groups): a job whose "
                         "expert-parallel groups split its data-parallel group is needed")
    slots = [ranks * f["num_microbatches"] for f in lines]
    return {"iterations": len(lines),
            "moved_share": sum(f["packs_moved"] for f in lines) / sum(slots),
            "packs_moved": statistics.fmean(f["packs_moved"] for f in lines),
            "inter_group_packs": statistics.fmean(f["inter_group_packs"] for f in lines),
            "group_cost_before": statistics.fmean(f["group_cost_before"] for f in lines),
            "group_cost_after": statistics.fmean(f["group_cost_after"] for f in lines),
            "step_groups": lines[0]["step_groups"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--modes", default=None, help="the runs to read (default: sync,sync-all, or Bridge's "
                                                  "packs-sync,packs-sync-all when those are there)")
    ap.add_argument("--ranks", type=int, default=4, help="data-parallel ranks of the job (default 4)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    modes = a.modes.split(",") if a.modes else (
        ["packs-sync", "packs-sync-all"] if any(out.glob("round*-packs-sync")) else ["sync", "sync-all"])
    print(f"{out}: per global batch, every iteration; group cost per micro-step, in the cost's unit")
    print("round  mode              iterations  moved share  packs moved  inter-group  group cost before -> after")
    for run in sorted(d for m in modes for d in out.glob(f"round*-{m}") if d.name.split("-", 1)[1] == m):
        try:
            f = run_figures((run / "train.log").read_text(errors="replace"), a.ranks)
        except (OSError, ValueError) as exc:
            sys.exit(f"group_moves.py: {run}: {exc}")
        rnd, mode = run.name.split("-", 1)
        print(f"{rnd[5:]:>5}  {mode:<16} {f['iterations']:>10} {f['moved_share']:>12.1%} {f['packs_moved']:>12.2f}"
              f" {f['inter_group_packs']:>12.2f}   {f['group_cost_before']:>10.1f} -> {f['group_cost_after']:.1f}")


if __name__ == "__main__":
    main()
