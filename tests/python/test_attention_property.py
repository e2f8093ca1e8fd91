"""Property: for any valid problem hypothesis draws, the kernel matches the float64 reference."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import DTYPES, check


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(list(DTYPES)))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    kv_heads = draw(st.integers(1, 2))
    q_heads = kv_heads * draw(st.integers(1, 3))
    batch = draw(st.integers(1, 2))
    q_len, kv_len = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    # A few head dimensions and flag values, so that examples share compiled kernels.
    head_dim = draw(st.sampled_from([8, 20, 64]))
    value_dim = draw(st.sampled_from([head_dim, 12]))
    kwargs = dict(
        causal=draw(st.sampled_from([False, True, "upper_left"])),
        window=draw(st.sampled_from([None, (3, 0), (-1, 2)])),
        layout=layout,
    )
    mask_kind = draw(st.sampled_from([None, "bool", "additive"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if mask_kind is not None:
        # Any shape that broadcasts to (B, Hq, R, C): each axis full or 1, leading axes optional.
        full = (batch, q_heads, q_len, kv_len)
        shape = tuple(n if draw(st.booleans()) else 1 for n in full)[draw(st.integers(0, 2)):]
        kwargs["mask"] = rng.random(shape) > 0.3 if mask_kind == "bool" else \
            np.where(rng.random(shape) > 0.2, rng.standard_normal(shape), -np.inf).astype(np.float32)
    if draw(st.booleans()):
        kwargs["sinks"] = rng.standard_normal(q_heads).astype(np.float32)

    def tensor(heads, length, dim):
        shape = (batch, heads, length, dim) if layout == "bhsd" else (batch, length, heads, dim)
        return rng.standard_normal(shape).astype(DTYPES[dtype])

    return (tensor(q_heads, q_len, head_dim), tensor(kv_heads, kv_len, head_dim),
            tensor(kv_heads, kv_len, value_dim), kwargs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problems())
def test_random_valid_problems_match_the_reference(problem):
    q, k, v, kwargs = problem
    check(q, k, v, **kwargs)
