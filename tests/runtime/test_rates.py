"""Rates a run measures for itself (runtime/rates.py): per-rank medians, the header's
integers, and the one value every rank agrees on."""
import time

from megatron_mm_balance.runtime.rates import (LINK_UNIT, RateMeter, RateWindow, agreed_rate,
                                               header_value)


def test_a_window_keeps_the_median_of_its_last_samples():
    w = RateWindow(size=3, min_amount=100)
    assert w.rate() is None
    w.add(50, 1.0)                                    # under min_amount: a latency, not a rate
    w.add(100, 0.0)                                   # no time: no sample
    assert w.rate() is None
    for amount in (1000, 3000, 2000, 9000):           # the first falls out of the window
        w.add(amount, 1.0)
    assert w.rate() == 3000.0


def test_header_integers_and_the_agreed_value():
    assert header_value(None, LINK_UNIT) == 0 and header_value(0.0, LINK_UNIT) == 0
    assert header_value(1.6e9, LINK_UNIT) == 1600
    assert header_value(1.0, LINK_UNIT) == 1             # any positive rate is reported
    # the median of the ranks that measured, whatever order the values arrive in
    assert agreed_rate([1600, 0, 1400, 2000], LINK_UNIT, 25e9) == 1600 * LINK_UNIT
    assert agreed_rate([2000, 1400, 0, 1600], LINK_UNIT, 25e9) == 1600 * LINK_UNIT
    assert agreed_rate([1000, 2000], LINK_UNIT, 25e9) == 1500 * LINK_UNIT
    assert agreed_rate([0, 0], LINK_UNIT, 25e9) == 25e9   # none measured: the prior


def test_a_cpu_stretch_is_timed_at_once():
    meter, w = RateMeter("cpu"), RateWindow()
    token = meter.start()
    time.sleep(0.02)
    meter.stop(token, 1000.0, w)
    assert 0 < w.rate() <= 1000.0 / 0.02             # amount over at least the time slept
    meter.poll()                                      # nothing pending on CPU
    assert len(w.samples) == 1
