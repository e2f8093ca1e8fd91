"""Every op returns the kind of array it was given: numpy, torch or MLX, without copies."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import mfa_native
from mfa_native import _core
from mfa_native.runtime import frameworks


def _qkv(rng, shape=(2, 4, 16, 32), kv_heads=2, dtype=np.float32):
    B, H, R, D = shape
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal((B, kv_heads, 24, D)).astype(dtype),
            rng.standard_normal((B, kv_heads, 24, D)).astype(dtype))


def test_import_does_not_import_frameworks():
    code = "import sys, mfa_native; print(any(m in sys.modules for m in ('torch', 'mlx', 'mlx.core')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_in_torch_out(rng, monkeypatch, dtype):
    torch = pytest.importorskip("torch")
    made, hosts = [], []
    over = frameworks.FRAMEWORKS[0].over
    monkeypatch.setattr(frameworks.FRAMEWORKS[0], "over", lambda a: hosts.append(a) or made.append(over(a)) or made[-1])
    q, k, v = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in _qkv(rng))
    mask = torch.from_numpy(rng.random((16, 24)) > 0.2)
    o, lse = mfa_native.attention(q, k, v, mask=mask, causal="upper_left", return_lse=True)
    assert o is made[0] and lse is made[1]  # written in place into tensors over the device pool's memory
    for tensor, host in zip((o, lse), hosts):
        assert isinstance(host.base, _core.Buffer) and tensor.data_ptr() == host.__array_interface__["data"][0]
    assert type(o) is torch.Tensor and o.dtype == q.dtype and o.shape == q.shape and lse.dtype == torch.float32
    as_numpy = frameworks.FRAMEWORKS[0].as_numpy
    expected_o, expected_lse = mfa_native.attention(*(as_numpy(x, "x") for x in (q, k, v)), mask=mask.numpy(),
                                                    causal="upper_left", return_lse=True)
    np.testing.assert_array_equal(as_numpy(o, "o"), expected_o)
    np.testing.assert_array_equal(lse.numpy(), expected_lse)


def test_torch_bfloat16_views_share_memory(rng):
    torch = pytest.importorskip("torch")
    t = torch.randn(3, 5, 8, dtype=torch.bfloat16).transpose(0, 1)
    view = frameworks.FRAMEWORKS[0].as_numpy(t, "t")
    assert view.dtype.name == "bfloat16" and view.__array_interface__["data"][0] == t.data_ptr()
    np.testing.assert_array_equal(view.astype(np.float32), t.float().numpy())


def test_torch_requires_grad_goes_through_autograd(rng):
    """Tensors that require grad: the call runs through the torch custom op, so autograd sees it."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in _qkv(rng))
    o = mfa_native.attention(q, k, v)
    assert o.requires_grad
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert float((o - expected).detach().norm() / expected.detach().norm()) < 1e-6
    do = torch.randn_like(o)
    for ours, theirs in zip(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(expected, (q, k, v), do)):
        assert float((ours - theirs).norm() / theirs.norm()) < 1e-5


def test_torch_backward_returns_torch(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in _qkv(rng))
    sinks = torch.from_numpy(rng.standard_normal(4).astype(np.float32))
    o, lse = mfa_native.attention(q, k, v, sinks=sinks, return_lse=True)
    do = torch.randn_like(o)
    grads = mfa_native.attention_backward(q, k, v, o, lse, do, sinks=sinks.numpy())
    expected = mfa_native.attention_backward(q.numpy(), k.numpy(), v.numpy(), o.numpy(), lse.numpy(), do.numpy(),
                                             sinks=sinks.numpy())
    assert all(type(g) is torch.Tensor for g in grads) and len(grads) == 4
    for g, e in zip(grads, expected):
        np.testing.assert_array_equal(g.numpy(), e)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_in_mlx_out(rng, dtype):
    mx = pytest.importorskip("mlx.core")
    q, k, v = (mx.array(x).astype(getattr(mx, dtype)) for x in _qkv(rng))
    o = mfa_native.attention(q, k, v, causal=True)
    assert isinstance(o, mx.array) and o.dtype == q.dtype and o.shape == q.shape
    as_numpy = frameworks.FRAMEWORKS[1].as_numpy
    expected = mfa_native.attention(*(as_numpy(x, "x") for x in (q, k, v)), causal=True)
    np.testing.assert_array_equal(as_numpy(o, "o"), expected)


def test_mlx_views_share_memory():
    mx = pytest.importorskip("mlx.core")
    a = mx.random.normal((4, 8)).astype(mx.bfloat16)
    first, second = (frameworks.FRAMEWORKS[1].as_numpy(a, "a") for _ in range(2))
    assert first.dtype.name == "bfloat16" and np.shares_memory(first, second)


def test_mixing_kinds_is_a_type_error(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="q, k, v must be one kind"):
        mfa_native.attention(torch.from_numpy(q), k, torch.from_numpy(v))
    with pytest.raises(TypeError, match="q, k, v must be one kind"):
        mfa_native.attention(q, torch.from_numpy(k), v)
    mx = pytest.importorskip("mlx.core")
    with pytest.raises(TypeError, match="mask is a torch array but q is mlx"):
        mfa_native.attention(mx.array(q), mx.array(k), mx.array(v), mask=torch.ones(16, 24, dtype=torch.bool))


def test_metal_tensors_are_bound_in_place_of_their_stand_ins(monkeypatch):
    """The MPS path's bookkeeping, on a CPU tensor posing as a Metal one (the real path runs on a Mac)."""
    torch = pytest.importorskip("torch")

    class PosingAsMetal(frameworks.Torch):
        def on_metal(self, x):
            return True

    monkeypatch.setattr(torch.mps, "synchronize", lambda: None)
    monkeypatch.setattr(frameworks._core, "metal_buffer_from_dlpack", lambda device, capsule: ("buffer", capsule))
    q = torch.zeros(2, 3, 4).transpose(1, 2)  # strided: made contiguous (on the device) first
    call = frameworks.FrameworkCall(PosingAsMetal(), q)
    stand_in = call.view(q, "q")
    assert stand_in.shape == (2, 4, 3) and stand_in.strides == (48, 12, 4)
    sinks = call.view(torch.ones(3), "sinks")  # its values are checked: a host copy
    assert np.array_equal(sinks, np.ones(3, np.float32))
    broadcast = np.broadcast_to(stand_in[:1], (5, 4, 3))  # a view of a stand-in binds its tensor too
    host = np.zeros(3, np.float32)
    metal = type("FakeDevice", (), {"kind": "metal"})()
    bound = call.bind([stand_in, broadcast, host], metal)
    assert bound[0][0] == "buffer" and bound[1][0] == "buffer" and bound[2] is host
    with pytest.raises(ValueError, match="metal device"):
        call.bind([stand_in], type("FakeDevice", (), {"kind": "cpu"})())
    # A stand-in is aligned as its tensor's first element is (codegen's vector accesses read it).
    halves = torch.zeros(40, dtype=torch.float16)
    for offset in (0, 1, 2, 5):
        tensor = halves[offset:offset + 8].view(2, 4)
        address = call.view(tensor, "k").__array_interface__["data"][0]
        assert address % 16 == offset * 2 % 16, offset
