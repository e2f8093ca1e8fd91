"""MSL for the attention forward pass (FlashAttention-2 order), from a KernelDescriptor.

One threadgroup holds `query_rows` query rows of one (batch, query head); each
simdgroup owns 8 of those rows and walks the keys in blocks on its own (no
threadgroup memory, no barriers). Per block of keys:

  1. allowed keys of the lane's elements (bounds, causal, window, mask), with
     additive mask values in the log2 domain; with a mask, a block that no row
     may see is skipped (one simd_max per block);
  2. S = Q K^T with 8x8 simdgroup matrices, only for tiles below the last key
     the rows may see (so causal blocks above the diagonal cost nothing);
  3. online softmax in the exp2 domain: m = running max, l = running sum,
     O *= exp2(m_old - m_new);
  4. O += P V.
At the end O /= l and lse = (m + log2 l) * ln 2. Removed keys carry the
finite logit MASKED; a row with no allowed key keeps l = 0 and stores O = 0,
lse = -inf.

The split-KV variant ("attention_partial", for decode) runs the same loop over
one split of the keys per threadgroup and stores the unnormalized O and (m, l)
of each split, in float32, for attention_combine.

The tile loads, products, masking and softmax steps are the building blocks
of blocks.py, which the backward kernels share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .blocks import (HeadTensor, Rows, accumulate, bias_over_keys, block_loop, head_pointer, in_registers, key_range,
                     logits, mask_row_pointer, probabilities, query_rows_geometry, scores, store_rows, tiles, zeroed)
from .descriptor import Extent, KernelDescriptor
from .msl import MSL_TYPES, constants, header, indent, loop, offset, signature, sizes_struct
from .operands import mask_operands, result_operands, sizes_operands
from .plan import GridAxis, LaunchPlan, Operand

KERNEL_NAME = "attention_forward"
PARTIAL_KERNEL_NAME = "attention_partial"
BUILTINS = ["uint3 group [[threadgroup_position_in_grid]]",
            "ushort simd_index [[simdgroup_index_in_threadgroup]]",
            "ushort lane [[thread_index_in_simdgroup]]"]


@dataclass(frozen=True)
class KernelSource:
    source: str
    plan: LaunchPlan


def _size(*names: str, factor: int = 1) -> Extent:
    return Extent(factor, names)


def partial_scratch(d: KernelDescriptor) -> dict[str, Extent]:
    """Float32 elements of the split-KV intermediates: unnormalized O and (m, l) per split and row."""
    return {"o_partial": _size("S", "B", "Hq", "R", factor=d.value_dim),
            "ml_partial": _size("S", "B", "Hq", "R", factor=2)}


def launch_plan(d: KernelDescriptor) -> LaunchPlan:
    t = MSL_TYPES[d.dtype]
    operands = [
        Operand("q", f"device const {t}*", "queries"),
        Operand("k", f"device const {t}*", "keys"),
        Operand("v", f"device const {t}*", "values"),
    ]
    operands += mask_operands(d.mask, d.mask_dtype)
    if d.kv_split:
        scratch = partial_scratch(d)
        operands += [
            Operand("o_partial", "device float*", "(S, B, Hq, R, Dv) unnormalized output per split",
                    scratch["o_partial"]),
            Operand("ml_partial", "device float*", "(S, B, Hq, R, 2) softmax max (log2) and sum per split",
                    scratch["ml_partial"]),
        ]
    else:
        operands += result_operands(d.dtype, d.return_lse, d.sinks)
    sizes, fields = sizes_operands(d.baked_sizes, d.size_names)
    operands += sizes
    grid = (GridAxis(_size("R"), d.query_rows), GridAxis(_size("Hq")),
            GridAxis(_size("B", "S") if d.kv_split else _size("B")))
    name = PARTIAL_KERNEL_NAME if d.kv_split else KERNEL_NAME
    return LaunchPlan(name, tuple(operands), grid, 32 * d.simdgroups, fields)


# ---------------------------------------------------------------------------
# Pieces of the kernel body. Each returns a list of lines.


def _tensors(d: KernelDescriptor) -> dict[str, HeadTensor]:
    return {"q": HeadTensor.of("q", d.q, d.head_dim), "k": HeadTensor.of("k", d.k, d.head_dim),
            "v": HeadTensor.of("v", d.v, d.value_dim)}


def _geometry(d: KernelDescriptor) -> list[str]:
    t = MSL_TYPES[d.dtype]
    if d.kv_split:
        batch = ["const uint b = group.z / S;", "const uint split = group.z % S;  // which share of the keys"]
    else:
        batch = ["const uint b = group.z;"]
    lines = query_rows_geometry(d.query_rows, d.gqa_ratio, batch) + [
        "",
        head_pointer("q", d.q, "h", t, True),
        head_pointer("k", d.k, "h_kv", t, True),
        head_pointer("v", d.v, "h_kv", t, True),
    ]
    if not d.kv_split:
        lines.append(head_pointer("o", d.o, "h", t, False))
    if d.mask != "none":
        lines.append(mask_row_pointer(d.rules))
    return lines


def _init_state(d: KernelDescriptor) -> list[str]:
    lines = ["", "// Online softmax state of the lane's row (log2 domain) and its output accumulator."]
    if d.sinks and not d.kv_split:  # a split pass adds the sink when combining
        lines += ["float m = sinks[h] * LOG2E;  // the sink is one more logit, with no value",
                  "float l = 1.0f;"]
    else:
        lines += ["float m = MASKED;", "float l = 0.0f;"]
    return lines + zeroed("o_tile", tiles(d.value_dim), "O, unnormalized")


def _softmax(d: KernelDescriptor, key_tiles: int) -> list[str]:
    lines = ["", "// Online softmax: new running max, rescale, probabilities.", "float block_max = MASKED;"]
    lines += logits(d.scale_log2e, key_tiles, "p_tile", ["block_max = max(block_max, s[i]);"])
    lines += [
        "block_max = max(block_max, simd_shuffle_xor(block_max, 1));",
        "block_max = max(block_max, simd_shuffle_xor(block_max, 8));",
        "const float m_new = max(m, block_max);",
        "const float correction = exp2(m - m_new);  // 1 when the max holds, 0 when m was MASKED",
        "m = m_new;",
        "float block_sum = 0.0f;",
    ]
    lines += probabilities(key_tiles, "p_tile", "m", ["block_sum += p;"])
    lines += [
        "block_sum += simd_shuffle_xor(block_sum, 1);",
        "block_sum += simd_shuffle_xor(block_sum, 8);",
        "l = l * correction + block_sum;",
    ]
    lines += loop(f"ushort t = 0; t < {tiles(d.value_dim)}; ++t", [
        "o_tile[t].thread_elements()[0] *= correction;",
        "o_tile[t].thread_elements()[1] *= correction;",
    ])
    return lines


def _key_loop(d: KernelDescriptor) -> list[str]:
    key_tiles = d.key_block // 8
    x = _tensors(d)
    q_rows = Rows(x["q"], "row_read", "q_tile" if d.cache_q else None, "q_i")
    body = bias_over_keys(d.rules, key_tiles)
    body += ["", "// S = Q K^T, 8x8 tiles; tiles past key_end stay 0 and are masked below."]
    body += zeroed("p_tile", key_tiles, "scores, then probabilities")
    body += scores("p_tile", key_tiles, q_rows, x["k"], "k_tile", "K^T: rows are head dims, columns are keys",
                   "key", "kb", "C", "re-read: Q does not stay in registers at this head dimension")
    body += _softmax(d, key_tiles)
    body += ["", "// O += P V."]
    body += accumulate("o_tile", "p_tile", key_tiles, x["v"], "v_tile", "rows are keys, columns are value dims",
                       "key", "kb", "C")
    return block_loop("kb", "key_begin", "key_end", d.key_block, body)


def _partial_epilogue(d: KernelDescriptor) -> list[str]:
    """Split-KV: the split's unnormalized O and its (m, l), for attention_combine."""
    body = ["const ulong at = ((ulong(split) * B + b) * Hq + h) * R + row;",
            f"device float* o_split = o_partial + at * {d.value_dim};"]
    body += store_rows("o_split", "o_tile", d.value_dim)
    body += ["if (tc == 0) {", "  ml_partial[at * 2] = m;", "  ml_partial[at * 2 + 1] = l;", "}"]
    return ["", "// This split's share: O before the division by l, and m, l.", "if (row < R) {"] + indent(body) + ["}"]


def _epilogue(d: KernelDescriptor) -> list[str]:
    if d.kv_split:
        return _partial_epilogue(d)
    t = MSL_TYPES[d.dtype]
    body = [f"device {t}* o_row = o_head + {offset('row', d.o.strides[2])};"]
    body += store_rows("o_row", "o_tile", d.value_dim, cast=t, factor="inv_l")
    if d.return_lse:
        body += ["if (tc == 0) {",
                 "  lse[(ulong(b) * Hq + h) * R + row] = l > 0.0f ? (m + log2(l)) * LN2 : -INFINITY;",
                 "}"]
    return (["", "// O /= l; a row with nothing in its denominator stores 0 (and lse = -inf).",
             "const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;",
             "if (row < R) {"] + indent(body) + ["}"])


def _summary(d: KernelDescriptor) -> list[str]:
    window = "none" if d.window is None else f"(left {d.window[0]}, right {d.window[1]})"
    mask = d.mask if d.mask == "none" else f"{d.mask} ({d.mask_dtype})"
    lines = [f"{d.dtype}, D = {d.head_dim}, Dv = {d.value_dim}, GQA ratio {d.gqa_ratio}",
             f"causal {d.causal}, window {window}, mask {mask}"]
    if d.kv_split:
        lines.append("split-KV partial pass: one split of S per threadgroup, finished by attention_combine")
    else:
        lines[-1] += f", sinks {'yes' if d.sinks else 'no'}, lse {'yes' if d.return_lse else 'no'}"
    simdgroups = f"{d.simdgroups} simdgroup{'s' if d.simdgroups > 1 else ''}"
    lines.append(f"tiles ({d.family}): {d.query_rows} query rows per threadgroup ({simdgroups}), "
                 f"{d.key_block} keys per block, Q {'in registers' if d.cache_q else 're-read per block'}")
    return lines


@lru_cache(maxsize=256)
def generate(d: KernelDescriptor) -> KernelSource:
    """The MSL source and launch plan of the forward kernel described by `d` (the partial
    kernel of the split-KV pass when d.kv_split)."""
    plan = launch_plan(d)
    q_cache = []
    if d.cache_q:
        q_cache = ["", f"// Q: 8 rows x {d.head_dim}, held in registers as 8x8 tiles."]
        q_cache += in_registers("q_tile", _tensors(d)["q"], "row_read")
    body = (_geometry(d) + key_range(d.rules, d.kv_split) + q_cache + _init_state(d) + _key_loop(d) + _epilogue(d))
    declarations = constants(d.size_names, d.baked_sizes, "\n".join(body))
    lines = (header(plan.kernel_name, _summary(d), plan) + sizes_struct(plan) + signature(plan, BUILTINS)
             + ["{"] + indent(declarations + [""] + body) + ["}"])
    return KernelSource("\n".join(lines) + "\n", plan)
