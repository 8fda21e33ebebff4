"""Emulated-straggler benchmark of the balanced iterator (same as ``mm-balance bench-runtime``).

    python benchmarks/bench_runtime.py --world 8 --microbatches 8 --batches 10
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mm_balance.bench.runtime import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
