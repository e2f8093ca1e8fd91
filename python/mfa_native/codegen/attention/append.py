"""A KV cache's append kernels: this call's new rows written into the caller's cache in place,
first in the attention pass (codegen/attention/cache.py adds them before the attention kernel).

One kernel per tensor (k, then v), one thread per (new row, unit): new row r is (b, i, h) of
the contiguous (B, Rn, Hkv, D) `k_new`, written at logical position cache_seqlens[b] + i of
batch b's cache (paged: row position % page_size of page block_table[b, position /
page_size]). A plain cache copies one element per thread, a float8 one encodes one (over its
descale, storage/float8.py); a quantized one (storage/stored.py)
quantizes one group per thread with `quantize`'s own encoder (storage/formats.encode_group),
so the stored integers and scales are `mfa_native.quantize`'s exactly. The kernels bind the
cache under the attention kernel's buffer names (k, k_scales, ...), so the pass declares them
"inout" and the core orders the attention kernel's reads after these writes.
"""

from __future__ import annotations

from ..kernel.msl import BUILTINS_THREAD, MSL_TYPES, offset
from ..kernel.plan import GridAxis, LaunchPlan, Operand
from ..kernel.sizes import SIZES_OPERAND, Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.tiles import paged_row
from ..storage.float8 import Float8Facts
from ..storage.formats import encode_group

THREADS = 64    # (row, unit) items per threadgroup
NEW = "{}_new"  # the pass buffer of the rows appended to cache tensor k or v


def _tensor(d, name: str) -> tuple[int, object, object]:
    """(features, storage facet, plain layout) of cache tensor `name` ("k" or "v")."""
    return (d.head_dim, d.k_storage, d.k) if name == "k" else (d.value_dim, d.v_storage, d.v)


def units(storage, features: int) -> int:
    """Work items per new row: its groups (quantized) or its elements (plain)."""
    f = getattr(storage, "format", None)
    return features if f is None else f.groups(features)


def plan(d, name: str) -> LaunchPlan:
    """The operands: the new rows, the cache's buffers (writable), the lengths, the pages."""
    features, storage, _ = _tensor(d, name)
    t = MSL_TYPES[d.dtype]
    ops = [Operand(NEW.format(name), f"device const {t}*", f"(B, Rn, Hkv, {features}) new rows, contiguous")]
    written = storage.written(name)
    ops += [Operand(buffer, f"device {'' if buffer in written else 'const '}{storage.element(buffer, d.dtype)}*",
                    f"the cache's {buffer}, {'written in place' if buffer in written else 'read'}")
            for buffer in storage.fields(name)]
    ops.append(Operand("cache_seqlens", "device const int*", "(B,) each batch's cache length before this call"))
    if d.keys.page_size:
        ops.append(Operand("block_table", "device const int*", "(B, Wt) each batch's pages"))
    ops.append(Operand(SIZES_OPERAND, f"constant {d.sizes.struct}&", "runtime sizes"))
    work = Extent(units(storage, features), ("B", "Rn", "Hkv"))
    grid = (GridAxis(work, THREADS), GridAxis(Extent(1)), GridAxis(Extent(1)))
    return LaunchPlan(f"append_{name}", tuple(ops), grid, THREADS, d.sizes)


def locate(units_per_row: int, page_size: int | None, page_rows: int | None) -> list[str]:
    """This thread's new row r = (b, i, h), its `unit`, and `row`: the cache row it goes to."""
    lines = [f"const ulong t = ulong(group.x) * {THREADS} + lane;",
             f"if (t >= ulong(B) * Rn * Hkv * {units_per_row}) {{",
             "  return;",
             "}",
             f"const ulong r = t / {units_per_row};   // the new row: (b, i, h) of (B, Rn, Hkv)",
             f"const uint unit = uint(t % {units_per_row});",
             "const uint h = uint(r % Hkv);",
             "const uint b = uint(r / (ulong(Hkv) * Rn));",
             "const uint at = uint(cache_seqlens[b]) + uint(r / Hkv % Rn);   // its logical position"]
    if page_size:
        page = f"block_table[ulong(b) * Wt + at / {page_size}]"
        return lines + [f"const uint row = {paged_row(page, 'at', page_size, page_rows)};   // its page's row"]
    return lines + ["const uint row = at;"]


def _row(buffer: str, layout) -> str:
    """The element index of the cache row `row` within (b, h)'s rows of `buffer`."""
    return offset("ulong(row)", layout.strides[2]) or "0"


def store_plain(name: str, features: int, layout) -> list[str]:
    """One element: the new row's `unit`th value, copied."""
    return [f"{name}_head[{_row(name, layout)} + unit] = {NEW.format(name)}[r * {features} + unit];"]


def store_quantized(d, name: str, features: int, storage) -> list[str]:
    """One group: the new row's `unit`th group, quantized as `quantize` does."""
    f, t = storage.format, MSL_TYPES[d.dtype]
    width = f.group_bytes // 4 if f.affine else f.group_bytes   # data elements per group
    lines = [f"device const {t}* values = {NEW.format(name)} + (r * {features} + unit * {f.group_size});",
             f"device {MSL_TYPES[f.data_dtype]}* out = {name}_head + ({_row(name, storage.data)} + unit * {width});"]
    scale = bias = None
    if f.affine:
        scale, bias = (f"{name}_{field}_head[{_row(name, getattr(storage, field))} + unit]"
                       for field in ("scales", "biases"))
    return lines + encode_group(f, values="values", data="out", scale=scale, bias=bias, store=t)


def store_float8(name: str, features: int, storage: Float8Facts) -> list[str]:
    """One element: the new row's `unit`th value over the descale, encoded (storage/float8.py)."""
    value = f"float({NEW.format(name)}[r * {features} + unit])"
    return storage.store(name, value, f"{_row(name, storage.data)} + unit")


def generate_append(d, name: str) -> KernelSource:
    """The append kernel of cache tensor `name` ("k" or "v") for attention facts `d`."""
    features, storage, layout = _tensor(d, name)
    quantized = hasattr(storage, "format")
    body = locate(units(storage, features), d.keys.page_size, d.keys.page_rows)
    body += storage.pointers(name, layout, "h", d.dtype, const=False)
    if isinstance(storage, Float8Facts):
        body += store_float8(name, features, storage)
    else:
        body += store_quantized(d, name, features, storage) if quantized else store_plain(name, features, layout)
    how = (f", quantized {storage.format.describe()}" if quantized
           else f", encoded {storage.float8.name}" if isinstance(storage, Float8Facts) else "")
    summary = [f"append_{name}: Rn new rows into the KV cache at cache_seqlens[b] + i, in place{how}"]
    return assemble(plan(d, name), summary=summary, builtins=BUILTINS_THREAD, body=body)
