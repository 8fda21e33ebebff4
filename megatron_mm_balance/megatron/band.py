"""Off vs on judged against a control: ``mm-balance compare-logs OFF ON --control CONTROL``.

Balancing changes nothing a model computes, but under expert parallelism (and any other
reduction whose operands depend on which micro-batches meet) it changes the order of
floating-point sums, so bf16 runs differ in the last digits, by an amount no fixed
tolerance fits (it depends on the data set, the model and the iteration). A control run
(``--mm-balance-mode control``, ``mm_balance.mode=control``) keeps every rank's own packs
and only reorders them across micro-steps the way balancing orders them: it changes the
arithmetic order about as much and nothing else. Its difference from the off run is the
job's *arithmetic-order band*; balancing's own difference is judged against it.

Per loss series and per iteration span (the spans :mod:`.logs` reads: a Megatron-LM job's
first-iteration averaging undone, Megatron-Bridge's lines as printed):

* ``on_diff``: relative difference on vs off; ``control_diff``: control vs off; ``band``:
  the largest ``control_diff`` of the series over the whole job. The band is a property of
  the job: when a reordering first reaches the printed digits, and whether an iteration's
  loss happens to land back near the off run's, is chaotic (measured: a control equal to
  off at the very iteration where balancing differed by 1.7e-5, and 1.5e-5 away one
  iteration later), so a per-iteration band would call that DIFFERENT;
* a span is ``EQUAL`` when on and off print identical values, ``WITHIN BAND`` when
  ``on_diff <= k * max(band, floor)``, else ``DIFFERENT``; the run's verdict is DIFFERENT
  if any span is, EQUAL if all are, else WITHIN BAND. ``k`` and ``floor`` are
  :data:`DEFAULT_K` and :data:`DEFAULT_FLOOR` (measured and justified in
  docs/notes/2026-12-02-control-band.md).

The control log must be a control run: its telemetry lines say ``control: 1`` and
``packs_moved: 0``; anything else is refused with a one-line :class:`~.logs.LogError`.
Imports nothing from Megatron or torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .logs import LogError, TrainingLog, is_loss_column, relative_difference

EQUAL, WITHIN_BAND, DIFFERENT = "EQUAL", "WITHIN BAND", "DIFFERENT"
#: on vs off may differ by this many times the control's band: the measured ratios reach
#: about 5, and the ratio of two reorderings' distances is heavy-tailed (docs/notes/2026-12-02-control-band.md)
DEFAULT_K = 8.0
#: the band is never taken below this relative difference: a few units of the printed
#: 7th digit (Megatron prints losses as ``%.6E``: one unit is 1e-7 to 1e-6 relative)
DEFAULT_FLOOR = 1e-6

def read_telemetry(texts: Sequence[str]) -> List[Dict[str, float]]:
    """Every chunk-0 telemetry line of the logs, as ``{field: value}`` (numeric fields) with
    its ``iteration`` (:func:`~.telemetry.read_lines`)."""
    from ..runtime.log_line import read_lines
    return [dict(fields, iteration=float(it)) for text in texts for it, chunk, fields in read_lines(text)
            if chunk == 0]


@dataclass(frozen=True)
class ControlRun:
    """What a control log's telemetry says: how many lines, packs reordered in all."""

    lines: int
    packs_reordered: float


def check_control_log(texts: Sequence[str], name: str) -> ControlRun:
    """The control run's telemetry, checked: every line is a control one (``control: 1``) and
    moved no pack across ranks. Raises :class:`LogError` naming ``name`` otherwise."""
    lines = read_telemetry(texts)
    if not lines:
        raise LogError(f"{name}: no [mm-balance] telemetry line: not a control run (train it with "
                       "--mm-balance --mm-balance-mode control, or mm_balance.enabled=true "
                       "mm_balance.mode=control)")
    not_control = [int(f["iteration"]) for f in lines if f.get("control") != 1.0]
    if not_control:
        raise LogError(f"{name}: telemetry of iteration(s) {not_control} is not control mode's "
                       "(no 'control: 1'): the control must run with --mm-balance-mode control")
    moved = [int(f["iteration"]) for f in lines if f.get("packs_moved", 0.0) != 0.0]
    if moved:
        raise LogError(f"{name}: the control moved packs across ranks at iteration(s) {moved}")
    return ControlRun(len(lines), sum(f.get("packs_reordered", 0.0) for f in lines))


@dataclass(frozen=True)
class BandCell:
    """One loss series at one span: the three values, on's difference, the band, the verdict."""

    off: float
    on: float
    control: float
    on_diff: float
    control_diff: float
    band: float
    verdict: str


@dataclass
class BandComparison:
    """On vs off beside control vs off, span by span (see the module docstring)."""

    columns: List[str]
    rows: List[Tuple[str, Dict[str, BandCell]]]
    k: float
    floor: float
    missing: List[str] = field(default_factory=list)    # spans or values not in all three logs

    @property
    def verdict(self) -> str:
        cells = [c for _, row in self.rows for c in row.values()]
        if not cells:
            return DIFFERENT
        if any(c.verdict == DIFFERENT for c in cells):
            return DIFFERENT
        return EQUAL if all(c.verdict == EQUAL for c in cells) else WITHIN_BAND

    def worst(self, column: str) -> Tuple[float, float]:
        """The largest on-vs-off difference of ``column`` and the largest band."""
        cells = [row[column] for _, row in self.rows if column in row]
        return (max((c.on_diff for c in cells), default=0.0), max((c.band for c in cells), default=0.0))


def judge(on_diff: float, band: float, k: float, floor: float, identical: bool) -> str:
    """A span's verdict (the rule of the module docstring)."""
    if identical:
        return EQUAL
    return WITHIN_BAND if on_diff <= k * max(band, floor) else DIFFERENT


def compare_with_control(off: TrainingLog, on: TrainingLog, control, columns: Optional[Sequence[str]] = None,
                         *, k: float = DEFAULT_K, floor: float = DEFAULT_FLOOR) -> BandComparison:
    """On vs off against control vs off over the spans all runs logged: ``columns``, or
    every loss column they all print. ``control``: one control run's log, or several (the
    band is then the largest of their differences: more controls, fewer false alarms)."""
    controls = list(control) if isinstance(control, (list, tuple)) else [control]
    if not controls:
        raise ValueError("at least one control log is needed")
    if not k >= 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not floor >= 0:
        raise ValueError(f"floor must be >= 0, got {floor}")
    if columns is None:
        common = set(on.columns()).intersection(*(c.columns() for c in controls))
        columns = [c for c in off.columns() if is_loss_column(c) and c in common]
    r_off, r_on = off.by_range(), on.by_range()
    r_ctls = [c.by_range() for c in controls]
    keys = sorted(set(r_off) & set(r_on) & set.intersection(*(set(r) for r in r_ctls)))
    every = [r_off, r_on, *r_ctls]
    missing = [next(r[key] for r in every if key in r).label
               for key in sorted(set().union(*(set(r) for r in every)) - set(keys))]
    found = []
    for key in keys:
        row = {}
        for c in columns:
            vals = [r[key].values.get(c) for r in every]
            if any(v is None for v in vals):
                missing.append(f"{r_off[key].label} ({c})")
                continue
            v_off, v_on, *v_ctls = vals
            v_ctl = max(v_ctls, key=lambda v: relative_difference(v, v_off))
            row[c] = (v_off, v_on, v_ctl)
        if row:
            found.append((r_off[key].label, row))
    band = {c: max((relative_difference(v[2], v[0]) for _, row in found for cc, v in row.items() if cc == c),
                   default=0.0) for c in columns}
    rows = []
    for label, row in found:
        cells = {}
        for c, (v_off, v_on, v_ctl) in row.items():
            on_diff = relative_difference(v_on, v_off)
            cells[c] = BandCell(v_off, v_on, v_ctl, on_diff, relative_difference(v_ctl, v_off), band[c],
                                judge(on_diff, band[c], k, floor, v_on == v_off))
        rows.append((label, cells))
    return BandComparison(list(columns), rows, float(k), float(floor), missing)


def band_report(names: Tuple[str, str, Sequence[str]], cmp: BandComparison,
                control_runs: Sequence[ControlRun]) -> str:
    """The text ``mm-balance compare-logs OFF ON --control CONTROL [--control ...]`` prints
    (the control column: the control farthest from off at that span)."""
    off_name, on_name, ctl_names = names
    out = [f"off: {off_name}", f"on: {on_name}"]
    out += [f"control: {name} ({run.lines} telemetry lines, control mode, no pack moved across ranks, "
            f"{run.packs_reordered:g} reordered)" for name, run in zip(ctl_names, control_runs)]
    out += [
           f"rule: EQUAL if on and off print the same value; WITHIN BAND if |on-off|/|off| <= "
           f"{cmp.k:g} x max(band, {cmp.floor:.0e}), band = largest |control-off|/|off| of the job; "
           "else DIFFERENT"]
    for c in cmp.columns:
        out.append(f"{c}:")
        out.append(f"{'iteration':>10} | {'off':>13} {'on':>13} {'control':>13} | "
                   f"{'on-off':>9} {'ctl-off':>9} {'band':>9} {'ratio':>7} | verdict")
        for label, row in cmp.rows:
            if c not in row:
                continue
            x = row[c]
            ratio = x.on_diff / max(x.band, cmp.floor)
            out.append(f"{label:>10} | {x.off:>13.6E} {x.on:>13.6E} {x.control:>13.6E} | "
                       f"{x.on_diff:>9.2e} {x.control_diff:>9.2e} {x.band:>9.2e} {ratio:>7.2f} | {x.verdict}")
    if cmp.missing:
        out.append(f"not in all three logs (not compared): {', '.join(cmp.missing)}")
    if not cmp.rows:
        out.append("no iteration logged by all three runs over the same iterations: DIFFERENT")
        return "\n".join(out)
    worst = ", ".join(f"{c} on-off {d:.3g} band {b:.3g}" for c in cmp.columns for d, b in [cmp.worst(c)])
    out.append(f"{len(cmp.rows)} iteration(s) compared ({worst}): {cmp.verdict}")
    return "\n".join(out)
