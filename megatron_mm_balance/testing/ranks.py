"""Run a test script once per rank as real processes and collect each rank's JSON result.

The script is started as ``python SCRIPT RANK WORLD PORT OUTDIR`` for every rank (the
caller's ``PYTHONPATH`` plus this repository, one OpenMP thread); each rank writes
``OUTDIR/rank<R>.json``. A rank that wrote nothing reports ``{"error": <its last output>}``;
at ``timeout`` every rank is killed, so a hung collective fails the test instead of
stalling it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..bench.runtime import free_port

REPO = Path(__file__).resolve().parents[2]


def run_rank_script(script: str, world: int, *, timeout: float = 120.0, python: str = sys.executable,
                    pythonpath: tuple = ()) -> list:
    """Each rank's result dict, in rank order (see the module docstring); ``python`` runs the
    ranks, ``pythonpath`` goes before this repository on their ``PYTHONPATH``."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = [*map(str, pythonpath), str(REPO), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([python, script, str(r), str(world), str(port), tmp], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0] + "\n(killed: timeout)")
        out = []
        for r, log in enumerate(logs):
            path = os.path.join(tmp, f"rank{r}.json")
            out.append(json.load(open(path)) if os.path.exists(path) else {"error": log[-3000:]})
        return out
