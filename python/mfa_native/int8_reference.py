"""Numpy emulation of int8 attention, written from its semantics (independently of the kernels).

`int8_quantized_reference` quantizes q, k and v as `mfa_native.int8_attention` specifies:
float32 scales absmax / 127 (IEEE float32 division; absmax over the values rounded to
float32), values rint(x / scale) of the exact quotient (halfway to even) clamped to +-127,
means over the keys in float64, and values less their mean (K with smooth_k, V with
pv="int8") exact. It returns what the quantizer kernels store,
by the same names and logical shapes (scales one per row, a tile's rows sharing one).

K's and V's statistics (means, scales) cover the attended keys only: those some query row
of some query head of the (batch, kv head) may see under causal, window and mask
(`attended_keys`, from `mfa_native.reference.masked_logits`). A key no query attends counts
as 0 (its integers are 0; a token scale of such a row is 0), and with none attended the
means are 0. With a rule that may remove keys (causal upper left, a window, a mask) the
flags are returned too, as `k_attended`.

`int8_attention_emulation` runs the rest of the pipeline on those integers: the products in
int64, everything else in float64:

- logits = T(scale * (q_int . k_int * q_scale * k_scale + q . mean(k))) (+ additive mask),
  the last term with smooth_k (the float q, the mean over the attended keys), so the logits
  are the unshifted ones, T the logit cap softcap * tanh(s / softcap) (none without softcap)
  then ALiBi's bias -slope[h] * |i + C - R - j| (none without alibi_slopes);
- pv="float": the softmax of those logits (sinks in the denominator) times v, v's rows of
  keys no query attends 0;
- pv="int8": per aligned block of 64 keys, P_int = rint(127 * exp(logit - block max)) over
  the allowed keys (0 elsewhere); the denominator is sum over blocks of exp(block max - M)
  * sum(P_int) / 127 plus exp(sink - M), M the row's maximum (sink included); the output
  is (sum over blocks of exp(block max - M) / 127 * (P_int . v_int) * v_scale + v_mean *
  the keys' share of the denominator) / denominator;
- lse = M + log(denominator); a row with no allowed key and no sink: output 0, lse -inf.

Masking rules are those of `mfa_native.reference`.
"""

from __future__ import annotations

import numpy as np

from .reference import CAUSAL_MODES, alibi_bias, masked_logits, softcapped

INT8_MAX = 127
P_BLOCK = 64
TILE_ROWS = {"token": (1, 1), "tile": (16, 64)}   # (query rows, key rows) per scale


def _bhsd32(x, layout: str) -> np.ndarray:
    """The tensor's values as float32 (exact for float16 and bfloat16), logical order."""
    x = np.asarray(x).astype(np.float32)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def column_mean(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(..., C, d) float32, the keys no query attends 0, and the attended keys' counts (..., 1)
    -> (..., d): the mean over the attended keys, in float64 (0 when there is none)."""
    return x.astype(np.float64).sum(axis=-2) / np.maximum(counts, 1)


def centered(x: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """x (..., C, d) float32 less its mean (..., d) float64, in float64."""
    return x.astype(np.float64) - mean[..., None, :]


def quantize(x: np.ndarray, absmax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (float64, or float32) against absmax (broadcastable float32) -> (int64 values: the
    integers nearest the exact quotients, halfway to even; float32 scales)."""
    scale = (absmax / np.float32(INT8_MAX)).astype(np.float32)
    usable = (scale > 0) & np.isfinite(scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        quotient = x.astype(np.float64) / np.where(usable, scale, np.float32(1)).astype(np.float64)
        values = np.clip(np.rint(quotient), -INT8_MAX, INT8_MAX)
    return np.where(usable, values, 0).astype(np.int64), scale


def absolute(x: np.ndarray) -> np.ndarray:
    """|x| as float32, the values a scale's absmax is taken over (float32, as the kernels have them)."""
    return np.abs(x.astype(np.float32))


def quantize_rows(x: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """x (..., n, d) (float32, or float64 when centered) with one scale per `rows` rows aligned from row 0 -> int64 values
    (..., n, d) and float32 scales (..., n), a group's rows sharing its scale."""
    n = x.shape[-2]
    groups = -(-n // rows)
    row_max = absolute(x).max(axis=-1)                   # a NaN stays
    padded = np.zeros(row_max.shape[:-1] + (groups * rows,), dtype=np.float32)
    padded[..., :n] = row_max
    group_max = padded.reshape(row_max.shape[:-1] + (groups, rows)).max(axis=-1)
    absmax = np.repeat(group_max, rows, axis=-1)[..., :n]
    values, scale = quantize(x, absmax[..., None])
    return values, scale[..., 0]


def attended_keys(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], causal=False, window=None, mask=None
                  ) -> np.ndarray:
    """(B, Hkv, C) bool, logical shapes (B, Hq, R, D) and (B, Hkv, C, D): whether some row of
    some query head of the kv head may see the key (its logit is not -inf under the rules)."""
    B, Hq, R, _ = q_shape
    Hkv, C = kv_shape[1], kv_shape[2]
    with np.errstate(invalid="ignore"):
        seen = ~np.isneginf(masked_logits(np.zeros((B, Hq, R, C)), causal, window, mask))
    return seen.reshape(B, Hkv, Hq // Hkv, R, C).any(axis=(2, 3))


def _kept(x: np.ndarray, attended: np.ndarray) -> np.ndarray:
    """x (B, H, C, d) with the rows of keys no query attends 0."""
    return np.where(attended[..., None], x, 0)


def int8_quantized_reference(q, k, v, *, causal=False, mask=None, window=None, layout="bhsd", qk_scale="token",
                             smooth_k=True, pv="int8") -> dict[str, np.ndarray]:
    """What the quantizer kernels store (see the module docstring), by buffer name."""
    qf, kf, vf = (_bhsd32(x, layout) for x in (q, k, v))
    q_rows, k_rows = TILE_ROWS[qk_scale]
    attended = attended_keys(qf.shape, kf.shape, causal, window, mask)
    counts = attended.sum(axis=-1)[..., None]
    out: dict[str, np.ndarray] = {}
    if CAUSAL_MODES[causal] == "upper_left" or window is not None or mask is not None:   # rules that may remove keys
        out["k_attended"] = attended.astype(np.int8)
    kf = _kept(kf, attended)
    if smooth_k:
        k_mean = column_mean(kf, counts)
        out["k_mean"] = k_mean.astype(np.float32)
        out["k_mean_low"] = (k_mean - out["k_mean"]).astype(np.float32)
        kf = _kept(centered(kf, k_mean), attended)
        ratio = qf.shape[1] // kf.shape[1]
        mean = np.repeat(out["k_mean"], ratio, axis=1).astype(np.float64)
        out["q_shift"] = np.einsum("bhrd,bhd->bhr", qf.astype(np.float64), mean)
    out["k_int8"], out["k_scale"] = quantize_rows(kf, k_rows)
    out["q_int8"], out["q_scale"] = quantize_rows(qf, q_rows)
    if pv == "int8":
        vf = _kept(vf, attended)
        v_mean = column_mean(vf, counts)
        out["v_mean"] = v_mean.astype(np.float32)
        v_centered = _kept(centered(vf, v_mean), attended)
        values, scale = quantize(v_centered, absolute(v_centered).max(axis=-2, keepdims=True))
        out["v_int8"], out["v_scale"] = values, scale[..., 0, :]
    return out


def int8_attention_emulation(q, k, v, *, scale=None, causal=False, mask=None, window=None, sinks=None,
                             softcap=None, alibi_slopes=None, layout="bhsd", return_lse=False, qk_scale="token",
                             smooth_k=True, pv="int8"):
    """int8 attention's output (float64, laid out like q) and with return_lse its lse."""
    x = int8_quantized_reference(q, k, v, causal=causal, mask=mask, window=window, layout=layout,
                                 qk_scale=qk_scale, smooth_k=smooth_k, pv=pv)
    B, Hq, R, D = x["q_int8"].shape
    C = x["k_int8"].shape[2]
    ratio = Hq // x["k_int8"].shape[1]

    def per_q_head(a):
        return np.repeat(a, ratio, axis=1)

    scale = 1.0 / np.sqrt(D) if scale is None else scale
    integer = np.einsum("bhrd,bhcd->bhrc", x["q_int8"], per_q_head(x["k_int8"]))           # int64
    scores = integer * x["q_scale"][..., None].astype(np.float64) * per_q_head(x["k_scale"])[..., None, :]
    if smooth_k:
        scores = scores + x["q_shift"][..., None]
    transformed = softcapped(scale * scores, softcap)[0]
    logits = masked_logits(transformed + alibi_bias(alibi_slopes, transformed.shape), causal, window, mask)
    sink = (np.broadcast_to(np.asarray(sinks, dtype=np.float64)[None, :, None], (B, Hq, R)) if sinks is not None
            else np.full((B, Hq, R), -np.inf))

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if pv == "float":
            M = np.maximum(logits.max(axis=-1), sink)
            shift = np.where(np.isneginf(M), 0.0, M)
            weights = np.exp(logits - shift[..., None])
            keys = weights.sum(axis=-1)
            attended = attended_keys(x["q_int8"].shape, x["k_int8"].shape, causal, window, mask)
            values = _kept(_bhsd32(v, layout), attended)
            numerator = np.einsum("bhrc,bhcd->bhrd", weights, per_q_head(values).astype(np.float64))
        else:
            blocks = -(-C // P_BLOCK)
            padded = np.full(logits.shape[:-1] + (blocks * P_BLOCK,), -np.inf)
            padded[..., :C] = logits
            padded = padded.reshape(logits.shape[:-1] + (blocks, P_BLOCK))
            block_max = padded.max(axis=-1)                                    # -inf: no allowed key
            reference = np.where(np.isneginf(block_max), 0.0, block_max)[..., None]
            p_int = np.where(np.isneginf(padded), 0.0, np.rint(INT8_MAX * np.exp(padded - reference)))
            M = np.maximum(block_max.max(axis=-1), sink)
            shift = np.where(np.isneginf(M), 0.0, M)
            unit = np.exp(block_max - shift[..., None]) / INT8_MAX             # 0 for empty blocks
            keys = (unit * p_int.sum(axis=-1)).sum(axis=-1)
            v_int = np.zeros(x["v_int8"].shape[:2] + (blocks * P_BLOCK, x["v_int8"].shape[-1]), dtype=np.int64)
            v_int[:, :, :C] = x["v_int8"]
            v_int = per_q_head(v_int.reshape(v_int.shape[:2] + (blocks, P_BLOCK, v_int.shape[-1])))
            block_pv = np.einsum("bhrnk,bhnkd->bhrnd", p_int.astype(np.int64), v_int)   # exact integers
            numerator = (np.einsum("bhrn,bhrnd->bhrd", unit, block_pv.astype(np.float64))
                         * per_q_head(x["v_scale"])[:, :, None, :]
                         + per_q_head(x["v_mean"])[:, :, None, :] * keys[..., None])
        denominator = keys + np.exp(sink - shift)
        empty = np.isneginf(M)
        out = np.where(empty[..., None], 0.0, numerator / denominator[..., None])
        lse = np.where(empty, -np.inf, shift + np.log(denominator))
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out
