"""What the solver benchmarks in ``benchmarks/`` share: a mixture packed into the simulator's
pool, its packs' costs, the ``DxG`` shapes of the command lines, and the tables' heads."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

#: the packed sequence length of every solver benchmark
SEQ_LEN = 8192
#: the timing model whose (vision, language) microseconds are the two-phase costs
TIMING = "vlm_30b_moe"


def mixture_pool(trace: str, samples: Optional[int] = None, *, seed: int = 0, first: Optional[int] = None,
                 seq_len: int = SEQ_LEN):
    """A built-in mixture (``samples`` of it; ``mixed`` is always its whole self) or a trace
    file, its ``first`` samples when given, packed 1D greedy into a
    :class:`~megatron_mm_balance.sim.pool.PackPool` (cached per process)."""
    from ..sim.cli import load_samples
    from ..sim.pool import build_pool
    data, key, _ = load_samples(trace, samples=samples, seed=seed)
    if first is not None:
        data = data[:first]
    return build_pool(data, seq_len, cache_key=(*key, first))


def image_token_costs(pool) -> np.ndarray:
    """``[P]`` int64: each pack's image tokens."""
    return pool.image_tokens.astype(np.int64)


def two_phase_costs(pool, timing: str = TIMING) -> np.ndarray:
    """``[P, 2]``: each pack's vision and language microseconds under ``timing``, as the
    simulator's two-phase balance cost."""
    from ..sim.engine import pack_phases
    from ..sim.timing import load_timing
    return pack_phases(pool, load_timing(timing), balance_cost="two-phase").cost


def parse_shapes(text: str) -> List[Tuple[int, int]]:
    """``"64x16,512x16"`` -> ``[(64, 16), (512, 16)]``."""
    out = []
    for spec in text.split(","):
        try:
            d, g = (int(x) for x in spec.strip().split("x"))
        except ValueError:
            raise ValueError(f"a shape is DPxGA, e.g. 64x16; got {spec!r}") from None
        out.append((d, g))
    return out


def print_head(head: str) -> None:
    """A table's head and its rule."""
    print(head)
    print("-" * len(head))
