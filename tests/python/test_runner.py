"""The pass runner: one command batch per call, intermediates only on the device, the pass
description as a value that replays, and warm calls that keep every check."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from conftest import relative_l2
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
    """The shapes of every array the runner allocates (outputs only, it should be)."""
    shapes = []
    poisoned = runner._allocate

    def allocate(shape, dtype, device):
        shapes.append(tuple(shape))
        return poisoned(shape, dtype, device)

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


# PreparedPass.run checks its inputs against the description: a decode pass built for 64 keys.
DECODE = codegen.AttentionProblem(1, 4, 2, 1, 64, 16, 16)


@pytest.fixture(scope="module")
def decode_pass() -> PreparedPass:
    return PreparedPass(codegen.attention_pass(DECODE), mfa_native.default_device())


def test_run_on_the_arrays_the_pass_was_built_for_matches_the_reference(rng, decode_pass):
    q, k, v = make_inputs(rng, Hq=4, Hkv=2, R=1, C=64, D=16)
    q_strided = np.lib.stride_tricks.as_strided(q, strides=(7, q.strides[1], 3, q.strides[3]))  # extent-1 axes
    for inputs in ([q, k, v], (q_strided, k, v)):
        (out,) = decode_pass.run(inputs)
        assert relative_l2(out, attention_reference(q, k, v)) < 1e-5


def wrong_inputs(rng) -> dict[str, tuple[list, type, str]]:
    """Inputs the decode pass was not built for -> (inputs, the error, what its message says)."""
    q, k, v = make_inputs(rng, Hq=4, Hkv=2, R=1, C=64, D=16)
    wide = np.zeros((1, 2, 64, 32), np.float32)
    return {
        "fewer keys": ([q, k[:, :, :16], v[:, :, :16]], ValueError,
                       r"input 'k' has shape \(1, 2, 16, 16\); this pass was built for \(1, 2, 64, 16\)"),
        "float16": ([q.astype(np.float16), k, v], ValueError, "input 'q' has dtype float16; .* float32"),
        "float64": ([q, k, v.astype(np.float64)], ValueError, "input 'v' has dtype float64"),
        "a strided view": ([q, k, wide[..., ::2]], ValueError, r"input 'v' has strides \(4096, 2048, 32, 2\)"),
        "another axis order": ([q, k.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3), v], ValueError,
                               r"input 'k' has strides .*\(0, 1024, 16, 1\)"),
        "a negative stride": ([q, k[:, :, ::-1], v], ValueError, "input 'k' has strides"),
        "one more axis": ([q[None], k, v], ValueError, "input 'q' has shape"),
        "too few": ([q, k], ValueError, r"takes 3 inputs \(q, k, v\), got 2"),
        "too many": ([q, k, v, v], ValueError, "takes 3 inputs"),
        "a list": ([q, k.tolist(), v], TypeError, "input 'k' is a list, not a numpy array"),
        "a memoryview": ([q, k, memoryview(v)], TypeError, "input 'v' is a memoryview"),
        "None": ([None, k, v], TypeError, "input 'q' is a NoneType"),
        "one array": (q, TypeError, "inputs must be a list or tuple"),
    }


@pytest.mark.parametrize("case", list(wrong_inputs(np.random.default_rng(0))))
def test_run_refuses_what_the_pass_was_not_built_for_naming_the_input(rng, decode_pass, case):
    inputs, error, message = wrong_inputs(rng)[case]
    with pytest.raises(error, match=message):
        decode_pass.run(inputs)


def test_run_refuses_a_torch_tensor_naming_its_device(rng, decode_pass):
    torch = pytest.importorskip("torch")
    q, k, v = make_inputs(rng, Hq=4, Hkv=2, R=1, C=64, D=16)
    with pytest.raises(TypeError, match="input 'k' is a torch array on cpu; .* call the op"):
        decode_pass.run([q, torch.from_numpy(k), v])


def test_run_refuses_an_input_smaller_than_the_bytes_the_pass_reads(rng):
    description = codegen.attention_pass(DECODE)
    k = description.buffer("k")
    buffers = tuple(dataclasses.replace(b, nbytes=2 * b.nbytes) if b is k else b for b in description.buffers)
    prepared = PreparedPass(dataclasses.replace(description, buffers=buffers), mfa_native.default_device())
    with pytest.raises(ValueError, match=f"input 'k' spans {k.nbytes} bytes .*; this pass reads {2 * k.nbytes}"):
        prepared.run(list(make_inputs(rng, Hq=4, Hkv=2, R=1, C=64, D=16)))


def test_the_ops_run_their_passes_unchecked(rng, monkeypatch):
    """The ops built their inputs from the description: cold and warm calls skip run's checks."""
    def refuse(*_):
        raise AssertionError("an op checked its pass's inputs")

    monkeypatch.setattr(runner, "check_inputs", refuse)
    q, k, v = make_inputs(rng, R=5, C=9, D=16)
    for _ in range(2):
        assert relative_l2(mfa_native.attention(q, k, v), attention_reference(q, k, v)) < 1e-5


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
    with pytest.raises(ValueError, match="sinks must have shape"):
        mfa_native.attention(q, k, v, scale=1.0, causal=True, window=(4, 0), sinks=np.zeros(3, np.float32))
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
