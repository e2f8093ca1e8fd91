"""Every bad argument of mfa_native.attention raises a clear TypeError or ValueError naming it."""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16

import mfa_native


def arrays(B=1, Hq=4, Hkv=2, R=8, C=12, D=16, Dv=16, dtype=np.float32):
    rng = np.random.default_rng()
    return (rng.standard_normal((B, Hq, R, D)).astype(dtype), rng.standard_normal((B, Hkv, C, D)).astype(dtype),
            rng.standard_normal((B, Hkv, C, Dv)).astype(dtype))


def call(q=None, k=None, v=None, **kwargs):
    dq, dk, dv = arrays()
    return mfa_native.attention(dq if q is None else q, dk if k is None else k, dv if v is None else v, **kwargs)


q0, k0, v0 = arrays()

BAD_ARGUMENTS = [
    # (arguments, exception, words the message must contain)
    (dict(q=q0[0]), ValueError, ["q", "4 dimensions"]),
    (dict(k=k0[..., :8]), ValueError, ["k's head dimension", "8", "16"]),
    (dict(k=np.concatenate([k0, k0])), ValueError, ["batch"]),
    (dict(v=v0[:, :, :5]), ValueError, ["v", "length"]),
    (dict(v=v0[:, :1]), ValueError, ["v", "heads"]),
    (dict(k=arrays(Hkv=3)[1], v=arrays(Hkv=3)[2]), ValueError, ["multiple", "4", "3"]),
    (dict(q=arrays(D=600)[0], k=arrays(D=600)[1]), ValueError, ["D", "600", "1..576"]),
    (dict(v=arrays(Dv=577)[2]), ValueError, ["Dv", "577", "1..576"]),
    (dict(k=k0.astype(np.float16)), TypeError, ["k", "float16", "q", "float32"]),
    (dict(v=v0.astype(bfloat16)), TypeError, ["v", "bfloat16"]),
    (dict(q=q0.astype(np.float64), k=k0.astype(np.float64), v=v0.astype(np.float64)), TypeError, ["q", "float64"]),
    (dict(q=q0.astype(np.int32), k=k0.astype(np.int32), v=v0.astype(np.int32)), TypeError, ["q", "int32"]),
    (dict(q=q0.tolist()), TypeError, ["q", "numpy", "list"]),
    (dict(layout="sbhd"), ValueError, ["layout", "sbhd"]),
    (dict(causal="yes"), ValueError, ["causal", "yes"]),
    (dict(causal=1), ValueError, ["causal"]),
    (dict(mask=np.ones((8, 5), bool)), ValueError, ["mask", "(8, 5)", "broadcast"]),
    (dict(mask=np.ones((2, 1, 1, 8, 12), bool)), ValueError, ["mask", "broadcast"]),
    (dict(mask=np.ones((8, 12), np.int8)), TypeError, ["mask", "int8"]),
    (dict(mask=[[True]]), TypeError, ["mask", "list"]),
    (dict(window=3), ValueError, ["window", "pair"]),
    (dict(window=(1, 2, 3)), ValueError, ["window", "pair"]),
    (dict(window=(1.5, 0)), TypeError, ["window left", "1.5"]),
    (dict(window=(0, True)), TypeError, ["window right"]),
    (dict(window=(-2, 0)), ValueError, ["window left", "-2"]),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, ["sinks", "(4,)", "(3,)"]),
    (dict(sinks=np.zeros((1, 4), np.float32)), ValueError, ["sinks", "(4,)"]),
    (dict(sinks=np.zeros(4, np.int64)), TypeError, ["sinks", "int64"]),
    (dict(scale="0.1"), TypeError, ["scale", "str"]),
    (dict(scale=True), TypeError, ["scale"]),
    (dict(scale=float("nan")), ValueError, ["scale", "finite"]),
    (dict(scale=1e300), ValueError, ["scale", "float32"]),     # scale * log2(e) overflows float32
    (dict(return_lse="yes"), TypeError, ["return_lse"]),
    (dict(device="gpu"), ValueError, ["device", "gpu"]),
    (dict(device=3), TypeError, ["device"]),
]


@pytest.mark.parametrize("kwargs, error, words", BAD_ARGUMENTS,
                         ids=[f"{i}-{'-'.join(a)}" for i, (a, _, _) in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_raise_naming_the_problem(kwargs, error, words):
    with pytest.raises(error) as raised:
        call(**kwargs)
    message = str(raised.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_bshd_shapes_are_checked_in_their_own_axis_order():
    q, k, v = arrays()
    swap = (0, 2, 1, 3)
    out = mfa_native.attention(q.transpose(swap), k.transpose(swap), v.transpose(swap), layout="bshd")
    assert out.shape == (1, 8, 4, 16)
    with pytest.raises(ValueError, match="v must have k's heads and length"):
        mfa_native.attention(q.transpose(swap), k, v.transpose(swap), layout="bshd")  # k left in bhsd order
