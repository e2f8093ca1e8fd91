"""FlexAttention's score_mod compiled into the kernels (`mfa_native.torch.flex_attention`):
FlexAttention's own examples (relative position, ALiBi, tanh softcap, a per-head bias table,
T5's bucketed relative bias, a document bias) against a float64 reference that runs the same
Python score_mod on float64 index grids, forward and backward (float64 autograd), and against
torch's own flex_attention (eager, CPU, forward only: it has no CPU backward); the numerics
rules (NaN propagates, -inf removes the key, an out-of-range read is NaN) and the errors.
Small problems: each score_mod compiles its own kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import relative_l2

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
from mfa_native.torch import flex_attention  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated")]

B, HQ, HKV, R, C, D = 2, 4, 2, 20, 28, 16


def t5_buckets(relative, buckets=8, max_distance=24):
    """T5's bidirectional relative-position bucket of q_idx - kv_idx (integer arithmetic, a log)."""
    half = buckets // 2
    offset = (relative > 0).to(torch.int32) * half
    distance = relative.abs()
    exact = half // 2
    large = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)).to(
        torch.int32)
    return offset + torch.where(distance < exact, distance, torch.clamp(large, max=half - 1))


def score_mods(rng):
    """FlexAttention's examples, each with the captured tensors it reads."""
    table = torch.from_numpy(rng.standard_normal((HQ, 8)).astype(np.float32))
    head_bias = torch.from_numpy(rng.standard_normal(HQ).astype(np.float32))
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / HQ) for h in range(HQ)])
    documents = torch.from_numpy(np.sort(rng.integers(0, 3, max(R, C))).astype(np.int64))
    return {
        "relative_position": lambda s, b, h, q, kv: s + (q - kv) * 0.05,
        "alibi": lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(),
        "softcap": lambda s, b, h, q, kv: 2.0 * torch.tanh(s / 2.0),
        "head_bias": lambda s, b, h, q, kv: s + head_bias[h],
        "t5": lambda s, b, h, q, kv: s + table[h, t5_buckets(q - kv)],
        "document_bias": lambda s, b, h, q, kv: torch.where(documents[q] == documents[kv], s, s - 1.5 + b),
    }


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def reference(q, k, v, score_mod, mask_mod=None):
    """Attention in float64 with `score_mod` run on float64 scores and int64 index grids (as
    FlexAttention's eager path does), differentiable in q, k, v; and its lse."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    k_, v_ = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    scores = q @ k_.transpose(-1, -2) / math.sqrt(D)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in scores.shape), indexing="ij")
    scores = score_mod(scores, b, h, i, j)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, i, j), -math.inf)
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse)[..., None])
    return (q, k, v), weights @ v_, lse


def inputs(rng, requires_grad=True):
    """Fresh q, k, v (float32 torch tensors), q (B, HQ, R, D), k and v (B, HKV, C, D)."""
    shapes = ((B, HQ, R, D), (B, HKV, C, D), (B, HKV, C, D))
    return tuple(torch.from_numpy(rng.standard_normal(s).astype(np.float32)).requires_grad_(requires_grad)
                 for s in shapes)


@pytest.mark.parametrize("name", ["relative_position", "alibi", "softcap", "head_bias", "t5", "document_bias"])
def test_flex_attention_score_mods_forward_and_backward(rng, name):
    """Output and lse against the float64 reference and torch's flex_attention; dq, dk, dv
    against float64 autograd of the same expression (causal block mask on every other case)."""
    score_mod = score_mods(rng)[name]
    mask_mod = causal if name in ("alibi", "head_bias", "document_bias") else None
    block_mask = None if mask_mod is None else flex.create_block_mask(causal, None, None, R, C, device="cpu")
    q, k, v = inputs(rng)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_lse=True)
    leaves, expected, expected_lse = reference(q, k, v, score_mod, mask_mod)
    assert relative_l2(out.detach(), expected.detach()) < 1e-5
    assert relative_l2(lse, expected_lse.detach()) < 1e-5
    theirs = flex.flex_attention(q.detach(), k.detach(), v.detach(), score_mod=score_mod, block_mask=block_mask,
                                 enable_gqa=True)
    assert relative_l2(out.detach(), theirs) < 1e-5
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    grads = torch.autograd.grad(out, (q, k, v), do)
    for got, want in zip(grads, torch.autograd.grad(expected, leaves, do.double())):
        assert relative_l2(got, want) < 1e-4


def test_the_vocabulary_forward_and_backward(rng):
    """One score_mod using the rest of the vocabulary (sigmoid, exp, sqrt, minimum, maximum,
    clamp, powers, integer floor division and remainder, floor and ceil of index floats, logic,
    a boolean table) against float64 autograd of the same expression."""
    keep = torch.from_numpy(rng.random(C) > 0.2)
    def score_mod(s, b, h, i, j):
        near = ((i - j) // 3 == 0) | ((i + j) % 4 == 1) & ~(h == 1)
        spread = s * 3.0
        shifted = torch.minimum(torch.maximum(spread, 2.0 * torch.sigmoid(spread) ** 2 - 0.5),
                                torch.sqrt(torch.exp(spread * 0.5) + 1.0))   # each branch taken somewhere
        positions = torch.floor((i - j).float() / 3.0) * 0.1 + torch.ceil(j.float() / 5.0) * 0.05
        capped = torch.clamp(shifted, min=-0.3, max=2.0) + positions + (s - 1.0).abs() * 0.1
        return torch.where(near & keep[j], capped, -s * 0.5)

    q, k, v = inputs(rng)
    out = flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)
    leaves, expected, _ = reference(q, k, v, score_mod)
    assert relative_l2(out.detach(), expected.detach()) < 1e-5
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    for got, want in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(expected, leaves, do.double())):
        assert relative_l2(got, want) < 1e-4


def test_numerics_nan_propagates_and_minus_infinity_removes_the_key(rng):
    """A NaN score makes its row NaN (only it); -inf removes keys, and a row left with none
    gives 0 and lse -inf; a read outside a captured tensor makes the score NaN."""
    q, k, v = inputs(rng, requires_grad=False)
    table = torch.from_numpy(rng.standard_normal(R - 1).astype(np.float32))
    cases = {"nan": lambda s, b, h, i, j: torch.where(i == 3, math.nan, s),
             "removed": lambda s, b, h, i, j: torch.where((j % 3 == 0) | (i == 5), -math.inf, s),
             "outside": lambda s, b, h, i, j: s + table[i]}
    special = {"nan": 3, "removed": 5, "outside": R - 1}   # the row NaN, or with every key removed
    for name, score_mod in cases.items():
        out, lse = flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True, return_lse=True)
        row, keep = special[name], [i for i in range(R) if i != special[name]]
        if name == "removed":
            assert (out[:, :, row] == 0).all() and (lse[:, :, row] == -math.inf).all()
        else:
            assert torch.isnan(out[:, :, row]).all() and torch.isnan(lse[:, :, row]).all()
        expected = reference(q, k, v, score_mod if name != "outside" else lambda s, b, h, i, j: s + table[i % (R - 1)])
        assert relative_l2(out[:, :, keep], expected[1].detach()[:, :, keep]) < 1e-5
        assert relative_l2(lse[:, :, keep], expected[2].detach()[:, :, keep]) < 1e-5


def test_an_operation_outside_the_vocabulary_is_an_error_naming_it(rng):
    q, k, v = inputs(rng, requires_grad=False)
    with pytest.raises(ValueError, match="aten.sin"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.sin(s), enable_gqa=True)
    with pytest.raises(ValueError, match="could not be traced"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s if s > 0 else -s, enable_gqa=True)
    with pytest.raises(ValueError, match="aten.bitwise_and"):   # integers' bits: not in the vocabulary
        flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + (i & j), enable_gqa=True)
    with pytest.raises(ValueError, match="index every axis"):
        table = torch.ones(HQ, 4)
        flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h].sum(), enable_gqa=True)


@pytest.mark.parametrize("masks", ["torch", "from_mask"])
def test_a_learnable_bias_gets_its_gradient(rng, masks):
    """A captured table that requires grad (per head and relative position, under a causal
    block mask: torch's, or mfa_native's from_mask whose rule applies in partial blocks) gets
    the gradient float64 autograd gives it; q, k, v theirs as before."""
    import mfa_native

    table = torch.from_numpy(rng.standard_normal((HQ, R + C)).astype(np.float32)).requires_grad_()
    score_mod = lambda s, b, h, i, j: s + table[h, i - j + C]   # noqa: E731
    block_mask = flex.create_block_mask(causal, None, None, R, C, device="cpu", BLOCK_SIZE=8) if masks == "torch" \
        else mfa_native.BlockMask.from_mask(causal="upper_left", R=R, C=C, block_size=8, device="cpu")
    q, k, v = inputs(rng)
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    grads = torch.autograd.grad(out, (q, k, v, table), do)
    table64 = table.detach().double().requires_grad_()
    leaves, expected, _ = reference(q, k, v, lambda s, b, h, i, j: s + table64[h, i - j + C], causal)
    assert relative_l2(out.detach(), expected.detach()) < 1e-5
    for got, want in zip(grads, torch.autograd.grad(expected, (*leaves, table64), do.double())):
        assert relative_l2(got, want) < 1e-4


def test_the_expression_is_a_kernel_fact_and_the_op_takes_its_text(rng):
    """The numpy op with a traced text and its tensors equals the torch call; the text is in the
    template's facts, so two score_mods never share kernels."""
    import mfa_native
    from mfa_native.codegen import attention_template
    from mfa_native.ops.flex_bits import everything
    from mfa_native.torch.score_mod import trace

    table = torch.from_numpy(rng.standard_normal((HQ, R + C)).astype(np.float32))
    text, tensors = trace(lambda s, b, h, i, j: s + table[h, i - j + C])
    q, k, v = (x.numpy() for x in inputs(rng, requires_grad=False))
    out = mfa_native.block_sparse_attention(q, k, v, everything(), score_mod=text,
                                            score_mod_tensors=[tensors[0].numpy()], device="cpu")
    table64 = table.double()
    expected = reference(*(torch.from_numpy(x) for x in (q, k, v)), lambda s, b, h, i, j: s + table64[h, i - j + C])
    assert relative_l2(out, expected[1].detach()) < 1e-5
    from mfa_native.codegen.attention.score_mod import ScoreMod
    from mfa_native.codegen import AttentionProblem
    problem = AttentionProblem(B, HQ, HKV, R, C, D, D, scores=(ScoreMod(text, (("float", (HQ, R + C)),)),))
    assert dict(attention_template(problem).valid_for)["scores"] == [f"score_mod {text}; tensor 0: float [4, 48]"]
    with pytest.raises(ValueError, match="reads tensors"):
        mfa_native.block_sparse_attention(q, k, v, everything(), score_mod=text, device="cpu")


def test_attention_and_its_backward_take_a_traced_score_mod(rng):
    """mfa_native.attention (lower-right causal) and attention_backward with a traced text and its
    tensors (a per-head relative bias and softcap) against float64 autograd of the expression."""
    import mfa_native
    from mfa_native.torch.score_mod import trace

    table = torch.from_numpy(rng.standard_normal((HQ, R + C)).astype(np.float32))
    score_mod = lambda s, b, h, i, j: 5.0 * torch.tanh(s / 5.0) + table[h, i - j + C]   # noqa: E731
    text, tensors = trace(score_mod)
    q, k, v = (x.numpy() for x in inputs(rng, requires_grad=False))
    do = rng.standard_normal((B, HQ, R, D)).astype(np.float32)
    options = dict(causal=True, score_mod=text, score_mod_tensors=[t.numpy() for t in tensors], device="cpu")
    out, lse = mfa_native.attention(q, k, v, return_lse=True, **options)
    grads = mfa_native.attention_backward(q, k, v, out, lse, do, **options)
    leaves, expected, expected_lse = reference(*(torch.from_numpy(x) for x in (q, k, v)), score_mod,
                                               lambda b, h, i, j: j <= i + C - R)
    assert relative_l2(out, expected.detach()) < 1e-5 and relative_l2(lse, expected_lse.detach()) < 1e-5
    for got, want in zip(grads, torch.autograd.grad(expected, leaves, torch.from_numpy(do).double())):
        assert relative_l2(got, want) < 1e-4


def test_mlx_arrays_take_the_traced_form(rng):
    """MLX has no tracer to give mfa_native a callable's expression: the text torch traced and
    MLX arrays for its tensors run the same kernels, and mx.grad flows through them."""
    mx = pytest.importorskip("mlx.core")
    import mfa_native.mlx
    from mfa_native.torch.score_mod import trace

    table = rng.standard_normal((HQ, R + C)).astype(np.float32)
    score_mod = lambda s, b, h, i, j: s + torch.from_numpy(table)[h, i - j + C]   # noqa: E731
    text, _ = trace(score_mod)
    q, k, v = (x.numpy() for x in inputs(rng, requires_grad=False))
    options = dict(score_mod=text, score_mod_tensors=[mx.array(table)])
    out = mfa_native.mlx.attention(mx.array(q), mx.array(k), mx.array(v), **options)
    leaves, expected, _ = reference(*(torch.from_numpy(x) for x in (q, k, v)), score_mod)
    assert relative_l2(np.array(out), expected.detach()) < 1e-5
    dq = mx.grad(lambda x: (mfa_native.mlx.attention(x, mx.array(k), mx.array(v), **options) ** 2).sum())(mx.array(q))
    (want,) = torch.autograd.grad((expected ** 2).sum(), leaves[0])
    assert relative_l2(np.array(dq), want) < 1e-4


def test_varlen_positions_are_the_sequences_own(rng):
    """attention_varlen (+ backward): b is the sequence's index and q_idx, kv_idx count from its
    first query and key: each sequence equals the reference of its slices with b = its index."""
    import mfa_native
    from mfa_native.torch.score_mod import trace

    table = torch.from_numpy(rng.standard_normal((3, HQ, 64)).astype(np.float32))
    score_mod = lambda s, b, h, i, j: s + table[b, h, i - j + 32] + 0.01 * (i + 2 * j)   # noqa: E731
    text, tensors = trace(score_mod)
    cu_q, cu_k = np.array([0, 7, 20, 29], np.int32), np.array([0, 12, 22, 40], np.int32)
    q = rng.standard_normal((29, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((40, HKV, D)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    options = dict(causal=True, score_mod=text, score_mod_tensors=[tensors[0].numpy()], device="cpu")
    out, lse = mfa_native.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    grads = mfa_native.attention_varlen_backward(q, k, v, out, lse, do, cu_q, cu_k, **options)
    for n in range(3):
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        R_, C_ = rows.stop - rows.start, keys.stop - keys.start
        sliced = [torch.from_numpy(x[part]).permute(1, 0, 2)[None] for x, part in ((q, rows), (k, keys), (v, keys))]
        leaves, expected, _ = reference(*sliced, lambda s, b, h, i, j: score_mod(s, b + n, h, i, j),
                                        lambda b, h, i, j: j <= i + C_ - R_)
        assert relative_l2(out[rows], expected.detach()[0].permute(1, 0, 2)) < 1e-5
        want = torch.autograd.grad(expected, leaves, torch.from_numpy(do[rows]).permute(1, 0, 2)[None].double())
        for got, w, part in zip(grads, want, (rows, keys, keys)):
            assert relative_l2(got[part], w[0].permute(1, 0, 2)) < 1e-4


def test_kvcache_positions_are_the_caches(rng):
    """attention_with_kvcache appending Rn = R rows (split-KV decode included, R = 1): kv_idx is
    the key's position in the cache, q_idx the cache length before the call + the query's row."""
    import mfa_native
    from mfa_native.torch.score_mod import trace

    table = torch.from_numpy(rng.standard_normal((HQ, 900)).astype(np.float32))
    score_mod = lambda s, b, h, i, j: s + table[h, i - j + 520] - 0.002 * j + 0.01 * b   # noqa: E731
    text, tensors = trace(score_mod)
    for rows, capacity in ((5, 48), (1, 512)):
        lengths = np.array([300, 17, 0][:B], np.int32) if capacity == 512 else np.array([11, 30][:B], np.int32)
        q = rng.standard_normal((B, rows, HQ, D)).astype(np.float32)
        k_cache, v_cache = (rng.standard_normal((B, capacity, HKV, D)).astype(np.float32) for _ in range(2))
        k_new, v_new = (rng.standard_normal((B, rows, HKV, D)).astype(np.float32) for _ in range(2))
        out = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k_new, v=v_new,
                                                causal=True, score_mod=text, score_mod_tensors=[tensors[0].numpy()],
                                                device="cpu")
        for b, n in enumerate(lengths):
            keys = n + rows   # the cache after the append holds the new rows at n..n + rows - 1
            sliced = [torch.from_numpy(x[b:b + 1]).permute(0, 2, 1, 3)
                      for x in (q, k_cache[:, :keys], v_cache[:, :keys])]
            _, expected, _ = reference(*sliced, lambda s, bb, h, i, j: score_mod(s, bb + b, h, i + n, j),
                                       lambda bb, h, i, j: j <= i + n)
            assert relative_l2(out[b:b + 1], expected.detach().permute(0, 2, 1, 3)) < 1e-5


def test_sparse_indexed_kv_idx_is_the_listed_keys_index(rng):
    """sparse_attention (+ backward): kv_idx is the listed key's index in k, q_idx the query
    row: equal to the float64 reference over the listed keys (distinct per row), forward and
    backward."""
    import mfa_native
    from mfa_native.torch.score_mod import trace

    table = torch.from_numpy(rng.standard_normal((HQ, 64)).astype(np.float32))
    score_mod = lambda s, b, h, i, j: s + 2.0 * table[h, i - j + 32] - 0.1 * b   # noqa: E731
    text, tensors = trace(score_mod)
    q, k, v = inputs(rng)
    lists = np.stack([[rng.permutation(C)[:10] for _ in range(R)] for _ in range(B)])[:, None].astype(np.int32)
    listed = torch.zeros(B, 1, R, C, dtype=torch.bool)
    for b in range(B):
        for r in range(R):
            listed[b, 0, r, lists[b, 0, r]] = True
    leaves, expected, expected_lse = reference(q, k, v, score_mod, lambda b, h, i, j: listed[b, 0, i, j])
    arrays = [x.detach().numpy() for x in (q, k, v)]
    options = dict(score_mod=text, score_mod_tensors=[tensors[0].numpy()], device="cpu")
    out, lse = mfa_native.sparse_attention(*arrays, lists, return_lse=True, **options)
    assert relative_l2(out, expected.detach()) < 1e-5 and relative_l2(lse, expected_lse.detach()) < 1e-5
    do = rng.standard_normal(out.shape).astype(np.float32)
    grads = mfa_native.sparse_attention_backward(*arrays, lists, out, lse, do, **options)
    for got, want in zip(grads, torch.autograd.grad(expected, leaves, torch.from_numpy(do).double())):
        assert relative_l2(got, want) < 1e-4


def test_a_score_mod_is_traced_once_while_what_it_sees_stays(rng, monkeypatch):
    """flex_attention traces a plain function once (its captured tensors' values are read at
    each call), again when a global or closure value it reads is rebound, and on every call
    when it sees an object whose attributes it may read (no fingerprint can cover those)."""
    from mfa_native.torch.score_mod import TRACES, trace

    traces = []
    monkeypatch.setattr(TRACES, "trace", lambda fn: traces.append(fn) or trace(fn))
    q, k, v = inputs(rng, requires_grad=False)
    bias = torch.zeros(HQ)
    scale = [0.5]

    def shifted(s, b, h, i, j):
        return s * scale[0] + bias[h] * (i - j) * 0.1

    def call(fn):
        out = flex_attention(q, k, v, score_mod=fn, enable_gqa=True)
        assert relative_l2(out, reference(q, k, v, fn)[1].detach()) < 1e-5   # what fn computes now
        return out

    first = call(shifted)
    bias += 1.0   # in place: the same tensor, its new values read at the call
    assert relative_l2(call(shifted), first) > 0.01 and len(traces) == 1
    scale[0] = 2.0   # a value the function sees rebound: traced again
    call(shifted)
    assert len(traces) == 2

    class Holder:
        table = torch.zeros(HQ)

    holder = Holder()

    def from_object(s, b, h, i, j):
        return s + holder.table[h] * (i - j)

    call(from_object)
    holder.table = torch.ones(HQ)   # rebound on an object: no fingerprint sees it, so every call traces
    call(from_object)
    assert len(traces) == 4


def test_the_plain_ops_trace_a_torch_function(rng):
    """mfa_native.attention (and mfa_native.torch.attention, differentiable) on torch tensors
    take the function itself, traced as flex_attention traces it: the same bits."""
    import mfa_native
    import mfa_native.torch as mt
    score_mod = score_mods(rng)["t5"]
    q, k, v = inputs(rng, requires_grad=False)
    want = flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)
    assert torch.equal(mfa_native.attention(q, k, v, score_mod=score_mod), want)
    leaf = q.clone().requires_grad_()
    out = mt.attention(leaf, k, v, score_mod=score_mod)
    assert torch.equal(out.detach(), want)
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    (dq,) = torch.autograd.grad(out, leaf, do)
    leaves, expected, _ = reference(q, k, v, score_mod)
    assert relative_l2(dq, torch.autograd.grad(expected, leaves[0], do.double())[0]) < 1e-4
