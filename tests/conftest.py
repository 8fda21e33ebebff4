"""Shared test settings: hypothesis profile sized for a 2-core CI machine."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=int(os.environ.get("MM_BALANCE_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")
