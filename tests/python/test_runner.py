"""The pass runner: one command batch per call, intermediates only on the device, the pass
description as a value that replays, and warm calls that keep every check."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import poison, relative_l2
from test_attention import make_inputs

import mfa_native
from mfa_native import codegen
from mfa_native.reference import attention_backward_reference, attention_reference
from mfa_native.runtime import runner
from mfa_native.runtime.devices import tuned_as
from mfa_native.runtime.passes import PassDescription
from mfa_native.runtime.runner import PreparedPass


@pytest.fixture
def allocations(monkeypatch):
    """The shapes of every host array the runner allocates (outputs only, it should be)."""
    shapes = []

    def allocate(shape, dtype):
        shapes.append(tuple(shape))
        return poison(shape, dtype)

    monkeypatch.setattr(runner, "_allocate", allocate)
    return shapes


def batches_of(call) -> tuple[int, int, object]:
    """(command batches, host bytes staged in or out, result) of one call."""
    device = mfa_native.default_device()
    before = device.batch_stats()
    result = call()
    after = device.batch_stats()
    staged = after["bytes_staged_in"] - before["bytes_staged_in"] + after["bytes_copied_back"] - \
        before["bytes_copied_back"]
    return after["committed"] - before["committed"], staged, result


def test_split_kv_decode_is_one_batch_and_its_partials_stay_on_the_device(rng, allocations):
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=3, C=1500, D=16)
    with tuned_as(mfa_native.default_device(), parallel_threadgroups=64), mfa_native.profile() as prof:
        batches, staged, (out, lse) = batches_of(lambda: mfa_native.attention(q, k, v, causal=True, return_lse=True))
    assert [r.kernel for r in prof.records] == [codegen.PARTIAL_KERNEL_NAME, codegen.COMBINE_KERNEL_NAME]
    assert batches == 1
    assert allocations == [(1, 2, 3, 16), (1, 2, 3)]  # o and lse; o_partial and ml_partial are pool buffers
    if mfa_native.default_device().kind == "cpu":
        assert staged == 0
    expected, expected_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert relative_l2(out, expected) < 1e-4
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5)


def test_backward_is_one_batch_and_sums_dsinks_on_the_device(rng, allocations):
    q, k, v = make_inputs(rng, B=2, Hq=4, Hkv=2, R=13, C=29, D=16, Dv=8)
    sinks = rng.standard_normal(4).astype(np.float32)
    o, lse = mfa_native.attention(q, k, v, sinks=sinks, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    del allocations[:]
    with mfa_native.profile() as prof:
        batches, staged, grads = batches_of(lambda: mfa_native.attention_backward(q, k, v, o, lse, do, sinks=sinks))
    assert [r.kernel for r in prof.records] == [codegen.DQ_KERNEL_NAME, codegen.DKDV_KERNEL_NAME,
                                                codegen.DSINKS_KERNEL_NAME]
    assert batches == 1
    assert allocations == [q.shape, k.shape, v.shape, (4,)]  # delta and sink_grad never reach the host
    if mfa_native.default_device().kind == "cpu":
        assert staged == 0
    for grad, reference in zip(grads, attention_backward_reference(q, k, v, do, sinks=sinks, out=o)):
        assert grad.dtype == np.float32
        assert relative_l2(grad, reference) < 1e-4


def test_the_description_round_trips_through_json_and_replays(rng):
    problem = codegen.AttentionBackwardProblem(codegen.AttentionProblem(1, 2, 1, 10, 20, 8, 16, causal="upper_left",
                                                                        sinks=True))
    description = codegen.attention_backward_pass(problem)
    replayed = PassDescription.from_json(description.to_json())
    assert replayed == description
    roles = {b.name: b.role for b in description.buffers}
    assert roles == {"q": "input", "k": "input", "v": "input", "dout": "input", "lse": "input", "o": "input",
                     "sinks": "input", "dq": "output", "delta": "intermediate", "sink_grad": "intermediate",
                     "sizes": "constant", "dk": "output", "dv": "output", "dsinks": "output"}
    q, k, v = make_inputs(rng, Hq=2, Hkv=1, R=10, C=20, D=8, Dv=16)
    sinks = rng.standard_normal(2).astype(np.float32)
    o, lse = mfa_native.attention(q, k, v, causal="upper_left", sinks=sinks, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    arrays = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "dout": do, "sinks": sinks}
    prepared = PreparedPass(replayed, mfa_native.default_device())
    outputs = dict(zip(prepared.output_names, prepared.run([arrays[n] for n in prepared.input_names])))
    expected = mfa_native.attention_backward(q, k, v, o, lse, do, causal="upper_left", sinks=sinks)
    for name, grad in zip(("dq", "dk", "dv", "dsinks"), expected):
        np.testing.assert_array_equal(outputs[name], grad)


def test_a_warm_call_gives_the_bits_of_a_cold_one_and_converts_what_it_must(rng):
    q, k, v = make_inputs(rng, R=21, C=30, D=16, layout="bshd")
    for _ in range(3):  # the first call prepares, the others are warm: fresh contents, one signature
        q_reversed = rng.standard_normal(q.shape).astype(np.float32)[:, ::-1]  # a negative stride: copied
        mask = rng.standard_normal((21, 30))                                  # float64: made float32
        out = mfa_native.attention(q_reversed, k, v, mask=mask, layout="bshd")
        assert relative_l2(out, attention_reference(q_reversed, k, v, mask=mask, layout="bshd")) < 1e-4
    cold = mfa_native.attention(q, k, v, window=(3, 2), layout="bshd")
    np.testing.assert_array_equal(mfa_native.attention(q, k, v, window=(3, 2), layout="bshd"), cold)


def test_warm_calls_keep_every_check(rng):
    q, k, v = make_inputs(rng, R=8, C=8, D=16)
    sinks = rng.standard_normal(2).astype(np.float32)
    for _ in range(2):  # the second call of each signature is warm
        mfa_native.attention(q, k, v, scale=1.0, causal=True, window=(4, 0), sinks=sinks)
    with pytest.raises(ValueError, match="sinks must be finite"):
        mfa_native.attention(q, k, v, scale=1.0, causal=True, window=(4, 0), sinks=np.full(2, np.nan, np.float32))
    with pytest.raises(TypeError, match="scale"):
        mfa_native.attention(q, k, v, scale=True, causal=True, window=(4, 0), sinks=sinks)
    with pytest.raises(TypeError, match="window left"):
        mfa_native.attention(q, k, v, scale=1.0, causal=True, window=(4.0, 0), sinks=sinks)
    with pytest.raises(ValueError, match="causal"):
        mfa_native.attention(q, k, v, scale=1.0, causal=1, window=(4, 0), sinks=sinks)
    with pytest.raises(TypeError, match="dtype"):
        mfa_native.attention(q, k.astype(np.float16), v, scale=1.0, causal=True, window=(4, 0), sinks=sinks)
    o, lse = mfa_native.attention(q, k, v, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    for _ in range(2):
        mfa_native.attention_backward(q, k, v, o, lse, do)
    with pytest.raises(TypeError, match="lse must be float32"):
        mfa_native.attention_backward(q, k, v, o, lse.astype(np.float64), do)


def test_concurrent_warm_calls_are_independent(rng):
    problems = [make_inputs(rng, Hq=2, R=16, C=40, D=16) for _ in range(4)]
    expected = [attention_reference(*p, causal=True) for p in problems]
    mfa_native.attention(*problems[0], causal=True)
    errors = []

    def worker(i):
        for _ in range(5):
            out = mfa_native.attention(*problems[i], causal=True)
            errors.append(relative_l2(out, expected[i]))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 20 and max(errors) < 1e-4
