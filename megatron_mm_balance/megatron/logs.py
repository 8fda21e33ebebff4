"""Read Megatron-LM training logs, undo a job's first-iteration averaging, compare two runs.

Megatron prints one line per ``--log-interval`` (``print_rank_last`` in ``training_log``)::

    [...] iteration        5/       6 | consumed samples: 40 | elapsed time per iteration (ms): 1492.3 |
    learning rate: ... | global batch size: 8 | lm loss: 6.336021E+00 | load_balancing_loss: ... |
    loss scale: 1.0 | grad norm: 2.027 | number of skipped iterations: 0 | number of nan iterations: 0 |

The loss columns (and the elapsed time) are means over the iterations since the previous
line. Every job also prints its first iteration (``is_first_iteration``), and on that line
Megatron does not reset its accumulators (``should_reset = not is_first_iteration`` in
``training_log``, in every supported release, core_v0.16.1 to core_v0.19.0): the job's
second line is the mean over its first iteration *and* its own interval. A resumed job's
second line therefore differs from the uninterrupted run's line for the same iteration
although training is bit-identical. :func:`read_log` undoes it: each job's first line
covers its first iteration, the second line's values are recomputed for the iterations
after it (``(A1 * v1 - A0 * v0) / (A1 - A0)``, with A the iterations each line averaged:
losses over the advanced iterations, the elapsed time over all), later lines are as
printed. The result is a list of :class:`Span` (first and last iteration, values), which
:func:`compare` matches between two runs span by span.

Jobs are told apart by Megatron's ``[before the start of training step]`` line (printed
once per job before its first iteration), by a new file, or by an iteration number that
does not increase. Imports nothing from Megatron or torch.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

#: Megatron's per-iteration log line; group 3 is the rest of the line, ``name: value |`` fields.
ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
#: Printed by rank 0 once per job, right before the training loop starts.
JOB_START = "[before the start of training step]"
ELAPSED = "elapsed time per iteration (ms)"
SKIPPED = "number of skipped iterations"
_FIELD_RE = re.compile(r"^\s*([^:|]+?):\s*([-+0-9.eEinfaINF]+)\s*$")


class LogError(ValueError):
    """A log that cannot be read as Megatron's (no iteration line, unreadable file)."""


def is_loss_column(name: str) -> bool:
    """Megatron's loss columns (``lm loss``, ``load_balancing_loss``, ``z_loss``, ``mtp_1 loss``):
    averaged over the interval's advanced iterations."""
    return name.lower().endswith("loss")


def averaged_over_interval(name: str) -> bool:
    """Columns that are means over the iterations since the previous line (and so are
    averaged with a job's first iteration on its second line); the rest (grad norm, learning
    rate, loss scale, ...) are the printed iteration's own values."""
    return is_loss_column(name) or name == ELAPSED


@dataclass(frozen=True)
class Line:
    """One of Megatron's iteration lines: iteration, ``train_iters`` and its numeric fields."""

    iteration: int
    train_iters: int
    values: Dict[str, float]

    @property
    def skipped(self) -> int:
        return int(self.values.get(SKIPPED, 0))


@dataclass(frozen=True)
class Span:
    """Values over iterations ``first..last`` of one job; ``recomputed`` when the printed line
    also averaged the job's first iteration and :func:`read_log` took it out."""

    first: int
    last: int
    job: int
    values: Dict[str, float]
    recomputed: bool = False

    @property
    def label(self) -> str:
        return str(self.last) if self.first == self.last else f"{self.first}-{self.last}"


@dataclass
class TrainingLog:
    """The spans of one run (one or more jobs, in order), and where a job logged an
    iteration that a later job logged again (the later one is kept)."""

    spans: List[Span]
    jobs: List[Tuple[int, int]]            # (first, last) iteration of each job
    overridden: List[int] = field(default_factory=list)

    def columns(self) -> List[str]:
        seen: Dict[str, None] = {}
        for s in self.spans:
            seen.update(dict.fromkeys(s.values))
        return list(seen)

    def by_range(self) -> Dict[Tuple[int, int], Span]:
        return {(s.first, s.last): s for s in self.spans}

    def values(self, column: str = "lm loss") -> Dict[int, float]:
        """``{iteration: value}`` of the single-iteration spans (``--log-interval 1``)."""
        return {s.last: s.values[column] for s in self.spans
                if s.first == s.last and column in s.values}


def parse_line(text: str) -> Optional[Line]:
    """The :class:`Line` in ``text`` (anywhere in it: launcher prefixes are fine), or None."""
    m = ITERATION_RE.search(text)
    if not m:
        return None
    values = {}
    for part in m.group(3).split("|"):
        f = _FIELD_RE.match(part)
        if f:
            try:
                values[f.group(1).strip()] = float(f.group(2))
            except ValueError:
                continue
    return Line(int(m.group(1)), int(m.group(2)), values)


def _jobs(texts: Iterable[str]) -> List[List[Line]]:
    """Iteration lines grouped by job."""
    jobs: List[List[Line]] = []
    for text in texts:
        current: List[Line] = []
        jobs.append(current)
        for raw in text.splitlines():
            if JOB_START in raw:
                if current:
                    current = []
                    jobs.append(current)
                continue
            line = parse_line(raw)
            if line is None:
                continue
            if current and line.iteration <= current[-1].iteration:
                current = []
                jobs.append(current)
            current.append(line)
    return [j for j in jobs if j]


def _recompute(first: Line, second: Line) -> Dict[str, float]:
    """The second line's values over the iterations after the job's first one."""
    n1 = second.iteration - first.iteration + 1         # iterations the second line averaged
    adv1, adv0 = n1 - second.skipped, 1 - first.skipped
    out = dict(second.values)
    for name, v1 in second.values.items():
        if not averaged_over_interval(name):
            continue
        v0 = first.values.get(name, 0.0)                # a loss Megatron left out printed <= 0
        a1, a0 = (adv1, adv0) if is_loss_column(name) else (n1, 1)
        if a1 - a0 > 0:
            out[name] = (a1 * v1 - a0 * v0) / (a1 - a0)
        else:
            del out[name]
    out[SKIPPED] = float(second.skipped - first.skipped)
    return out


def job_spans(lines: Sequence[Line], job: int = 0) -> List[Span]:
    """The spans of one job's lines (see the module docstring)."""
    spans = [Span(lines[0].iteration, lines[0].iteration, job, dict(lines[0].values))]
    for k in range(1, len(lines)):
        prev, line = lines[k - 1], lines[k]
        if k == 1:
            spans.append(Span(prev.iteration + 1, line.iteration, job, _recompute(prev, line), True))
        else:
            spans.append(Span(prev.iteration + 1, line.iteration, job, dict(line.values)))
    return spans


#: how a log's lines cover iterations: ``megatron`` (Megatron-LM's training_log: a job's
#: second line also averages its first iteration) or ``bridge`` (Megatron-Bridge's: every
#: line covers the iterations since the previous one, its accumulators reset at each print)
LOG_FORMATS = ("megatron", "bridge")


def printed_spans(lines: Sequence[Line], job: int = 0) -> List[Span]:
    """The spans of one job whose every line covers the iterations since the previous one
    (Megatron-Bridge's training log): as printed."""
    spans, prev = [], None
    for line in lines:
        first = line.iteration if prev is None else prev.iteration + 1
        spans.append(Span(first, line.iteration, job, dict(line.values)))
        prev = line
    return spans


def read_log(texts, log_format: str = "megatron") -> TrainingLog:
    """A run from the text of its log (or of several, one per job, in order).
    ``log_format``: one of :data:`LOG_FORMATS` (``bridge``: no first-iteration averaging
    to undo)."""
    if log_format not in LOG_FORMATS:
        raise LogError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    if isinstance(texts, str):
        texts = [texts]
    jobs = _jobs(texts)
    if not jobs:
        raise LogError("no Megatron iteration lines ('iteration N/ M | ...')")
    kept: Dict[Tuple[int, int], Span] = {}
    overridden = []
    for j, lines in enumerate(jobs):
        spans = job_spans(lines, j) if log_format == "megatron" else printed_spans(lines, j)
        for span in spans:
            for key in [k for k in kept if k[0] <= span.last and span.first <= k[1]]:
                overridden.extend(range(max(key[0], span.first), min(key[1], span.last) + 1))
                del kept[key]
            kept[(span.first, span.last)] = span
    spans = sorted(kept.values(), key=lambda s: s.first)
    return TrainingLog(spans, [(j[0].iteration, j[-1].iteration) for j in jobs], sorted(set(overridden)))


def read_texts(paths: Sequence[str]) -> List[str]:
    """The text of each log file (a clear :class:`LogError` naming an unreadable one)."""
    texts = []
    for p in paths:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
        except OSError as exc:
            raise LogError(f"{p}: {exc.strerror or exc}") from None
    return texts


def read_log_files(paths: Sequence[str], log_format: str = "megatron") -> TrainingLog:
    texts = read_texts(paths)
    try:
        return read_log(texts, log_format)
    except LogError as exc:
        raise LogError(f"{', '.join(paths)}: {exc}") from None


def relative_difference(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


@dataclass
class Comparison:
    """Span-by-span differences of two runs."""

    columns: List[str]
    rows: List[Tuple[str, Dict[str, Tuple[float, float, float]]]]   # (span label, {column: (a, b, rel)})
    only_a: List[str]
    only_b: List[str]
    rtol: float

    @property
    def max_rel(self) -> float:
        return max((d[2] for _, row in self.rows for d in row.values()), default=0.0)

    @property
    def equal(self) -> bool:
        return bool(self.rows) and self.max_rel <= self.rtol


def compare(a: TrainingLog, b: TrainingLog, columns: Optional[Sequence[str]] = None,
            rtol: float = 1e-5) -> Comparison:
    """Compare the spans both runs have (same first and last iteration), column by column:
    ``columns``, or else every loss column both logs print."""
    if columns is None:
        in_b = set(b.columns())
        columns = [c for c in a.columns() if is_loss_column(c) and c in in_b]
    ra, rb = a.by_range(), b.by_range()
    rows, only_a, only_b = [], [ra[k].label for k in sorted(set(ra) - set(rb))], \
        [rb[k].label for k in sorted(set(rb) - set(ra))]
    for key in sorted(set(ra) & set(rb)):
        row = {}
        for c in columns:
            va, vb = ra[key].values.get(c), rb[key].values.get(c)
            if va is not None and vb is not None:
                row[c] = (va, vb, relative_difference(va, vb))
            elif va is not None:
                only_a.append(f"{ra[key].label} ({c})")
            elif vb is not None:
                only_b.append(f"{rb[key].label} ({c})")
        if row:
            rows.append((ra[key].label, row))
    return Comparison(list(columns), rows, only_a, only_b, rtol)


def describe(log: TrainingLog) -> str:
    jobs = ", ".join(f"{f}-{l}" if f != l else str(f) for f, l in log.jobs)
    return f"{len(log.jobs)} job{'s' if len(log.jobs) != 1 else ''} (iterations {jobs})"


def report(a_name: str, a: TrainingLog, b_name: str, b: TrainingLog, cmp: Comparison) -> str:
    """The text ``mm-balance compare-logs`` prints."""
    out = [f"A: {a_name}: {describe(a)}", f"B: {b_name}: {describe(b)}"]
    recomputed = [f"{name} {s.label}" for name, log in (("A", a), ("B", b)) for s in log.spans if s.recomputed]
    if recomputed:
        out.append("Megatron averages each job's first iteration into its second log line "
                   "(training_log does not reset after a job's first iteration); recomputed for "
                   + ", ".join(recomputed))
    for name, log in (("A", a), ("B", b)):
        if log.overridden:
            out.append(f"{name}: iterations {log.overridden[0]}-{log.overridden[-1]} logged again by a "
                       "later job; the later lines are used")
    width = {c: max(14, len(c) + 2) for c in cmp.columns}
    head = f"{'iteration':>10}"
    for c in cmp.columns:
        head += f" | {c + ' A':>{width[c]}} {c + ' B':>{width[c]}} {'rel diff':>9}"
    out.append(head)
    for label, row in cmp.rows:
        line = f"{label:>10}"
        for c in cmp.columns:
            w = width[c]
            if c in row:
                va, vb, rel = row[c]
                line += f" | {va:>{w}.6E} {vb:>{w}.6E} {rel:>9.2e}"
            else:
                line += f" | {'-':>{w}} {'-':>{w}} {'-':>9}"
        out.append(line)
    for name, only in (("A", cmp.only_a), ("B", cmp.only_b)):
        if only:
            out.append(f"only in {name} (not compared): {', '.join(only)}")
    if not cmp.rows:
        out.append("no iteration logged by both runs over the same iterations: not equal")
    else:
        verdict = "equal" if cmp.equal else "DIFFERENT"
        out.append(f"{len(cmp.rows)} iteration(s) compared ({', '.join(cmp.columns) or 'no common column'}): "
                   f"max relative difference {cmp.max_rel:.3g}, tolerance {cmp.rtol:g}: {verdict}")
    return "\n".join(out)
