"""The same bad calls through Python's mfa_native.attention / attention_backward and through the
C++ API (mfa::attention / attention_backward, by _core's test hooks, on a bundle): the same
exception class (ValueError / TypeError) and the same message, word for word. The C++ side
takes float32 sinks, slopes and score_mod tensors only (Python converts other float dtypes),
so those dtypes are not compared."""

from __future__ import annotations

import numpy as np
import pytest

import mfa_native
from mfa_native import _core

from conftest import poison
from test_bundle_cpp import bundle, cpp_options, payload, view  # noqa: F401 (the fixtures)

B, HQ, HKV, R, C, D = 1, 2, 1, 4, 6, 16   # FAMILIES[0]: float32, D 16, GQA 2, lower right, sinks


def _arrays(rng):
    q = rng.standard_normal((B, HQ, R, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, C, D)).astype(np.float32) for _ in "kv")
    return dict(q=q, k=k, v=v)


FORWARD_CASES = {   # what changes from a good call: arrays, then options
    "q dtype": (dict(q=lambda a: a["q"].astype(np.int32)), {}),
    "k dtype": (dict(k=lambda a: a["k"].astype(np.float16)), {}),
    "q rank": (dict(q=lambda a: a["q"][0]), {}),
    "batch": (dict(k=lambda a: np.concatenate([a["k"], a["k"]])), {}),
    "head dim": (dict(k=lambda a: a["k"][..., :8].copy()), {}),
    "v heads": (dict(v=lambda a: a["v"][:, :, :3].copy()), {}),
    "gqa": (dict(k=lambda a: np.zeros((B, 3, C, D), np.float32), v=lambda a: np.zeros((B, 3, C, D), np.float32)),
            {}),
    "head dim 600": (dict(q=lambda a: np.zeros((1, 1, 1, 600), np.float32),
                          k=lambda a: np.zeros((1, 1, 1, 600), np.float32),
                          v=lambda a: np.zeros((1, 1, 1, 600), np.float32)), {}),
    "scale inf": ({}, dict(scale=float("inf"))),
    "scale huge": ({}, dict(scale=1e39)),
    "softcap": ({}, dict(softcap=-1.5)),
    "window": ({}, dict(window=(-3, 0))),
    "mask dtype": ({}, dict(mask=np.ones((R, C), np.int32))),
    "mask shape": ({}, dict(mask=np.ones((3, C), bool))),
    "sinks shape": ({}, dict(sinks=np.zeros(3, np.float32))),
    "alibi shape": ({}, dict(alibi_slopes=np.zeros(3, np.float32))),
    "score_mod_tensors alone": ({}, dict(score_mod_tensors=[np.zeros(2, np.float32)])),
    # The declaration's rules (ops/attention_rules.py) the C++ binder reads from the bundle.
    "v dtype": (dict(v=lambda a: a["v"].astype(np.float16)), {}),
    "k rank": (dict(k=lambda a: a["k"][0]), {}),
    "q rank bshd": (dict(q=lambda a: a["q"][0]), dict(layout="bshd")),
    "v length": (dict(v=lambda a: a["v"][:, :, :4].copy()), {}),
    "head dim 0": (dict(q=lambda a: a["q"][..., :0].copy(), k=lambda a: a["k"][..., :0].copy()), {}),
    "mask rank 5": ({}, dict(mask=np.ones((1, 1, 1, R, C), bool))),
    "mask float broadcast": ({}, dict(mask=np.zeros((HQ + 1, 1, C), np.float32))),
    "sinks rank": ({}, dict(sinks=np.zeros((1, HQ), np.float32))),
    "alibi per batch": ({}, dict(alibi_slopes=np.zeros((B + 1, HQ), np.float32))),
}


def _outcome(call) -> tuple[type, str] | None:
    try:
        call()
    except (ValueError, TypeError) as error:
        return (ValueError if isinstance(error, ValueError) else TypeError), str(error)
    return None


@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
def test_forward_refusals_are_pythons(bundle, case, rng):
    arrays = _arrays(rng)
    changes, options = FORWARD_CASES[case]
    arrays.update({name: change(arrays) for name, change in changes.items()})
    options = {"causal": True, **options}
    python = _outcome(lambda: mfa_native.attention(**arrays, **options, device="cpu"))
    out = poison((*arrays["q"].shape[:3], arrays["v"].shape[-1]), np.float32)
    before = out.tobytes()
    cpp = _outcome(lambda: _core._bundle_attention("cpu", bundle, *(view(arrays[n]) for n in "qkv"), view(out),
                                                   **cpp_options(options)))
    assert python is not None and cpp == python
    assert out.tobytes() == before   # refused before anything is written


BACKWARD_CASES = {
    "o dtype": ("o", lambda o: o.astype(np.float16)),
    "o shape": ("o", lambda o: o[:, :, :2].copy()),
    "do shape": ("do", lambda o: o[..., :8].copy()),
    "lse dtype": ("lse", lambda lse: lse.astype(np.float16)),
    "lse shape": ("lse", lambda lse: lse[:, :1].copy()),
    "do dtype": ("do", lambda o: o.astype(np.float16)),
    "o rank": ("o", lambda o: o[0]),
}


@pytest.mark.parametrize("case", sorted(BACKWARD_CASES))
def test_backward_refusals_are_pythons(bundle, case, rng):
    arrays = _arrays(rng)
    o, lse = mfa_native.attention(**arrays, causal=True, return_lse=True, device="cpu")
    given = dict(o=o, lse=lse, do=rng.standard_normal(o.shape).astype(np.float32))
    name, change = BACKWARD_CASES[case]
    given[name] = change(given[name])
    python = _outcome(lambda: mfa_native.attention_backward(**arrays, **given, causal=True, device="cpu"))
    grads = [poison(arrays[n].shape, np.float32) for n in "qkv"]
    before = [g.tobytes() for g in grads]
    cpp = _outcome(lambda: _core._bundle_attention_backward(
        "cpu", bundle, *(view(arrays[n]) for n in "qkv"), view(given["o"]), view(given["lse"]), view(given["do"]),
        *map(view, grads), causal="lower_right"))
    assert python is not None and cpp == python
    assert [g.tobytes() for g in grads] == before   # refused before anything is written
