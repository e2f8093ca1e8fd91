"""MSL for sparse-indexed attention (DeepSeek sparse attention), forward: each query row
attends exactly the keys its token list names.

Heads as tile rows: one threadgroup per (query row r, kv head, batch); its simdgroups own 8
of the query heads that read the kv head (rows past the group compute on a valid head and
are never stored). They all share r's list: each step, the threadgroup stages the next
listed K (and V) rows in threadgroup memory, each row read from device memory once, and
every simdgroup's products read the stage; when v is a view of k (MLA's shared latent),
one staged row serves both. A slot past the count, or whose entry is outside 0..C-1, is
skipped and reads nothing. The online softmax, its NaN rules and the finish are the dense
forward kernel's; the score transforms see query row r and the listed key's index in k.
"""

from __future__ import annotations

from functools import lru_cache

from ..attention import operands
from ..attention.descriptor import KernelDescriptor
from ..attention.forward import BUILTINS
from ..attention.rows import row_index
from ..attention.stage_sizes import stages_apart
from ..attention.scores import Element, buffers, element, setup
from ..attention.softmax import online_softmax, sink_state, stored_lse
from ..kernel.msl import MSL_TYPES, indent, loop, offset
from ..kernel.plan import GridAxis, LaunchPlan
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.tiles import (HeadTensor, Positions, Rows, accumulate, block_loop, element_offset, head_pointer,
                            in_registers, lane_layout, scores, tiles, zeroed)
from ..kernel.stores import store_rows
from ..storage import staging
from ..storage.staging import StagedTensor

SPARSE_KERNEL_NAME = "sparse_attention_forward"


def sparse_plan(d: KernelDescriptor) -> LaunchPlan:
    ops = (operands.reads(d, "q", "k", "v", "indices", "topk_length", *buffers(d.scores))
           + operands.writes(d, "o", *(["lse"] if d.return_lse else [])) + operands.reads(d, "sinks")
           + operands.sizes(d))
    grid = (GridAxis(Extent(1, ("R",))), GridAxis(Extent(1, ("Hkv",))), GridAxis(Extent(1, ("B",))))
    return LaunchPlan(SPARSE_KERNEL_NAME, tuple(ops), grid, 32 * d.simdgroups, d.sizes)


def slot_geometry(d: KernelDescriptor) -> list[str]:
    t = MSL_TYPES[d.dtype]
    f = d.keys
    lines = ["// This simdgroup's rows: 8 of the query heads of kv head h_kv, all at query row r.",
             "const uint r = group.x;", "const uint h_kv = group.y;", "const uint b = group.z;",
             *lane_layout(),
             "const uint head_slot = simd_index * 8 + tr;  // which head of the group",
             f"const uint h = h_kv * {d.gqa_ratio} + min(head_slot, {d.gqa_ratio - 1}u);",
             "",
             f"device const {t}* q_rows = q + ({element_offset(d.q, ('ulong(b)', 0), ('ulong(r)', 2))});"
             "  // row h: this query of head h",
             head_pointer("k", d.k, "h_kv", t, True),
             head_pointer("v", d.v, "h_kv", t, True),
             f"device const int* listed = indices + ({element_offset(f.indices, ('ulong(b)', 0), ('ulong(h_kv)', 1), ('ulong(r)', 2))});"]
    if f.lengths is not None:
        length = f"topk_length[{element_offset(f.lengths, ('ulong(b)', 0), ('ulong(r)', 1))}]"
        lines.append(f"const int count = max(0, min(int(T), {length}));  // the first topk_length entries")
    else:
        lines.append("const int count = int(T);")
    return lines


SLOT = "kb + j * 8 + int(tc) + e"   # the list slot of the lane's element (j, e) of a step's tiles


def listed_key(slot: str) -> str:
    """The entry of the row's list at `slot` (clamped to the count: a slot past it reads the last)."""
    return f"listed[min({slot}, count - 1)]"


def slot_element(d) -> Element:
    """Where the lane's element lies, for the score transforms: query row r, and the listed key's
    index in k (an entry naming no key reads as key C - 1, so no position overflows: its element
    is MASKED whatever the transforms make of it)."""
    return element(d, "int(r)", f"int(min(uint({listed_key(SLOT)}), C - 1))")


def slot_bias(count: int) -> list[str]:
    """s = 0 for the lane's slots that name a key (slot < count, entry in 0..C-1), else MASKED."""
    body = [f"const int slot = {SLOT};",
            f"const int entry = {listed_key('slot')};",
            "s[j * 2 + e] = slot < count && uint(entry) < C ? 0.0f : MASKED;"]
    return ["// Which of the lane's slots name a key (entries < 0 or >= C are skipped).", f"float s[{2 * count}];"] \
        + loop(f"int j = 0; j < {count}; ++j", loop("int e = 0; e < 2; ++e", body))


def staged_tensors(d) -> list[StagedTensor]:
    """What the stage holds: K rows, and V rows unless v is a view of k (in turn with K's at
    large head dimension, stage_apart)."""
    tensors = [StagedTensor("k", d.head_dim, d.k)]
    if d.keys.shared_kv:
        return tensors
    tensors.append(StagedTensor("v", d.value_dim, d.v))
    return staging.apart(tensors) if stages_apart(d.family, d.dtype, d.head_dim, d.value_dim) else tensors


def staged_rows(d) -> list[list[str]]:
    """The step's fills (one, or K's then V's when they take turns): each loads the listed rows
    [kb, kb + stage_rows) into the stage; a slot past the count or naming no key stores 0 (and
    reads nothing). Reads kb, count, listed."""
    return [staging.fill(tensors, d.keys.stage_rows, d.dtype,
                         key="kb + slot < count ? listed[kb + slot] : -1", valid="uint(key) < C")
            for tensors in staging.phases(staged_tensors(d))]


def _slot_steps(d: KernelDescriptor) -> list[str]:
    key_tiles = d.key_block // 8
    q = HeadTensor("q_rows", d.q.strides[1], d.head_dim)
    staged = staged_tensors(d)
    k = HeadTensor(staged[0].stage, Extent(d.head_dim), d.head_dim)
    v = HeadTensor(staged[-1].stage, Extent(staged[-1].width), d.value_dim)
    positions = Positions(str(d.key_block))   # rows of the stage, 0 .. stage_rows - 1
    fills = staged_rows(d) + [[]]
    body = fills[0] + slot_bias(key_tiles)
    body += ["", "// S = Q K^T over the staged rows."] + zeroed("p_tile", key_tiles, "scores, then probabilities")
    body += scores("p_tile", count=key_tiles, lhs=Rows(q, "h", "q_tile" if d.cache_q else None, "q_i"), rhs=k,
                   rhs_tile="k_tile", rhs_comment="K^T of the listed keys", position="key", first="0",
                   positions=positions, reread="re-read: Q does not stay in registers at this head dimension")
    body += online_softmax(d, key_tiles, at=slot_element(d))
    if fills[1]:
        body += ["", "// The step's V rows, staged over its K rows."] + fills[1]
    body += ["", "// O += P V over the staged rows."]
    body += accumulate("o_tile", weights="p_tile", count=key_tiles, rhs=v, rhs_tile="v_tile",
                       rhs_comment="rows are listed keys, columns are value dims", position="key", first="0",
                       positions=positions)
    return block_loop("kb", "0", "count", d.key_block, body)


def _store(d: KernelDescriptor) -> list[str]:
    t = MSL_TYPES[d.dtype]
    body = [f"device {t}* o_row = o + ({element_offset(d.o, ('ulong(b)', 0), ('ulong(h)', 1), ('ulong(r)', 2))});"]
    body += store_rows("o_row", "o_tile", d.value_dim, cast=t, factor="inv_l")
    if d.return_lse:
        body += ["if (tc == 0) {", f"  lse[{row_index('r')}] = {stored_lse(m='m', denominator='l', sinks=d.sinks)};", "}"]
    return (["", "// O /= l; a row with nothing in its denominator stores 0 (and lse = -inf).",
             "const float inv_l = l != 0.0f ? 1.0f / l : 0.0f;  // NaN stays NaN",
             f"if (head_slot < {d.gqa_ratio}) {{"] + indent(body) + ["}"])


@lru_cache(maxsize=64)
def generate_sparse(d: KernelDescriptor) -> KernelSource:
    """The sparse-indexed forward kernel of `d` (d.keys set)."""
    q = HeadTensor("q_rows", d.q.strides[1], d.head_dim)
    q_cache = []
    if d.cache_q:
        q_cache = ["", f"// Q: the 8 heads' rows, {d.head_dim} wide, held in registers as 8x8 tiles."]
        q_cache += in_registers("q_tile", q, "h")
    state = ["", "// Online softmax state of the lane's row (log2 domain) and its output accumulator."]
    state += sink_state() if d.sinks else ["float m = MASKED;", "float l = 0.0f;"]
    state += zeroed("o_tile", tiles(d.value_dim), "O, unnormalized")
    body = (slot_geometry(d) + staging.declare(staged_tensors(d), d.keys.stage_rows, d.dtype, str(32 * d.simdgroups))
            + q_cache + state + setup(d) + _slot_steps(d) + _store(d))
    summary = [f"{d.dtype}, D = {d.head_dim}, Dv = {d.value_dim}, {d.gqa_ratio} query heads per kv head as tile rows",
               f"sparse-indexed: token lists{' with topk_length' if d.keys.lengths else ''}, "
               f"sinks {'yes' if d.sinks else 'no'}, lse {'yes' if d.return_lse else 'no'}",
               f"tiles ({d.gpu_family}): {d.key_block} list slots per step"]
    return assemble(sparse_plan(d), summary=summary, builtins=BUILTINS, body=body)
