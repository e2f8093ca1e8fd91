"""flash-attn's dense functions by its names (mfa_native.torch.flash_attn_func, _kvpacked_func,
_qkvpacked_func, and the varlen packed forms): flash-attn's signatures and defaults, its (B, S, H, D) layout, bottom-right
causal and window_size, GQA, test_flash_attn_output's softcap (0.0: none; 50.0) and ALiBi slopes,
and gradients (through the packed tensors' views too), against the float64 reference; what it has and mfa_native does not is refused by name."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from conftest import relative_l2
from mfa_native.reference import attention_backward_reference, attention_reference

torch = pytest.importorskip("torch")
from mfa_native.torch import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, \
    flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func  # noqa: E402

# flash-attn 2.8's signatures (flash_attn/flash_attn_interface.py), parameter names and defaults
FLASH_ATTN = {
    "flash_attn_func": "q k v dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 "
                       "alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_kvpacked_func": "q kv dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) "
                                "softcap=0.0 alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_qkvpacked_func": "qkv dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) "
                                 "softcap=0.0 alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_varlen_kvpacked_func": "q kv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p=0.0 "
                                       "softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 "
                                       "alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_varlen_qkvpacked_func": "qkv cu_seqlens max_seqlen dropout_p=0.0 softmax_scale=None causal=False "
                                        "window_size=(-1, -1) softcap=0.0 alibi_slopes=None deterministic=False "
                                        "return_attn_probs=False",
}
FUNCTIONS = {f.__name__: f for f in (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                     flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN))
def test_signatures_are_flash_attns(name):
    parameters = inspect.signature(FUNCTIONS[name]).parameters.values()
    shown = " ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in parameters)
    assert shown == FLASH_ATTN[name]


CASES = [  # (packing, B, Sq, Sk, Hq, Hkv, D, options)
    ("none", 2, 9, 13, 4, 2, 16, dict(causal=True)),
    ("none", 1, 12, 7, 2, 1, 8, dict(causal=True, window_size=(3, 2), softmax_scale=0.3)),
    ("none", 1, 6, 11, 4, 4, 32, dict(window_size=(2, 1))),
    ("kv", 2, 5, 14, 4, 2, 16, dict(causal=True, window_size=(4, -1))),
    ("qkv", 1, 10, 10, 2, 2, 8, dict(causal=True)),
    ("qkv", 2, 7, 7, 3, 3, 16, dict(softmax_scale=0.5, deterministic=True)),
    # test_flash_attn_output's softcap (0.0, 50.0) and alibi (slopes rand * 0.3, (B, Hq))
    ("none", 2, 8, 12, 4, 2, 16, dict(causal=True, softcap=50.0, alibi=True)),
    ("kv", 1, 9, 9, 2, 1, 32, dict(window_size=(3, 3), softcap=0.0, alibi=True)),
    ("qkv", 2, 6, 6, 2, 2, 8, dict(softcap=50.0, softmax_scale=8.0)),   # scores past the cap
]


def _window(options):
    left, right = options.get("window_size", (-1, -1))
    return None if (left, right) == (-1, -1) else (left, right)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}x{c[3]}-{'-'.join(c[7])}")
def test_results_and_gradients_equal_the_reference(rng, case, dtype):
    packing, B, Sq, Sk, Hq, Hkv, D, options = case
    tensor_dtype = getattr(torch, dtype)
    alibi = options.get("alibi", False)
    slopes = torch.rand(B, Hq, generator=torch.Generator().manual_seed(1)) * 0.3 if alibi else None
    options = {k: x for k, x in options.items() if k != "alibi"} | ({"alibi_slopes": slopes} if alibi else {})

    def fresh(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(tensor_dtype).requires_grad_()

    if packing == "qkv":
        packed = fresh(B, Sq, 3, Hq, D)
        out = flash_attn_qkvpacked_func(packed, **options)
        q, k, v = (x.detach().float().numpy() for x in packed.unbind(2))
    elif packing == "kv":
        q_t, packed = fresh(B, Sq, Hq, D), fresh(B, Sk, 2, Hkv, D)
        out = flash_attn_kvpacked_func(q_t, packed, **options)
        q = q_t.detach().float().numpy()
        k, v = (x.detach().float().numpy() for x in packed.unbind(2))
    else:
        q_t, k_t, v_t = fresh(B, Sq, Hq, D), fresh(B, Sk, Hkv, D), fresh(B, Sk, Hkv, D)
        out = flash_attn_func(q_t, k_t, v_t, **options)
        q, k, v = (x.detach().float().numpy() for x in (q_t, k_t, v_t))
    reference = dict(scale=options.get("softmax_scale"), causal=options.get("causal", False),
                     window=_window(options), layout="bshd", softcap=options.get("softcap") or None,
                     alibi_slopes=None if slopes is None else slopes.numpy())
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    assert out.dtype == tensor_dtype and out.shape == (B, Sq, Hq, D)
    assert relative_l2(out.detach().float().numpy(), attention_reference(q, k, v, **reference)) <= tolerance
    do = rng.standard_normal(out.shape).astype(np.float32)
    out.backward(torch.from_numpy(do).to(tensor_dtype))
    dq, dk, dv = attention_backward_reference(q, k, v, do, **reference)[:3]
    if packing == "qkv":
        got = packed.grad.float().numpy()
        assert relative_l2(got, np.stack([dq, dk, dv], axis=2)) <= 4 * tolerance
    elif packing == "kv":
        assert relative_l2(q_t.grad.float().numpy(), dq) <= 4 * tolerance
        assert relative_l2(packed.grad.float().numpy(), np.stack([dk, dv], axis=2)) <= 4 * tolerance
    else:
        for x, want in zip((q_t, k_t, v_t), (dq, dk, dv)):
            assert relative_l2(x.grad.float().numpy(), want) <= 4 * tolerance


@pytest.mark.parametrize("name, value", [("dropout_p", 0.1), ("return_attn_probs", True)])
def test_what_mfa_native_lacks_is_refused_by_name(rng, name, value):
    q = torch.from_numpy(rng.standard_normal((1, 4, 2, 8)).astype(np.float32))
    for call in (lambda: flash_attn_func(q, q, q, **{name: value}),
                 lambda: flash_attn_kvpacked_func(q, torch.stack([q, q], 2), **{name: value}),
                 lambda: flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), **{name: value})):
        with pytest.raises(NotImplementedError, match=name):
            call()


def test_varlen_packed_forms_are_flash_attn_varlen_func_on_the_views(rng):
    """The packed varlen forms give flash_attn_varlen_func's bits on the unbound views, and their
    gradients reach the packed tensor."""
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    qkv = torch.from_numpy(rng.standard_normal((12, 3, 2, 8)).astype(np.float32)).requires_grad_()
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True, return_attn_probs=True)
    q, k, v = (x.detach() for x in qkv.unbind(1))
    want, want_lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    out.sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all() and qkv.grad.abs().sum() > 0
    kv = qkv.detach()[:, 1:].clone().requires_grad_()
    out = flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 7, 7, window_size=(2, 1))
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, window_size=(2, 1)))
    out.sum().backward()
    assert kv.grad.shape == kv.shape and kv.grad.abs().sum() > 0
