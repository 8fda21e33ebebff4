"""The fast stable sorts give exactly numpy's stable permutations (ties by index)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mm_balance.solver.sorting import lex_argsort, stable_argsort


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(1, 3), st.sampled_from([1, 7, 1 << 20, 1 << 40]),
       st.integers(0, 2**31 - 1))
def test_lex_argsort_equals_numpy_lexsort(n, nkeys, scale, seed):
    rng = np.random.default_rng(seed)
    keys = [rng.integers(-6, 6, n) * scale for _ in range(nkeys)]
    assert np.array_equal(lex_argsort(keys), np.lexsort(keys))
    assert np.array_equal(stable_argsort(keys[0]), np.argsort(keys[0], kind="stable"))


def test_wide_keys_fall_back_to_the_stable_sort():
    # the composite would not fit in an int64: numpy's lexsort decides
    k = np.array([2**62, -(2**62), 0, 2**62, 5], dtype=np.int64)
    assert np.array_equal(stable_argsort(k), np.argsort(k, kind="stable"))
    big = np.random.default_rng(0).integers(0, 2**40, 5000)
    assert np.array_equal(lex_argsort((big, big[::-1])), np.lexsort((big, big[::-1])))
