"""Zero-copy outputs: an op's outputs are numpy arrays over Buffers of the device's pool, bound
back into later passes as those Buffers (never as caller memory), returned to the pool when
their last view dies, and never handed out again while alive."""

from __future__ import annotations

import numpy as np
from conftest import relative_l2
from test_attention import make_inputs

import mfa_native
from mfa_native import _core
from mfa_native.reference import attention_backward_reference, attention_reference


def host_bound(call) -> tuple[int, object]:
    """(bytes of caller memory the call's batches bound by address, the call's result)."""
    device = mfa_native.default_device()
    before = device.batch_stats()["bytes_host_bound"]
    result = call()
    return device.batch_stats()["bytes_host_bound"] - before, result


def test_a_buffer_exposes_its_bytes_writable():
    buffer = mfa_native.default_device().new_buffer(100)
    view = memoryview(buffer)
    assert view.nbytes == buffer.size == 100 and not view.readonly
    array = np.ndarray((25,), np.float32, buffer)
    array[:] = np.arange(25)
    np.testing.assert_array_equal(np.ndarray((25,), np.float32, buffer), np.arange(25))


def test_an_output_is_pool_memory_and_goes_back_to_the_pool_when_deleted(rng):
    device = mfa_native.default_device()
    q, k, v = make_inputs(rng, R=8, C=24, D=16)
    mfa_native.attention(q, k, v)  # warm: the pass's own pool traffic settles
    in_use = device.pool_stats()["bytes_in_use"]
    out = mfa_native.attention(q, k, v)
    assert isinstance(out.base, _core.Buffer) and out.base.size == out.nbytes
    assert device.pool_stats()["bytes_in_use"] >= in_use + out.nbytes
    assert relative_l2(out, attention_reference(q, k, v)) < 1e-5
    view = out[:, 1:]
    del out
    assert device.pool_stats()["bytes_in_use"] > in_use, "a view keeps the buffer"
    del view
    assert device.pool_stats()["bytes_in_use"] == in_use


def test_outputs_bind_as_pool_buffers_and_caller_arrays_by_address(rng):
    q, k, v = make_inputs(rng, R=8, C=24, D=16)
    with mfa_native.profile() as prof:
        bound, (o, lse) = host_bound(lambda: mfa_native.attention(q, k, v, return_lse=True))
    assert len(prof.records) == 1
    assert bound == q.nbytes + k.nbytes + v.nbytes  # o and lse are pool buffers, not caller memory
    bound, again = host_bound(lambda: mfa_native.attention(o, k, v))  # an output as an input
    assert bound == k.nbytes + v.nbytes
    assert relative_l2(again, attention_reference(o, k, v)) < 1e-5
    head = o[:, 1:]  # a view at an offset into o's buffer
    _, k1, v1 = make_inputs(rng, Hq=1, R=8, C=24, D=16)
    bound, of_head = host_bound(lambda: mfa_native.attention(head, k1, v1))
    assert bound == k1.nbytes + v1.nbytes
    assert relative_l2(of_head, attention_reference(np.array(head), k1, v1)) < 1e-5

    do = rng.standard_normal(o.shape).astype(np.float32)
    copies = np.array(o), np.array(lse)
    with_copies, _ = host_bound(lambda: mfa_native.attention_backward(q, k, v, *copies, do))
    with_outputs, grads = host_bound(lambda: mfa_native.attention_backward(q, k, v, o, lse, do))
    assert 0 < with_outputs <= with_copies - o.nbytes - lse.nbytes
    for grad, reference in zip(grads, attention_backward_reference(q, k, v, do, out=o)):
        assert isinstance(grad.base, _core.Buffer) and relative_l2(grad, reference) < 1e-4


def test_an_output_kept_alive_is_never_handed_out_again(rng):
    kept = []
    for _ in range(3):
        q, k, v = make_inputs(rng, R=8, C=24, D=16)
        out = mfa_native.attention(q, k, v)
        kept.append((out, out.copy(), attention_reference(q, k, v)))
    for _ in range(10):
        q, k, v = make_inputs(rng, R=8, C=24, D=16)
        mfa_native.attention(q, k, v)
    addresses = {out.__array_interface__["data"][0] for out, _, _ in kept}
    assert len(addresses) == 3
    for out, copy, reference in kept:
        np.testing.assert_array_equal(out, copy)
        assert relative_l2(out, reference) < 1e-5
