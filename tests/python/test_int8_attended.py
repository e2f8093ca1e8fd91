"""int8_attention's statistics run over the keys some query may attend (issue 19, item 7).

A padded KV cache holds slots no query attends (masked by a bool mask, an additive -inf,
causal or the window). Their values, even 1e4 or NaN, must neither move K's mean, V's
mean or the K/V scales nor reach the output; a NaN in a key some row attends still
reaches that row. Outputs are poisoned (NaN) before every run (conftest), inputs fresh
per test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from conftest import relative_l2

import mfa_native
from mfa_native.bench.int8_accuracy import INPUTS
from mfa_native.int8_reference import int8_attention_emulation, int8_quantized_reference
from mfa_native.ops.int8_attention import int8_quantized
from mfa_native.reference import attention_reference

B, H, R, D = 2, 2, 20, 32


@dataclass(frozen=True)
class Padded:
    """A cache of `real` keys with `pad` slots in front (`front`) or behind, which the masking
    rules (`kwargs`; `mask`: "bool" or "additive" over the padding) leave to no query."""

    name: str
    real: int
    pad: int
    front: bool = False
    kwargs: tuple = ()
    mask: str | None = None

    @property
    def keys(self) -> slice:
        return slice(self.pad, None) if self.front else slice(0, self.real)

    def arguments(self, rng, fill: float) -> tuple[tuple[np.ndarray, ...], dict, dict]:
        """q, k, v (the padding holding `fill`), the padded call's keyword arguments and those of
        the same problem on the real keys alone."""
        C = self.real + self.pad
        q, k, v = INPUTS["gaussian"](rng, [(B, H, R, D), (B, H, C, D), (B, H, C, D)])
        pad = np.ones(C, dtype=bool)
        pad[self.keys] = False
        k[:, :, pad] = fill
        v[:, :, pad] = fill
        padded, real = dict(self.kwargs), dict(self.kwargs)
        if self.mask is not None:
            real_mask = self._real_mask(rng)
            full = np.zeros(real_mask.shape[:-1] + (pad.size,), dtype=real_mask.dtype)
            full[..., pad] = False if self.mask == "bool" else -np.inf
            full[..., self.keys] = real_mask
            padded["mask"], real["mask"] = full, real_mask
        return (q, k, v), padded, real

    def _real_mask(self, rng) -> np.ndarray:
        if self.mask == "bool":
            return rng.random((B, 1, R, self.real)) > 0.3
        mask = rng.standard_normal((H, R, self.real)).astype(np.float32)
        mask[:, ::4, :7] = -np.inf
        return mask


CASES = [
    Padded("bool mask", real=77, pad=51, mask="bool"),
    Padded("additive mask", real=70, pad=26, mask="additive"),
    Padded("causal upper left", real=R, pad=60, kwargs=(("causal", "upper_left"),)),
    Padded("window, causal lower right", real=R + 30, pad=70, front=True,
           kwargs=(("causal", True), ("window", (30, -1)))),
    Padded("window", real=R + 40, pad=45, front=True, kwargs=(("window", (40, 3)),)),
]
FILLS = (1e4, np.nan)


@pytest.mark.parametrize("pv", ["int8", "float"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_padding_no_query_attends_changes_nothing(rng, case, pv):
    """The padded call is as close to float64 attention on the real keys as the unpadded one
    (its error measured on the same inputs), whatever the padding holds."""
    for fill in FILLS:
        (q, k, v), padded, real = case.arguments(rng, fill)
        keys = case.keys
        expected = attention_reference(q, k[:, :, keys], v[:, :, keys], **real)
        unpadded = relative_l2(mfa_native.int8_attention(q, k[:, :, keys], v[:, :, keys], pv=pv, **real), expected)
        error = relative_l2(mfa_native.int8_attention(q, k, v, pv=pv, **padded), expected)
        assert error <= 1.5 * unpadded + 1e-3, (fill, error, unpadded)


@pytest.mark.parametrize("case", CASES[:4], ids=[c.name for c in CASES[:4]])
def test_padded_calls_compute_the_emulated_pipeline(rng, case):
    """The kernels and the numpy emulation agree on which keys the statistics cover."""
    (q, k, v), padded, _ = case.arguments(rng, np.nan)
    for options in (dict(qk_scale="tile", smooth_k=True, pv="int8"), dict(qk_scale="token", smooth_k=True, pv="float")):
        out, lse = mfa_native.int8_attention(q, k, v, return_lse=True, **options, **padded)
        expected, expected_lse = int8_attention_emulation(q, k, v, return_lse=True, **options, **padded)
        assert relative_l2(out, expected) <= 1e-4, options
        np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pv", ["int8", "float"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_an_attended_key_reaches_its_rows_and_padding_does_not(rng, where, pv):
    """Head 0: a NaN in a real key makes every row attending it NaN. Head 1: NaN only in
    the padding, and its output is finite."""
    case = CASES[0]
    (q, k, v), padded, _ = case.arguments(rng, np.nan)
    {"k": k, "v": v}[where][1, 0, 5, 3] = np.nan
    out = mfa_native.int8_attention(q, k, v, pv=pv, **padded)
    attends = padded["mask"][1, 0, :, 5]
    assert attends.any() and np.isnan(out[1, 0, attends]).any(axis=-1).all()
    assert np.isfinite(out[1, 1]).all() and np.isfinite(out[0]).all()


@pytest.mark.parametrize("sinks", [False, True])
def test_a_head_with_no_attendable_key_gives_what_a_fully_masked_row_gives(rng, sinks):
    """Batch 1 may attend no key (its keys NaN): output 0 and lse -inf (or the sink), as in
    attention; batch 0 is unaffected."""
    (q, k, v), padded, _ = CASES[0].arguments(rng, np.nan)
    padded["mask"][1] = False
    k[1], v[1] = np.nan, np.nan
    if sinks:
        padded["sinks"] = rng.standard_normal(H).astype(np.float32)
    for pv in ("int8", "float"):
        out, lse = mfa_native.int8_attention(q, k, v, pv=pv, return_lse=True, **padded)
        _, dense_lse = mfa_native.attention(q, k, v, return_lse=True, **padded)
        assert np.all(out[1] == 0)
        np.testing.assert_array_equal(lse[1], dense_lse[1])
        assert np.isfinite(out[0]).all()


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[CASES[0].name, CASES[3].name])
def test_quantizers_cover_the_attended_keys_as_the_numpy_quantizer(rng, case):
    """Which keys are attended, the means and the scales, as the numpy quantizer has them:
    the padding's integers are 0."""
    (q, k, v), padded, _ = case.arguments(rng, 1e4)
    got = int8_quantized(q, k, v, qk_scale="tile", **padded)
    expected = int8_quantized_reference(q, k, v, qk_scale="tile", **padded)
    assert set(got) == set(expected) and "k_attended" in got
    np.testing.assert_array_equal(got["k_attended"], expected["k_attended"])
    for name in ("k_int8", "v_int8"):
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    for name in ("k_scale", "v_scale", "v_mean", "k_mean"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=0, err_msg=name)


def test_a_key_one_query_head_of_a_kv_head_attends_is_attended(rng):
    """GQA with a mask per query head: a key counts when any query head of its kv head may
    see it, and only then."""
    q, k, v = INPUTS["gaussian"](rng, [(1, 4, R, D), (1, 2, 90, D), (1, 2, 90, D)])
    mask = np.zeros((4, R, 90), dtype=bool)
    mask[:, :, :50] = rng.random((4, R, 50)) > 0.5
    mask[1, 3, 70] = True                       # kv head 0: only query head 1 sees key 70
    k[:, :, 50:], v[:, :, 50:] = np.nan, np.nan
    k[0, 0, 70], v[0, 0, 70] = rng.standard_normal((2, D))
    got = int8_quantized(q, k, v, mask=mask)
    expected = int8_quantized_reference(q, k, v, mask=mask)
    np.testing.assert_array_equal(got["k_attended"], expected["k_attended"])
    assert got["k_attended"][0, 0, 70] == 1 and got["k_attended"][0, 1, 70] == 0
    out = mfa_native.int8_attention(q, k, v, mask=mask, pv="float")
    assert relative_l2(out, int8_attention_emulation(q, k, v, mask=mask, pv="float")) <= 1e-4
