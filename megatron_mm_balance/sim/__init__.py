"""Simulator: what image-token imbalance costs at scale, and what each fix recovers.

Modules: :mod:`.timing` (timing model files), :mod:`.pool` (a trace packed once,
per-pack features, seeded resampling), :mod:`.strategies` (none, budget, local,
redistribute), :mod:`.timeline` (the step timeline and its waits),
:mod:`.engine` (runs and their metrics), :mod:`.report`, :mod:`.plots`,
:mod:`.cli` (``mm-balance simulate``). Pure numpy; matplotlib only for plots.
"""
from .timeline import simulate_timeline
from .timing import TimingModel, TimingError, load_timing

__all__ = ["simulate_timeline", "TimingModel", "TimingError", "load_timing"]
