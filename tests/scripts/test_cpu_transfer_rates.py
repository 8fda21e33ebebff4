"""benchmarks/bench_cpu_transfer_rates.py: the pack swap runs through the exchange's transport."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_pack_swap_reports_a_swap_of_real_packs(monkeypatch, capfd):
    monkeypatch.syspath_prepend(str(BENCHMARKS))        # spawned ranks import the script by name
    mod = importlib.import_module("bench_cpu_transfer_rates")
    mod.pack_swap(patches=64, repeats=3)
    out = capfd.readouterr().out
    m = re.search(r"pack swap, 64 fp32 patches \(0\.4 MB each way\): median ([0-9.]+) ms "
                  r"\[([0-9.]+)-([0-9.]+)\] over 3", out)
    assert m, out
    low, median, high = float(m.group(2)), float(m.group(1)), float(m.group(3))
    assert 0 < low <= median <= high
