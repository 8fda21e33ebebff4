"""The ``[mm-balance] iteration N | field: value | ...`` log line: written by
:func:`format_line` (the Megatron-LM and Bridge glue's telemetry) and read back by
:func:`read_lines`, the one reader of it (compare-logs' control check, bench-realpath,
scripts/gpu_check.py, the tests). Pure text; knows nothing of torch or Megatron.
"""
from __future__ import annotations

import re
import sys
from typing import Dict, Iterator, Optional, TextIO, Tuple


def emit_line(line: str, stream: Optional[TextIO] = None) -> None:
    """Write ``line`` and its newline to ``stream`` (stdout by default) in one write, then
    flush. Every rank of a job shares the launcher's stdout and stderr; ``print`` writes a
    line and its newline separately, and with unbuffered output another rank's line can land
    between the two and glue itself onto ours, so a reader looking for our lines at the
    start of a line misses one (seen in a fault run: rank 2's stop line after rank 3's, before
    rank 3's newline)."""
    stream = sys.stdout if stream is None else stream
    stream.write(line + "\n")
    stream.flush()


def format_line(iteration: int, summary: Dict[str, float], chunk: int = 0) -> str:
    """The line of ``summary``'s figures (6 significant digits) at ``iteration``; a model
    chunk other than the first says which."""
    parts = [f"{k}: {v:.6g}" for k, v in summary.items()]
    where = f" chunk {chunk}" if chunk else ""
    return f"[mm-balance] iteration {iteration}{where} | " + " | ".join(parts)


#: a line :func:`format_line` wrote: iteration, `` chunk N`` or nothing, the fields. Not
#: anchored at the line's start: our line goes out in one write, but another rank's
#: ``print`` writes its text and its newline separately, and ours can land between the two
#: (seen in CI: iteration 2's line behind another rank's text, lost to a reader anchored at ^)
LINE_RE = re.compile(r"\[mm-balance\] iteration (\d+)(?: chunk (\d+))? \|(.*)$", re.M)
#: a field's figure: its leading number
_NUMBER_RE = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan)")


def read_lines(text: str) -> Iterator[Tuple[int, int, Dict[str, float]]]:
    """``(iteration, chunk, {field: figure})`` of every line :func:`format_line` wrote in
    ``text`` (a log), in order: the one reader of those lines (compare-logs' control check,
    bench-realpath, the tests). A figure is its field's leading number, so that another
    rank's output glued onto the line's end or start (ranks share the launcher's stdout)
    does not change it; fields without a number (``note: ...``) are left out."""
    for m in LINE_RE.finditer(text):
        fields = {}
        for part in m.group(3).split("|"):
            name, sep, value = part.partition(":")
            number = _NUMBER_RE.match(value) if sep else None
            if number:
                fields[name.strip()] = float(number.group(1))
        yield int(m.group(1)), int(m.group(2) or 0), fields
