"""What the tests of ``benchmarks/`` scripts share: a script loaded as a module, and a timing
directory written as the timing hooks write one (``timing-rank*.jsonl``, read by
``megatron_mm_balance.sim.run_trace.load_run``)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def load_benchmark():
    """``load_benchmark(name)``: ``benchmarks/<name>.py`` as a module."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load


@pytest.fixture
def write_timing():
    """``write_timing(directory, {rank: [fields of each record]})``: one record per entry, the
    fields every record carries filled in (zero times, no images) where not given."""
    def write(directory: Path, records_by_rank: dict) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        for rank, records in records_by_rank.items():
            full = [dict(dict(rank=rank, images=[], lengths=[1024], vision_forward_ms=0.0,
                              vision_backward_ms=0.0, lm_forward_ms=0.0, lm_backward_ms=0.0), **r)
                    for r in records]
            (directory / f"timing-rank{rank:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full))
        return directory
    return write
