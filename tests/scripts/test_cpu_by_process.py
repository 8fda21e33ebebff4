"""``benchmarks/cpu_by_process.py``: a command's CPU by process, its kernel share and page
faults, read from /proc while it runs (the bench's host-side accounting,
docs/notes/2026-12-04-host-side-as-gpu-node.md)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_by_process.py"


def test_a_busy_child_is_counted_and_the_exit_status_kept():
    busy = ("import time\nt=time.process_time()\nbuf=[]\n"
            "while time.process_time()-t<2.5:\n    buf.append(bytearray(1<<20)); buf=buf[-8:]\n"
            "raise SystemExit(3)\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--", sys.executable, "-c", busy],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("other ")]
    assert rows, r.stdout
    cpu = max(float(row[3]) for row in rows)
    faults = max(int(row[5].replace(",", "")) for row in rows)
    assert 1.5 <= cpu <= 4.0, r.stdout                 # its 2.5 s of CPU, read at 1 s steps
    assert faults > 1000, r.stdout                     # fresh megabytes touched page by page
    peak = max(float(row[7].replace(",", "")) for row in rows)
    assert 8 <= peak <= 1024, r.stdout                 # its 8 live MiB and the interpreter
    assert "by role: other" in r.stdout


def test_refuses_without_a_command():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "cpu_by_process.py --" in r.stderr
