"""mfa_native.torch: custom ops (opcheck, autograd, torch.compile), SDPA semantics, sdpa_override."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import relative_l2

torch = pytest.importorskip("torch")
F = torch.nn.functional
mt = pytest.importorskip("mfa_native.torch")
from mfa_native.torch.score_mod import trace  # noqa: E402


def _tensors(rng, *shapes, dtype=torch.float32):
    return [torch.from_numpy(rng.standard_normal(s)).to(dtype).requires_grad_() for s in shapes]


def _l2(a, b) -> float:
    return relative_l2(a.detach().double().numpy(), b.detach().double().numpy())


def _reference_with_sinks(q, k, v, sinks, causal):
    """float64 attention with one extra logit per head (no value), GQA by repeating kv heads."""
    q, k, v, sinks = (x.double() for x in (q, k, v, sinks))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        R, C = logits.shape[-2:]
        logits = logits.masked_fill(~torch.ones(R, C, dtype=torch.bool).tril(C - R), float("-inf"))
    logits = torch.cat([logits, sinks[None, :, None, None].expand(*logits.shape[:-1], 1)], -1)
    return logits.softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_attention_gradients_match_torch_autograd(rng, dtype, tolerance):
    q, k, v = _tensors(rng, (2, 4, 20, 32), (2, 2, 28, 32), (2, 2, 28, 24), dtype=dtype)
    sinks = torch.from_numpy(rng.standard_normal(4).astype(np.float32)).requires_grad_()
    do = torch.from_numpy(rng.standard_normal((2, 4, 20, 24))).to(dtype)
    o = mt.attention(q, k, v, causal=True, sinks=sinks)
    expected = _reference_with_sinks(q, k, v, sinks, causal=True)
    assert o.dtype == dtype and _l2(o, expected) < tolerance
    got = torch.autograd.grad(o, (q, k, v, sinks), do)
    want = torch.autograd.grad(expected, (q, k, v, sinks), do.double())
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert a.dtype == (torch.float32 if name == "dsinks" else dtype)
        assert _l2(a, b) < 4 * tolerance, name


def test_lse_is_returned_and_not_differentiable(rng):
    q, k, v = _tensors(rng, (1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
    o, lse = mt.attention(q, k, v, return_lse=True)
    expected = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) / 4.0, -1)
    assert _l2(lse, expected) < 1e-6 and not lse.requires_grad


@pytest.mark.parametrize("sinks", [False, True])
def test_opcheck(rng, sinks):
    q, k, v = _tensors(rng, (1, 4, 8, 16), (1, 2, 12, 16), (1, 2, 12, 8))
    s = torch.randn(4, requires_grad=True) if sinks else None
    mask = torch.from_numpy(rng.random((8, 12)) > 0.3)
    slopes = torch.rand(4)
    table = torch.randn(4, 20)   # a score_mod's captured tensor: the schema's Tensor[]
    text, tensors = trace(lambda score, b, h, i, j: score + table[h, i - j + 12])
    options = (0.3, "upper_left", None, 5.0, text, "bhsd")   # the backward's; the forward's end with deterministic
    torch.library.opcheck(torch.ops.mfa_native.attention.default,
                          (q, k, v, mask, s, slopes, tensors, *options, "run_to_run"))
    o, lse = torch.ops.mfa_native.attention(q, k, v, mask, s, slopes, tensors, *options, "run_to_run")
    do = torch.randn_like(o)
    plain = (x if x is None else x.detach() for x in (q, k, v, o, lse, do, mask, s, slopes))  # no double backward
    torch.library.opcheck(torch.ops.mfa_native.attention_backward.default, (*plain, tensors, *options))


class _Block(torch.nn.Module):
    """A tiny attention block: projections, mfa_native attention, output projection."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        B, S, W = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, W // self.heads).unbind(2)
        o = mt.attention(q, k, v, causal=True, layout="bshd")
        return self.out(o.reshape(B, S, W))


def test_torch_compile_fullgraph(rng):
    torch.manual_seed(int(rng.integers(1 << 31)))
    block = _Block()
    x = torch.randn(2, 16, 32, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager_out, compiled_out = block(x), compiled(x)
    assert _l2(compiled_out, eager_out) < 1e-6
    eager_grads = torch.autograd.grad(eager_out.square().sum(), (x, *block.parameters()))
    compiled_grads = torch.autograd.grad(compiled_out.square().sum(), (x, *block.parameters()))
    assert all(_l2(a, b) < 1e-5 for a, b in zip(compiled_grads, eager_grads))


SDPA_CASES = {
    "4d": dict(q=(2, 4, 10, 16), k=(2, 4, 14, 16), v=(2, 4, 14, 8)),
    "3d": dict(q=(3, 10, 16), k=(3, 14, 16), v=(3, 14, 16)),
    "2d": dict(q=(10, 16), k=(14, 16), v=(14, 16)),
    "5d broadcast batch": dict(q=(2, 3, 2, 6, 16), k=(1, 3, 2, 9, 16), v=(2, 1, 2, 9, 16)),
    "heads broadcast": dict(q=(2, 4, 10, 16), k=(2, 1, 14, 16), v=(2, 1, 14, 16)),
    "gqa": dict(q=(2, 8, 10, 16), k=(2, 2, 14, 16), v=(2, 2, 14, 16), enable_gqa=True),
    "gqa k/v heads differ": dict(q=(1, 4, 10, 16), k=(1, 2, 14, 16), v=(1, 1, 14, 16), enable_gqa=True),
    "causal L < S": dict(q=(2, 2, 6, 16), k=(2, 2, 14, 16), v=(2, 2, 14, 16), is_causal=True),
    "causal L > S": dict(q=(2, 2, 14, 16), k=(2, 2, 6, 16), v=(2, 2, 6, 16), is_causal=True),
    "bool mask": dict(q=(2, 2, 10, 16), k=(2, 2, 14, 16), v=(2, 2, 14, 16), mask=("bool", (10, 14))),
    "float mask, batch-broadcast": dict(q=(2, 2, 10, 16), k=(2, 2, 14, 16), v=(2, 2, 14, 16),
                                        mask=("float", (2, 1, 10, 14))),
    "bool mask, 5d": dict(q=(2, 3, 2, 6, 16), k=(2, 3, 2, 9, 16), v=(2, 3, 2, 9, 16), mask=("bool", (3, 1, 6, 9))),
    "scale": dict(q=(1, 2, 10, 16), k=(1, 2, 14, 16), v=(1, 2, 14, 16), scale=0.05),
}


def _sdpa_arguments(rng, case, dtype=torch.float32):
    q, k, v = _tensors(rng, case["q"], case["k"], case["v"], dtype=dtype)
    kwargs = {name: case[name] for name in ("is_causal", "scale", "enable_gqa") if name in case}
    if "mask" in case:
        kind, shape = case["mask"]
        mask = torch.from_numpy(rng.random(shape) > 0.3) if kind == "bool" else \
            torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        kwargs["attn_mask"] = mask
    return (q, k, v), kwargs


@pytest.mark.parametrize("case", SDPA_CASES, ids=list(SDPA_CASES))
def test_sdpa_matches_torch(rng, case):
    (q, k, v), kwargs = _sdpa_arguments(rng, SDPA_CASES[case])
    out = mt.scaled_dot_product_attention(q, k, v, **kwargs)
    double_kwargs = dict(kwargs)
    if "attn_mask" in kwargs and kwargs["attn_mask"].dtype != torch.bool:
        double_kwargs["attn_mask"] = kwargs["attn_mask"].double()
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **double_kwargs)
    assert out.shape == expected.shape and out.dtype == q.dtype
    assert _l2(out, expected) < 1e-5
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(expected, (q, k, v), do.double())):
        assert a.shape == b.shape and _l2(a, b) < 1e-5


def test_sdpa_rows_without_keys_give_zero_as_torch(rng):
    (q, k, v), _ = _sdpa_arguments(rng, SDPA_CASES["4d"])
    mask = torch.ones(10, 14, dtype=torch.bool)
    mask[3] = False
    out = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3])) and _l2(out, expected) < 1e-5


def test_sdpa_errors(rng):
    (q, k, v), _ = _sdpa_arguments(rng, SDPA_CASES["4d"])
    with pytest.raises(NotImplementedError, match="dropout"):
        mt.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    mask = torch.ones(10, 14, dtype=torch.bool)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), pytest.raises(RuntimeError) as theirs:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    with pytest.raises(RuntimeError) as ours:
        mt.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    assert str(ours.value) == str(theirs.value)
    for a, b, c, m in ((q, k.double(), v, None), (q, k, v, mask.half())):
        with pytest.raises(RuntimeError) as theirs:
            F.scaled_dot_product_attention(a, b, c, attn_mask=m)
        with pytest.raises(RuntimeError) as ours:
            mt.scaled_dot_product_attention(a, b, c, attn_mask=m)
        assert str(ours.value) == str(theirs.value)


def test_sdpa_override_routes_and_falls_back(rng, monkeypatch):
    from mfa_native.torch import sdpa

    routed = []
    run = sdpa._run
    monkeypatch.setattr(sdpa, "_run", lambda *a: routed.append(1) or run(*a))
    original = F.scaled_dot_product_attention
    (q, k, v), _ = _sdpa_arguments(rng, SDPA_CASES["gqa"])
    finite_min = torch.zeros(10, 14)
    finite_min[4] = torch.finfo(torch.float32).min  # Transformers' padding value: torch averages this row
    with mt.sdpa_override():
        ours = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert len(routed) == 1
        for kwargs in (dict(dropout_p=0.5, enable_gqa=True), dict(attn_mask=finite_min, enable_gqa=True)):
            F.scaled_dot_product_attention(q, k, v, **kwargs)
        F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k[..., :8], v)  # torch's own shape error
        assert len(routed) == 1
        with_min = F.scaled_dot_product_attention(q, k, v, attn_mask=finite_min, enable_gqa=True)
    assert F.scaled_dot_product_attention is original
    assert _l2(ours, original(q, k, v, enable_gqa=True)) < 1e-5
    assert _l2(with_min, original(q, k, v, attn_mask=finite_min, enable_gqa=True)) < 1e-6


class _TransformersStyleAttention(torch.nn.Module):
    """What a Transformers attention layer does: look up F.scaled_dot_product_attention when called."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Linear(32, 96)

    def forward(self, x, attention_mask):
        q, k, v = self.block(x).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=0.3)


def test_sdpa_override_in_a_model(rng):
    torch.manual_seed(int(rng.integers(1 << 31)))
    model = _TransformersStyleAttention()
    x = torch.randn(2, 12, 32)
    padding = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    padding[1, ..., 9:] = False
    expected = model(x, padding)
    with mt.sdpa_override():
        got = model(x, padding)
    assert _l2(got, expected) < 1e-5


EMPTY_CASES = {"no batch": (0, 2, 5, 7), "no heads": (2, 0, 5, 7), "no queries": (2, 2, 0, 7),
               "no keys": (2, 2, 5, 0)}


@pytest.mark.parametrize("is_causal,mask", [(False, None), (True, None), (False, "bool"), (False, "float")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", EMPTY_CASES, ids=list(EMPTY_CASES))
def test_sdpa_of_empty_inputs_is_torchs(rng, case, dtype, is_causal, mask):
    """Zero batch, heads, queries or keys: torch's output (shape, dtype, values: zeros for no
    keys) and torch's gradients."""
    B, H, L, S = EMPTY_CASES[case]
    q, k, v = _tensors(rng, (B, H, L, 16), (B, H, S, 16), (B, H, S, 8), dtype=dtype)
    attn_mask = None if mask is None else torch.from_numpy(rng.random((L, S)) > 0.3)
    if mask == "float":
        attn_mask = attn_mask.to(dtype)
    out = mt.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    assert out.shape == expected.shape and out.dtype == expected.dtype and torch.equal(out, expected)
    do = torch.from_numpy(rng.standard_normal(tuple(out.shape))).to(dtype)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(expected, (q, k, v), do)):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("format,bits", [("affine", 4), ("q8_0", None), ("q4_0", None)])
def test_attention_over_quantized_k_v_differentiates_q(rng, format, bits):
    """mt.attention(q, QuantizedTensor, QuantizedTensor): attention over their dequantize(),
    with dq and dsinks as over those floats; the quantized K/V are constants, and a gradient
    asked of one of their fields raises."""
    from mfa_native import quantize

    (q, k, v), sinks = _tensors(rng, (2, 4, 10, 64), (2, 2, 14, 64), (2, 2, 14, 32)), _tensors(rng, (4,))[0]
    qk, qv = (quantize(x.detach(), format, bits, 32 if format == "affine" else None) for x in (k, v))
    o, lse = mt.attention(q, qk, qv, causal=True, sinks=sinks, return_lse=True)
    floats = [x.dequantize().double() for x in (qk, qv)]
    expected = _reference_with_sinks(q, *floats, sinks, causal=True)
    assert _l2(o, expected) < 1e-5 and not lse.requires_grad
    do = torch.randn_like(o)
    for got, want in zip(torch.autograd.grad(o, (q, sinks), do), torch.autograd.grad(expected, (q, sinks), do)):
        assert _l2(got, want) < 1e-5
    if format == "affine":
        qk.scales.requires_grad_()
        with pytest.raises(NotImplementedError, match="k.scales is a field of a QuantizedTensor"):
            torch.autograd.grad(mt.attention(q.detach(), qk, qv).sum(), qk.scales)


def test_sdpa_override_runs_a_transformers_llama(rng, monkeypatch):
    """A tiny random Transformers Llama (GQA, a left-padded batch) gives the same logits and
    parameter gradients with and without sdpa_override, and the override ran mfa_native."""
    transformers = pytest.importorskip("transformers")
    from mfa_native.torch import sdpa

    routed = []
    run = sdpa._run
    monkeypatch.setattr(sdpa, "_run", lambda *a: routed.append(1) or run(*a))
    torch.manual_seed(int(rng.integers(1 << 31)))
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    ids = torch.from_numpy(rng.integers(0, 101, size=(2, 12)))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :3] = 0

    def logits_and_gradients():
        logits = model(ids, attention_mask=padding).logits
        return logits, torch.autograd.grad(logits.square().sum(), list(model.parameters()))

    expected, expected_grads = logits_and_gradients()
    with mt.sdpa_override():
        logits, grads = logits_and_gradients()
    assert len(routed) == config.num_hidden_layers
    assert _l2(logits, expected) < 1e-5
    assert all(_l2(a, b) < 1e-4 for a, b in zip(grads, expected_grads))


def test_a_script_ending_with_a_live_autograd_output_prints_nothing(tmp_path):
    """Interpreter exit with torch outputs alive (an autograd graph saving pool memory) is
    quiet: nanobind printed a 20-line leak report that was no leak."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("import torch, mfa_native\n"
                      "q = torch.randn(1, 2, 16, 8, requires_grad=True)\n"
                      "out, lse = mfa_native.attention(q, q, q, causal=True, return_lse=True)\n"
                      "loss = (out * out).sum()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
