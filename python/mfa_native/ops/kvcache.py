"""`mfa_native.attention_with_kvcache`: flash-attn's flash_attn_with_kvcache, contiguous or
paged, plain or quantized (QuantizedTensor caches), with the new rows appended to the
caller's cache in place, declared once.

The append runs on the device, first in the attention pass: the append kernels
(codegen/attention/append.py) write k and v into the caller's cache buffers, bound in place
as the pass's "inout" buffers, and quantize them on the way for a quantized cache (with
`quantize`'s encoder: the same integers and scales); the attention kernel then reads the
cache over each batch's attended length (codegen/attention/cache.py). Every check of the call
runs first, on every call, so nothing is written on an error. With rotary tables, rotation
kernels (codegen/attention/rotary.py) turn q and the new k first in the same pass
(ops/rotary.py). An empty problem (no kernel runs) appends plain rows on the host. The caches
must be memory the pass can bind writable in place: numpy arrays, torch CPU tensors, or contiguous torch MPS tensors (bound through
DLPack, so the device append writes them; with an append, a non-contiguous MPS cache is a
ValueError: given_kind checks the arguments declared `written_with`). For MLX caches,
`mfa_native.mlx.attention_with_kvcache` appends with MLX's own in-place update, then calls
this without an append. Inference only.

A paged cache is bound as its pages' rows (ops/pages.py: any page size, any layout whose pages
are whole rows apart, read in place), shared by every batch (batch stride 0). A paged
QuantizedTensor cache has
the pages' layout in every field: data (num_blocks, page_size, Hkv, D * bits / 32 words or
D / 32 blocks) and affine scales and biases (num_blocks, page_size, Hkv, D / group_size).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import codegen, reference
from ..codegen import CacheKeys
from ..quantized import QuantizedTensor
from ..runtime.devices import tuning_facts
from . import arguments as check
from . import kvcache_rules as rules
from . import rotary as rotation
from .attention import (ALIBI_SLOPES, CAUSAL, DETERMINISTIC, LSE, OUTPUT, RETURN_LSE, SCALE, SINKS, SOFTCAP, WINDOW,
                        Validated, validate, with_determinism)
from .declaration import Arg, Call, Op
from .empty import empty_forward
from .pages import as_rows, page_rows
from .rules import Binding
from .float8_cache import bound_descales, descale_rows, float8_format, stored_bytes
from .score_mod import SCORE_MOD, SCORE_MOD_TENSORS, with_score_mod
from .warm import prepared_call

NEW_ROWS = {"k_new": "k", "v_new": "v"}   # the pass buffers of the appended rows, and their arguments

Q = Arg("q", "array", rule=rules.RULES["q"], leading=True, keyword=False, doc="""
    (B, R, Hq, D) queries ("bshd"), one kind and dtype with the caches (float32, float16,
    bfloat16: numpy arrays or torch tensors, CPU or MPS, whose memory the append writes).""")
CACHE_TYPES = "numpy arrays, torch CPU or contiguous MPS tensors, or QuantizedTensors of them"
K_CACHE = Arg("k_cache", "array", rule=rules.RULES["k_cache"], leading=True, keyword=False, written_with="k", doc="""
    contiguous (B, Cmax, Hkv, D), or with block_table the pages (num_blocks, page_size, Hkv,
    D), any page_size (1 included); the pages are read in place through their strides: one
    after another, or whole rows apart with other data between them (FlashInfer's HND cache
    (num_pages, Hkv, page_size, D) as `x.transpose(0, 2, 1, 3)`; its stacked (num_pages, 2,
    page_size, Hkv, D) cache as `x[:, 0]` and `x[:, 1]`, not with an append on Metal), k's and
    v's alike. Rows past a batch's attended length are never read (they may hold NaN). May be a
    QuantizedTensor (affine or a GGUF format; paged: every field laid out in pages, scales
    (num_blocks, page_size, Hkv, D / group_size)): read in the kernel as stored, and the
    appended rows quantized on the device as `quantize` does. May be float8 (a numpy array of
    ml_dtypes.float8_e4m3fn or float8_e5m2, or a torch CPU tensor of those; k and v may differ):
    its bytes read in place and decoded in registers, times k_descale (v_descale), and the
    appended rows encoded on the device. An MPS tensor is bound in place (DLPack); with an
    append it must be contiguous (ValueError otherwise).""")
V_CACHE = Arg("v_cache", "array", rule=rules.RULES["v_cache"], leading=True, keyword=False, written_with="v", doc="like k_cache, Dv wide.")
CACHE_SEQLENS = Arg("cache_seqlens", "array", rule=rules.RULES["cache_seqlens"], default=None, doc="""
    int32 (B,): each batch's valid cache length before this call (not modified). None (flash-attn's
    rule): every batch's length is the cache's capacity, Cmax, or with block_table its width times
    page_size (every listed page read); required with k and v (ValueError naming it).""")
K_NEW = Arg("k", "array", rule=rules.RULES["k"], default=None, doc="""
    (B, Rn, Hkv, D), optional: written into k_cache IN PLACE at positions cache_seqlens[b] ..
    cache_seqlens[b] + Rn - 1 and attended in this call (attended length cache_seqlens[b] + Rn).""")
V_NEW = Arg("v", "array", rule=rules.RULES["v"], default=None, doc="(B, Rn, Hkv, Dv): the same for v_cache (given with k).")
DESCALE_DOC = """
    float32 (B, Hkv) (flash-attn 3's descale, any strides: an expanded view too) or
    a single factor ((1,) or 0-d, FlashMLA's per-tensor descale); None is 1."""
Q_DESCALE = Arg("q_descale", "array", rule=rules.RULES["q_descale"], default=None, doc=DESCALE_DOC + """ Multiplies q: query head
    h by its kv head's factor (q is float here; flash-attn 3 reads it for a float8 q). It is folded
    into K's factor, so it needs a float8 k_cache (ValueError otherwise).""")
K_DESCALE = Arg("k_descale", "array", rule=rules.RULES["k_descale"], default=None, doc=DESCALE_DOC + """ For a float8 k_cache only
    (ValueError otherwise): the keys are k_cache * k_descale[b, kv head], and an appended k is
    stored as float8(k / k_descale) (float32 quotient, rounded to nearest even; e4m3fn saturates
    at +-448, e5m2 overflows to inf, as torch's `.to()`).""")
V_DESCALE = Arg("v_descale", "array", rule=rules.RULES["v_descale"], default=None, doc="the same for a float8 v_cache.")
BLOCK_TABLE = Arg("block_table", "array", rule=rules.RULES["block_table"], default=None, doc="""
    int32 (B, max_blocks), optional (a paged cache): logical position p of batch b lives in
    page block_table[b, p // page_size] at row p % page_size. Entries of pages no attended
    key lies in are not read.""")


CHECKED = tuple(name for name in rules.RULES if name not in ("q", "k_cache", "v_cache"))   # the rules' others


class Cache:
    """The call's caches: their rules' binding (the sizes, every array's form; the contents on
    every call) and how they bind (the pages' layout, the rows the kernels read)."""

    def __init__(self, values: dict) -> None:
        """`values`: the call's arguments by name (q, the caches and the rules' other arrays)."""
        q = check.as_array(values["q"], "q")
        caches = {name: values[name] if isinstance(values[name], QuantizedTensor) else check.as_array(values[name], name)
                  for name in ("k_cache", "v_cache")}
        given = check.given_arrays(values, CHECKED)
        self.paged = given["block_table"] is not None
        self.float8 = {"k": float8_format(caches["k_cache"]), "v": float8_format(caches["v_cache"])}   # None: not float8
        k = given["k"]
        sizes = {"paged": int(self.paged), "Rn": k.shape[1] if k is not None and k.ndim > 1 else 0,
                 "k_float8": int(self.float8["k"] is not None), "v_float8": int(self.float8["v"] is not None)}
        axes = "(num_blocks, page_size, Hkv, D)" if self.paged else "(B, Cmax, Hkv, D)"
        self.binding = Binding(rules.RULES, rules.CHECKS, "bshd", sizes, {"cache_axes": axes})
        self.binding.bind({"q": (q.shape, str(q.dtype)), **{
            name: (tuple(x.shape), None if isinstance(x, QuantizedTensor) else str(x.dtype))
            for name, x in caches.items()}})
        self.binding.check_forms(given)
        sizes = self.binding.sizes
        self.batch, self.kv_heads, self.appended = sizes["B"], sizes["Hkv"], sizes["Rn"]
        self.page = sizes["P"] if self.paged else None
        if self.paged:
            self.width = sizes["Wt"]
            self.page_rows, v_rows = page_rows(caches["k_cache"], "k_cache"), page_rows(caches["v_cache"], "v_cache")
            if v_rows != self.page_rows:
                raise ValueError(f"v_cache's pages must be as many rows apart as k_cache's ({self.page_rows}), got "
                                 f"{v_rows}")
            self.capacity = self.width * self.page
        else:
            self.capacity = sizes["P"]

    def descales(self, values: dict) -> dict[str, np.ndarray]:
        """The descale arguments (by name in `values`) bound, (B, Hkv) float32 (float8_cache)."""
        return bound_descales(values, self.float8, self.batch, self.kv_heads)

    def caches(self, k_cache, v_cache) -> tuple[np.ndarray, np.ndarray]:
        """k and v as the kernel reads them: (B, C, Hkv, D) rows."""
        k_cache, v_cache = (x if isinstance(x, QuantizedTensor) else check.as_array(x, name)
                            for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")))
        if not self.paged:
            return k_cache, v_cache
        return as_rows(k_cache, self.batch, self.page_rows), as_rows(v_cache, self.batch, self.page_rows)

    def keys(self, rotary=None, rotary_positions: int = 0) -> CacheKeys:
        return CacheKeys(self.appended, self.page, self.width if self.paged else None,
                         self.page_rows if self.paged else None, rotary, rotary_positions)

    def check(self, values: dict) -> None:
        """Every call: the arrays' contents by their rules (the lengths, the room to append, the
        pages read, the rotary positions)."""
        self.binding.check_contents_of(check.given_arrays(values, CHECKED))

    def lengths(self, cache_seqlens) -> np.ndarray:
        """cache_seqlens as bound, None being the cache's capacity for every batch (flash-attn's rule)."""
        if cache_seqlens is None:
            return np.full(self.batch, self.capacity, np.int32)
        return np.ascontiguousarray(check.as_array(cache_seqlens, "cache_seqlens"))

    def writable(self, k_cache, v_cache) -> None:
        """Raises TypeError unless every array the append writes is writable (each call)."""
        if not self.appended:
            return
        for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            for field, x in _arrays(cache, name).items():
                if not x.flags.writeable:
                    raise TypeError(f"{field} is read-only here ({type(_given(cache, field)).__name__}): the append "
                                    f"writes it in place ({CACHE_TYPES} can be written; for MLX caches use "
                                    "mfa_native.mlx.attention_with_kvcache)")

    def apart_where_staged(self, k_cache, v_cache, device_kind: str) -> None:
        """Raises ValueError when the append writes k_cache and v_cache on Metal and they share
        memory (the halves of one stacked tensor): Metal stages host memory it cannot wrap per
        binding and copies each staged range back whole, so one cache's copy would overwrite the
        other's new rows. The cpu backend binds host memory in place, where they may share it."""
        if not self.appended or device_kind != "metal":
            return
        k_fields, v_fields = _arrays(k_cache, "k_cache").values(), _arrays(v_cache, "v_cache").values()
        if any(np.may_share_memory(a, b) for a in k_fields for b in v_fields):
            raise ValueError("v_cache shares memory with k_cache (one stacked tensor): on Metal an append to them "
                             "would let one cache's staged copy overwrite the other's new rows; give separate k "
                             "and v tensors there (the cpu backend takes stacked ones)")

    def rows_written(self, cache_seqlens, block_table) -> tuple[np.ndarray, np.ndarray]:
        """Where the append writes: index arrays (B, Rn) of a cache's first two axes (batch and
        position, or page and row) for row i of batch b at position cache_seqlens[b] + i."""
        positions = np.asarray(cache_seqlens).astype(np.int64)[:, None] + np.arange(self.appended)[None, :]
        if self.paged:
            return np.take_along_axis(np.asarray(block_table), positions // self.page, axis=1), positions % self.page
        return np.broadcast_to(np.arange(self.batch)[:, None], positions.shape), positions

    def append_on_host(self, k_cache, v_cache, cache_seqlens, k, v, block_table) -> None:
        """Writes k and v into plain caches at each batch's positions cache_seqlens[b] + i (an
        empty problem, which runs no kernel)."""
        if not self.appended:
            return
        at = self.rows_written(cache_seqlens, block_table)
        for cache, new, name in ((k_cache, k, "k_cache"), (v_cache, v, "v_cache")):
            if isinstance(cache, QuantizedTensor) or float8_format(cache) is not None:
                raise ValueError(f"{name}: appending to a QuantizedTensor or float8 cache needs a non-empty problem "
                                 "(queries and heads): the append kernels run in the attention pass")
            check.as_array(cache, name)[at] = check.as_array(new, name[0])


def checked_append(q, k_cache, v_cache, cache_seqlens, k, v, block_table) -> tuple[np.ndarray, np.ndarray]:
    """Every check of an append's arguments (numpy views; QuantizedTensor caches), and the rows
    it writes (`Cache.rows_written`): for an adapter that writes them itself (MLX, whose arrays
    the pass cannot write in place), before anything is written."""
    values = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens, "k": k, "v": v,
              "block_table": block_table}
    cache = Cache(values)
    cache.check(values)
    return cache.rows_written(cache.lengths(cache_seqlens), block_table)


def _arrays(cache, name: str) -> dict[str, np.ndarray]:
    """The numpy arrays of a cache argument, by a name for messages (k_cache, k_cache.scales)."""
    if isinstance(cache, QuantizedTensor):
        return {f"{name}.{field}": x for field, x in cache.arrays().items()}
    return {name: check.as_array(cache, name)}


def _given(cache, field: str):
    """The caller's object behind `field` (a name `_arrays` gave)."""
    return cache.fields()[field.split(".")[1]] if isinstance(cache, QuantizedTensor) else cache


def _bind_caches(checked, cache: Cache, call: Call) -> None:
    """Binds k and v (each field of a quantized one) as the paged or contiguous rows view of the
    caller's memory, from arguments k_cache and v_cache; raises ValueError where that view
    would be a copy (the append must write the caller's memory)."""
    for name in ("k", "v"):
        given = getattr(call, f"{name}_cache")
        rows = cache.caches(given, given)["kv".index(name)]
        fields = rows.arrays() if isinstance(rows, QuantizedTensor) else {"data": rows}
        for field, x in fields.items():
            buffer = name if field == "data" else f"{name}_{field}"
            if cache.appended and not np.may_share_memory(checked.bound[buffer], x):
                raise ValueError(f"{name}_cache{'' if field == 'data' else '.' + field} cannot be bound in place "
                                 f"(strides {x.strides}): the append writes the caller's memory; give it with a "
                                 "contiguous last axis")
            checked.converts[buffer] = _field_convert(cache, "kv".index(name), field)
            checked.sources[buffer] = f"{name}_cache"
    for buffer, argument in NEW_ROWS.items():
        if cache.appended:
            checked.bound[buffer] = np.ascontiguousarray(check.as_array(getattr(call, argument), argument))
            checked.converts[buffer], checked.sources[buffer] = np.ascontiguousarray, argument


def _field_convert(cache: Cache, which: int, field: str):
    """A warm call's conversion of a cache argument into one bound field."""
    if field == "data":
        return lambda x: _data(cache.caches(x, x)[which])
    return lambda x: check.bindable(cache.caches(x, x)[which].field(field))


def _data(rows) -> np.ndarray:
    return check.bindable(rows.field("data") if isinstance(rows, QuantizedTensor) else stored_bytes(rows))


def _prepare(call: Call, device):
    cache = Cache(call.values)
    k4, v4 = cache.caches(call.k_cache, call.v_cache)
    q = check.as_array(call.q, "q")
    if call.rotary_cos is not None:   # the rotation kernel writes q contiguous: the problem reads it so
        q = np.ascontiguousarray(q)
    descales = cache.descales(call.values)
    forward = validate((q, k4, v4, None, call.sinks), scale=call.scale, causal=call.causal, window=call.window,
                       layout="bshd", return_lse=call.return_lse, softcap=call.softcap,
                       alibi_slopes=call.alibi_slopes, quantized_refusal=None,
                       descales=descales)
    per_row = forward.problem.causal != "none" or forward.problem.window is not None
    cache.binding.sizes["per_row"] = int(per_row)   # the rows the rotation turns (the contents' rotary_ends)
    rotary = rotation.rotary_of(call, per_row)
    p = replace(with_determinism(forward.problem, call.deterministic),
                keys=cache.keys(rotary, 0 if rotary is None else len(call.rotary_cos)))
    checked = Validated(p, dict(forward.bound), dict(forward.converts), dict(forward.sources))
    for name in descales:
        checked.converts[name] = lambda x, name=name: descale_rows(x, name, cache.batch, cache.kv_heads)
    checked.bound["cache_seqlens"] = lengths = cache.lengths(call.cache_seqlens)   # checked with the contents, below
    # None is part of the signature: its warm calls bind the same capacity lengths.
    checked.converts["cache_seqlens"] = np.ascontiguousarray if call.cache_seqlens is not None else lambda _: lengths
    if cache.paged:
        checked.bound["block_table"] = np.ascontiguousarray(call.block_table)
        checked.converts["block_table"] = np.ascontiguousarray
    checked, tensors = with_score_mod(checked, call.score_mod, call.score_mod_tensors)
    p, names = checked.problem, call.op.array_names + tensors
    at = {name: names.index(name) for name in call.op.array_names}
    empty = check.is_empty(p.batch, p.q_heads, p.q_len, p.kv_len)
    if empty and rotary is not None:
        raise ValueError("rotary_cos with an empty problem (no queries or heads): the rotation runs on the "
                         "device, in the attention pass, which has nothing to compute")
    if not empty:
        _bind_caches(checked, cache, call)
        rotation.bind(checked, rotary, call)

    def check_contents(arguments) -> None:
        """Every call, before anything is written: the lengths and pages, and the caches writable."""
        values = {name: arguments[i] for name, i in at.items()}
        cache.check(values)
        cache.writable(values["k_cache"], values["v_cache"])
        cache.apart_where_staged(values["k_cache"], values["v_cache"], device.kind)
        if empty:
            cache.append_on_host(values["k_cache"], values["v_cache"], values["cache_seqlens"], values["k"],
                                 values["v"], values["block_table"])

    check_contents([call.values[name] for name in call.op.array_names])
    if empty:
        prepared, inputs = empty_forward(p, names, checked)
    else:
        facts = tuning_facts(device)
        description = codegen.attention_pass(p, family=facts.family, parallel_threadgroups=facts.parallel_threadgroups)
        prepared, inputs = prepared_call(description, device, checked, names, call.results)
    prepared.check = check_contents
    return prepared, inputs


ATTENTION_WITH_KVCACHE = Op(
    "attention_with_kvcache",
    "Attention of new queries over a KV cache (flash-attn's flash_attn_with_kvcache), appending k and v to it.",
    arguments=(Q, K_CACHE, V_CACHE, CACHE_SEQLENS, K_NEW, V_NEW, BLOCK_TABLE, *rotation.ARGUMENTS, SCALE, CAUSAL,
               WINDOW, SINKS, SOFTCAP, ALIBI_SLOPES, Q_DESCALE, K_DESCALE, V_DESCALE, RETURN_LSE, SCORE_MOD_TENSORS,
               SCORE_MOD, DETERMINISTIC),
    outputs=(OUTPUT, LSE),
    prepare=_prepare,
    checks=rules.CHECKS,
    reference=reference.attention_with_kvcache_reference,
    no_backward="attention_with_kvcache is inference only (use attention or attention_varlen to train)",
    details="""
    Batch b's queries attend the cache's first cache_seqlens[b] + Rn keys: causal=True lines
    the last query up with the last attended key; window and sinks as in `attention`. With k
    and v, the new rows are written into k_cache and v_cache first (on the device, in the
    same pass), then attended; with rotary_cos and rotary_sin, q and the new k are turned
    first, in the same pass, and the cache holds the turned keys. Every check runs first, on
    every call, so nothing is written on an error. A score_mod sees kv_idx as the key's
    position in the cache and q_idx as the query's: its row + the attended length - R (the
    cache length before the call + its row when the call appends its R rows).
    """,
    returns="""
    The output o (B, R, Hq, Dv) of q's kind and dtype; with return_lse=True the tuple
    (o, lse), lse being (B, Hq, R) float32.
    """,
    raises="""
    TypeError: q and a cache (or k, v) of different dtypes or kinds; a cache the append must
        write that is read-only (an MLX array: use `mfa_native.mlx.attention_with_kvcache`);
        any argument `attention` refuses with a TypeError.
    ValueError: shapes that disagree; k without v (or v without k); cache_seqlens missing
        with k and v, not int32 (B,), negative, or cache_seqlens + Rn beyond the capacity;
        block_table not int32 (B, max_blocks) or naming a page outside k_cache for a
        position that is read; pages not whole rows apart, overlapping, or laid out unlike
        k_cache's in v_cache or another field; on Metal, an append to k and v caches that
        share memory; rotary tables not (seqlen_ro, rotary_dim / 2) of q's dtype with
        rotary_dim <= D, too short for the positions turned, without k and v, or rotary_sin
        or rotary_seqlens without rotary_cos; rotary_seqlens not int32 (B,) or negative; a
        descale not float32 (B, Hkv) or a single factor, or given for a cache that is not
        float8 (q_descale: a k_cache); an MPS cache
        the append cannot write in place; any other argument `attention` refuses (score_mod
        and score_mod_tensors included).
    """,
    example="""
    import numpy as np
    import mfa_native
    from mfa_native.reference import attention_reference

    rng = np.random.default_rng(0)
    k_cache = np.zeros((1, 32, 2, 32), dtype=np.float32)   # (B, Cmax, Hkv, D): room for 32 positions
    v_cache = np.zeros((1, 32, 2, 32), dtype=np.float32)
    k_cache[:, :15], v_cache[:, :15] = rng.standard_normal((2, 1, 15, 2, 32))   # 15 positions cached
    cache_seqlens = np.array([15], dtype=np.int32)
    q, k, v = (rng.standard_normal((1, 1, 2, 32), dtype=np.float32) for _ in range(3))   # one new token
    o = mfa_native.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
                                          causal=True, device="cpu")
    assert np.array_equal(k_cache[:, 15], k[:, 0])   # appended in place, at position 15
    expected = attention_reference(q, k_cache[:, :16], v_cache[:, :16], layout="bshd")
    print(o.shape, np.abs(o - expected).max())   # (1, 1, 2, 32) and a small error
    assert np.allclose(o, expected, atol=1e-4)
    """)
attention_with_kvcache = ATTENTION_WITH_KVCACHE.function
