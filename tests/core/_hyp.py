"""Hypothesis settings for the core property tests: 2,000 seeded (derandomized) examples each, no deadline.

Registered as the `ci` profile too, so `--hypothesis-profile=ci` selects the same settings everywhere.
"""

from hypothesis import HealthCheck, settings

CI = settings(max_examples=2000, derandomize=True, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", CI)
