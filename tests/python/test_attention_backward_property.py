"""Property: for any valid problem hypothesis draws, the backward kernels match the float64 gradients."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_attention_backward import check
from test_attention_property import problems


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problems(), st.integers(0, 2**32 - 1))
def test_random_valid_problems_match_the_reference(problem, seed):
    q, k, v, kwargs = problem
    check(np.random.default_rng(seed), q, k, v, **kwargs)
