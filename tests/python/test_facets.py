"""The facets' houses: a new key-visit case is one class per side and one registration line,
and the dense kernels, the pass builder and the runner take it with nothing else changed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import mfa_native
from mfa_native import codegen
from mfa_native.codegen.attention.masking import Bounds
from mfa_native.codegen.attention.scores import SCORE_TRANSFORMS, ScoreTransform
from mfa_native.codegen.attention.visits import KEY_VISITS, KeyVisit, KeyWalk
from mfa_native.codegen.kernel.sizes import Extent
from mfa_native.codegen.storage.facet import STORAGES
from mfa_native.reference import attention_backward_reference, attention_reference
from mfa_native.runtime.runner import PreparedPass


# A toy case, as docs/design.md says a case is added: batch b attends its first
# min(key_counts[b], Kmax) keys of the visible range. It adds one runtime size (Kmax, given)
# and one operand (key_counts), and reuses the dense kernels.
@dataclass(frozen=True)
class PrefixWalk(KeyWalk):
    bounds = Bounds("0", "R", "0", "kv_end")
    catalog = {"key_counts": ("int", "(B,) the keys each batch attends")}
    key_lists = ("key_counts",)
    sizes_given = ("Kmax",)

    def prologue(self) -> list[str]:
        return ["const uint kv_end = min(min(uint(key_counts[b]), Kmax), C);"]

    def inputs(self, spec) -> dict:
        return {"key_counts": spec("int32", (Extent(1, ("B",)),), (Extent(1),), logical=False)}

    def summary(self) -> str:
        return "; a prefix of the keys per batch"


@KEY_VISITS.register
@dataclass(frozen=True)
class PrefixKeys(KeyVisit):
    most: int   # Kmax

    size_docs = {"Kmax": "most keys a batch attends"}

    def sizes(self, p) -> dict[str, int]:
        return {"Kmax": self.most}

    def describe(self, p, family: str, baked) -> PrefixWalk:
        return PrefixWalk()


B, HQ, HKV, R, C, D = 3, 4, 2, 5, 40, 16


def _problem(most: int) -> codegen.AttentionProblem:
    return codegen.AttentionProblem(B, HQ, HKV, R, C, D, D, causal="lower_right", return_lse=True,
                                    keys=PrefixKeys(most))


def test_a_new_key_visit_case_runs_in_the_dense_kernels(rng):
    """Its size and operand reach the kernel, the template and the pass; its outputs (poisoned
    before the run) match the float64 reference of each batch's prefix of keys."""
    most, counts = 30, np.array([40, 23, 31], np.int32)
    description = codegen.attention_pass(_problem(most))
    (kernel,) = description.kernels
    assert "key_counts" in kernel.buffers and "Kmax" in kernel.source and "most keys a batch attends" in kernel.source
    assert "; a prefix of the keys per batch" in kernel.source
    template = codegen.attention_template(_problem(most))
    assert "Kmax" in template.sizes and dict(template.valid_for)["keys"] == "PrefixKeys"
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((B, HQ, R, D), (B, HKV, C, D), (B, HKV, C, D)))
    prepared = PreparedPass(description, mfa_native.default_device())
    given = {"q": q, "k": k, "v": v, "key_counts": counts}
    out, lse = prepared.run([given[name] for name in prepared.input_names])
    for b, n in enumerate(np.minimum(counts, most)):
        expected, expected_lse = attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=True,
                                                     return_lse=True)
        np.testing.assert_allclose(out[b:b + 1], expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[b:b + 1], expected_lse, rtol=1e-5)


def test_cases_are_registered_once_by_name():
    """Every case the package has is registered; a template names its case by that name, and a
    problem whose case is not registered makes none."""
    assert {"DenseKeys", "CacheKeys", "SequenceRanges", "BlockLists", "TokenLists"} <= set(KEY_VISITS.classes)
    assert {"Plain", "QuantizedStorage"} <= set(STORAGES.classes)

    @dataclass(frozen=True)
    class PrefixKeys(KeyVisit):   # another case of the same name
        def describe(self, p, family: str, baked) -> KeyWalk:
            return PrefixWalk()

    with pytest.raises(ValueError, match="already registered"):
        KEY_VISITS.register(PrefixKeys)
    problem = codegen.AttentionProblem(1, 1, 1, 8, 8, 8, 8, keys=PrefixKeys())
    with pytest.raises(ValueError, match="not a registered key-visit case"):
        codegen.attention_template(problem)


def test_a_case_without_kernel_side_facts_is_refused():
    """describe is the one member without a default."""
    class Incomplete(KeyVisit):
        pass

    with pytest.raises(TypeError, match="describe"):
        Incomplete()


# A toy score transform, as docs/design.md says one is added: the logit doubled (derivative 2),
# which is attention at twice the scale, forward and backward.
@SCORE_TRANSFORMS.register
@dataclass(frozen=True)
class Doubled(ScoreTransform):
    def apply(self, x: str, name: str, at) -> tuple[list[str], str, str | None]:
        return [f"const float {name} = 2.0f * {x};"], name, "2.0f"

    def describe(self) -> str:
        return "doubled"


def test_a_new_score_transform_runs_in_the_forward_and_backward_kernels(rng):
    """Forward (one pass, and a KV cache's split-KV pair) and backward equal attention at twice
    the scale, outputs poisoned before each run."""
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32)
                   for shape in ((B, HQ, R, D), (B, HKV, C, D), (B, HKV, C, D), (B, HQ, R, D)))
    p = codegen.AttentionProblem(B, HQ, HKV, R, C, D, D, causal="lower_right", return_lse=True, scores=(Doubled(),))
    assert dict(codegen.attention_template(p).valid_for)["scores"] == ["doubled"]
    prepared = PreparedPass(codegen.attention_pass(p), mfa_native.default_device())
    out, lse = prepared.run([{"q": q, "k": k, "v": v}[name] for name in prepared.input_names])
    expected, expected_lse = attention_reference(q, k, v, causal=True, scale=2 / np.sqrt(D), return_lse=True)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5)
    backward = PreparedPass(codegen.attention_backward_pass(codegen.AttentionBackwardProblem(p)),
                            mfa_native.default_device())
    given = {"q": q, "k": k, "v": v, "o": out, "lse": lse, "dout": do}
    grads = backward.run([given[name] for name in backward.input_names])
    for got, want in zip(grads, attention_backward_reference(q, k, v, do, causal=True, scale=2 / np.sqrt(D))):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    cache = codegen.AttentionProblem(B, HQ, HKV, R, 512, D, D, layout="bshd", causal="lower_right",
                                     scores=(Doubled(),), keys=codegen.CacheKeys(0))
    split = codegen.attention_pass(cache, parallel_threadgroups=64)
    assert codegen.PARTIAL_KERNEL_NAME in [k.entry for k in split.kernels]
    lengths = np.array([500, 17, 0], np.int32)
    bshd = {"q": q.transpose(0, 2, 1, 3).copy(), "cache_seqlens": lengths,
            **{name: rng.standard_normal((B, 512, HKV, D)).astype(np.float32) for name in "kv"}}
    prepared = PreparedPass(split, mfa_native.default_device())
    (out,) = prepared.run([bshd[name] for name in prepared.input_names])
    for b, n in enumerate(lengths):
        want = attention_reference(bshd["q"][b:b + 1], bshd["k"][b:b + 1, :n], bshd["v"][b:b + 1, :n], causal=True,
                                   scale=2 / np.sqrt(D), layout="bshd")
        np.testing.assert_allclose(out[b:b + 1], want, rtol=1e-4, atol=1e-5)


def test_a_new_score_transform_runs_in_every_op(rng, monkeypatch):
    """The toy transform in every op that computes scores, reached through the one place the ops
    build their chain (ops/attention.py's score_transforms, patched to append it; each op's warm
    calls patched empty so no call of another test answers): every op equals its float64
    reference at twice the scale, forward, and backward where the op has one."""
    from mfa_native.int8_reference import int8_attention_emulation
    from mfa_native.ops import attention as attention_op
    from mfa_native.ops.declaration import OPS
    from mfa_native.reference import (attention_varlen_reference, attention_with_kvcache_reference,
                                      block_sparse_attention_backward_reference, block_sparse_attention_reference,
                                      sparse_attention_backward_reference, sparse_attention_reference)

    chain = attention_op.score_transforms
    monkeypatch.setattr(attention_op, "score_transforms", lambda *a: chain(*a) + (Doubled(),))
    for op in OPS.values():
        monkeypatch.setattr(op, "calls", type(op.calls)())
    b, h, r, c, d = 2, 2, 11, 21, 24
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in ((b, h, r, d), (b, h, c, d), (b, h, c, d),
                                                                        (b, h, r, d)))
    twice = dict(scale=2 / np.sqrt(d))
    o, lse = mfa_native.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    np.testing.assert_allclose(o, attention_reference(q, k, v, causal=True, **twice), atol=2e-5)
    for got, want in zip(mfa_native.attention_backward(q, k, v, o, lse, do, causal=True, device="cpu"),
                         attention_backward_reference(q, k, v, do, causal=True, **twice)):
        np.testing.assert_allclose(got, want, atol=2e-4)
    cu = np.array([0, 4, 11], np.int32)
    packed = [x[0].transpose(1, 0, 2).copy() for x in (q, k[:, :, :r], v[:, :, :r])]
    np.testing.assert_allclose(mfa_native.attention_varlen(*packed, cu, cu, causal=True, device="cpu"),
                               attention_varlen_reference(*packed, cu, cu, causal=True, **twice), atol=2e-5)
    bshd = [x.transpose(0, 2, 1, 3).copy() for x in (q, k, v)]
    lengths = np.array([c, 9], np.int32)
    np.testing.assert_allclose(
        mfa_native.attention_with_kvcache(bshd[0], bshd[1], bshd[2], cache_seqlens=lengths, causal=True, device="cpu"),
        attention_with_kvcache_reference(*bshd, lengths, causal=True, **twice), atol=2e-5)
    block_mask = mfa_native.BlockMask.from_mask(causal=True, R=r, C=c, block_size=8, device="cpu")
    o, lse = mfa_native.block_sparse_attention(q, k, v, block_mask, return_lse=True, device="cpu")
    np.testing.assert_allclose(o, block_sparse_attention_reference(q, k, v, block_mask, causal=True, **twice),
                               atol=2e-5)
    for got, want in zip(mfa_native.block_sparse_attention_backward(q, k, v, o, lse, do, block_mask, device="cpu"),
                         block_sparse_attention_backward_reference(q, k, v, do, block_mask, causal=True, **twice)):
        np.testing.assert_allclose(got, want, atol=2e-4)
    indices = rng.integers(0, c, size=(b, 1, r, 6), dtype=np.int32)
    o, lse = mfa_native.sparse_attention(q, k, v, indices, return_lse=True, device="cpu")
    np.testing.assert_allclose(o, sparse_attention_reference(q, k, v, indices, **twice), atol=2e-5)
    for got, want in zip(mfa_native.sparse_attention_backward(q, k, v, indices, o, lse, do, device="cpu"),
                         sparse_attention_backward_reference(q, k, v, do, indices, **twice)):
        np.testing.assert_allclose(got, want, atol=2e-4)
    half = [x.astype(np.float16) for x in (q, k, v)]
    np.testing.assert_allclose(mfa_native.int8_attention(*half, causal=True, device="cpu"),
                               int8_attention_emulation(*half, causal=True, **twice), atol=2e-3)
