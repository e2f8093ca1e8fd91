"""Float8 K/V caches (`attention_with_kvcache`): which caches are float8, and their descale
factors, flash-attn 3's `q_descale`, `k_descale`, `v_descale`, checked and bound as the
(B, Hkv) float32 arrays the kernels read (codegen/storage/float8.py).

A descale is float32, (B, Hkv) (flash-attn 3's shape; any strides, an expanded view included)
or a single factor ((1,) or 0-d: FlashMLA's per-tensor descale), bound as a (B, Hkv) view
with stride 0. None is 1. k_descale and v_descale are for float8 caches only; q is never
float8 here, so q_descale multiplies q (each query head by its kv head's factor) and is folded
into K's factor: it needs a float8 k_cache. Their rules are ops/kvcache_rules.py's.
"""

from __future__ import annotations

import numpy as np

from ..quant_formats import FLOAT8_FORMATS, Float8Format
from . import arguments as check

DESCALES = ("q_descale", "k_descale", "v_descale")


def float8_format(x) -> Float8Format | None:
    """The float8 format of a cache given as a numpy array of an ml_dtypes float8 dtype, else None."""
    dtype = getattr(x, "dtype", None)
    return FLOAT8_FORMATS.get(getattr(dtype, "name", None)) if isinstance(x, np.ndarray) else None


def stored_bytes(x: np.ndarray) -> np.ndarray:
    """A float8 array's bytes (a uint8 view, no copy); any other array as it is."""
    return x.view(np.uint8) if float8_format(x) is not None else x


def descale_rows(descale, name: str, batch: int, kv_heads: int) -> np.ndarray:
    """Descale argument `name` (its rule checked: float32, (B, Hkv) or a single factor) as the
    (B, Hkv) float32 view the kernels read (None: 1); a copy where its strides are not
    non-negative whole elements."""
    if descale is None:
        return np.broadcast_to(np.ones(1, np.float32), (batch, kv_heads))
    x = check.as_array(descale, name)
    if x.shape in ((), (1,)):
        return np.broadcast_to(x.reshape(1), (batch, kv_heads))
    return check.normalized(x if all(s >= 0 and s % 4 == 0 for s in x.strides) else np.ascontiguousarray(x))


def bound_descales(values: dict, formats: dict, batch: int, kv_heads: int) -> dict[str, np.ndarray]:
    """The descale arguments of a call (`values` by name, their rules checked) as bound:
    "k_descale" and "v_descale" for each float8 cache (`formats`: "k", "v" -> its
    Float8Format or None), "q_descale" when given (its rule needs a float8 k_cache)."""
    return {name: descale_rows(values[name], name, batch, kv_heads) for name in DESCALES
            if formats["k" if name == "q_descale" else name[0]] is not None
            and (name != "q_descale" or values[name] is not None)}
