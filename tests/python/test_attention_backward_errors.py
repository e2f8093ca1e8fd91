"""Every bad argument of mfa_native.attention_backward raises a clear TypeError or ValueError naming it."""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16

import mfa_native

B, HQ, HKV, R, C, D, DV = 1, 4, 2, 8, 12, 16, 8


def arrays(dtype=np.float32, **changes):
    """Valid q, k, v, o, lse, do of the sizes above (one size changed where asked)."""
    rng = np.random.default_rng()
    sizes = {**dict(B=B, Hq=HQ, Hkv=HKV, R=R, C=C, D=D, Dv=DV), **changes}
    b, hq, hkv, r, c, d, dv = sizes.values()
    shapes = dict(q=(b, hq, r, d), k=(b, hkv, c, d), v=(b, hkv, c, dv), o=(b, hq, r, dv), lse=(b, hq, r),
                  do=(b, hq, r, dv))
    return {name: rng.standard_normal(shape).astype(np.float32 if name == "lse" else dtype)
            for name, shape in shapes.items()}


def call(**kwargs):
    tensors = arrays()
    for name in list(tensors):
        if name in kwargs:
            tensors[name] = kwargs.pop(name)
    return mfa_native.attention_backward(*tensors.values(), **kwargs)


good = arrays()

BAD_ARGUMENTS = [
    # (arguments, exception, words the message must contain)
    (dict(o=good["o"][..., :4]), ValueError, ["o", "output shape", "(1, 4, 8, 8)", "(1, 4, 8, 4)"]),
    (dict(o=good["o"][0]), ValueError, ["o", "output shape"]),
    (dict(o=good["o"].astype(np.float16)), TypeError, ["o", "float16", "q", "float32"]),
    (dict(o=good["o"].tolist()), TypeError, ["o", "numpy", "list"]),
    (dict(do=good["do"][:, :2]), ValueError, ["do", "output shape", "(1, 2, 8, 8)"]),
    (dict(do=good["do"].astype(bfloat16)), TypeError, ["do", "bfloat16"]),
    (dict(do=None), TypeError, ["do", "NoneType"]),
    (dict(lse=good["lse"][:, :, :5]), ValueError, ["lse", "(B, Hq, R)", "(1, 4, 8)", "(1, 4, 5)"]),
    (dict(lse=good["lse"][..., None]), ValueError, ["lse", "(1, 4, 8)"]),
    (dict(lse=good["lse"].astype(np.float64)), TypeError, ["lse", "float32", "float64", "return_lse"]),
    (dict(lse=good["lse"].tolist()), TypeError, ["lse", "numpy", "list"]),
    # The checks shared with attention.
    (dict(q=good["q"][..., :8]), ValueError, ["k's head dimension", "8", "16"]),
    (dict(k=arrays(Hkv=3)["k"], v=arrays(Hkv=3)["v"]), ValueError, ["multiple", "4", "3"]),
    (dict(v=good["v"].astype(np.float16)), TypeError, ["v", "float16", "q", "float32"]),
    (dict(layout="sbhd"), ValueError, ["layout", "sbhd"]),
    (dict(causal="yes"), ValueError, ["causal", "yes"]),
    (dict(mask=np.ones((8, 5), bool)), ValueError, ["mask", "(8, 5)", "broadcast"]),
    (dict(window=(1, 2, 3)), ValueError, ["window", "pair"]),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, ["sinks", "(4,)", "(3,)"]),
    (dict(scale="0.1"), TypeError, ["scale", "str"]),
    (dict(device="gpu"), ValueError, ["device", "gpu"]),
]


@pytest.mark.parametrize("kwargs, error, words", BAD_ARGUMENTS,
                         ids=[f"{i}-{'-'.join(a)}" for i, (a, _, _) in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_raise_naming_the_problem(kwargs, error, words):
    with pytest.raises(error) as raised:
        call(**kwargs)
    message = str(raised.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_bshd_outputs_are_checked_in_their_own_axis_order():
    swap = (0, 2, 1, 3)
    tensors = {name: x.transpose(swap) if x.ndim == 4 else x for name, x in arrays().items()}
    grads = mfa_native.attention_backward(*tensors.values(), layout="bshd")
    assert [g.shape for g in grads] == [(B, R, HQ, D), (B, C, HKV, D), (B, C, HKV, DV)]
    tensors["o"] = arrays()["o"]  # left in bhsd order
    with pytest.raises(ValueError, match=r"o must have attention's output shape \(B, R, Hq, Dv\)"):
        mfa_native.attention_backward(*tensors.values(), layout="bshd")
