"""MSL for the attention forward pass (FlashAttention-2 order), from a KernelDescriptor.

One threadgroup holds `query_rows` query rows of one (batch, query head); each
simdgroup owns 8 of those rows and walks the keys in blocks on its own (no
threadgroup memory, no barriers), or, where the tile row stages K/V (stage_kv), all
of them walk the threadgroup's keys together, each block's K/V rows staged once for
all (staged_steps.py). Per block of keys:

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

The split-KV partial kernel ("attention_partial", for decode) is the same kernel
with another finish (`SplitPartial` instead of `Normalized`): one split of the
keys per threadgroup, storing each split's unnormalized O and (m, l), in
float32, for attention_combine. A finish supplies what differs: operands, the
grid's z axis, the key range of a threadgroup, the initial softmax state and
the epilogue.

The tile loads, products, masking and softmax steps are the building blocks
of blocks.py, which the backward kernels share.
"""

from __future__ import annotations

from functools import lru_cache

from ..kernel.msl import MSL_TYPES, indent, offset
from ..kernel.plan import GridAxis, LaunchPlan, Operand
from ..kernel.sizes import Extent
from ..kernel.source import KernelSource, assemble
from ..kernel.accumulators import Accumulator
from ..kernel.products import TENSOR_OPS, scores_step, sum_step
from ..kernel.tiles import HeadTensor, Rows, block_loop, head_pointer, in_registers, zeroed
from ..kernel.stores import store_rows
from ..storage import staging
from ..storage.staging import StagedTensor
from . import invariance, operands, staged_steps
from .descriptor import KernelDescriptor
from .masking import MaskRules, bias_over_keys, key_range, mask_row_pointer
from .tensor_views import forward_views
from .pairs import pair_type
from .rows import row_index, threadgroup_span
from .stage_sizes import stages_apart
from .scores import buffers, describe as describe_scores, element, setup
from .softmax import online_softmax, sink_state, stored_lse

KERNEL_NAME = "attention_forward"
PARTIAL_KERNEL_NAME = "attention_partial"
BUILTINS = ["uint3 group [[threadgroup_position_in_grid]]",
            "ushort simd_index [[simdgroup_index_in_threadgroup]]",
            "ushort lane [[thread_index_in_simdgroup]]"]


class Normalized:
    """The finish of the one-pass kernel: O / l (and lse) stored for every row; the sink
    starts the softmax state."""

    kernel_name = KERNEL_NAME
    grid_z = Extent(1, ("B",))
    batch = ["const uint b = group.z;"]
    key_limits: list[str] = []
    merges_splits = True   # batch-invariant: walks every split of the keys, merging them (invariance.py)

    @staticmethod
    def results(d: KernelDescriptor) -> list[Operand]:
        return operands.writes(d, "o", *(["lse"] if d.return_lse else [])) + operands.reads(d, "sinks")

    @staticmethod
    def initial_state(d: KernelDescriptor) -> list[str]:
        return sink_state() if d.sinks else ["float m = MASKED;", "float l = 0.0f;"]

    @staticmethod
    def store(d: KernelDescriptor) -> list[str]:
        t = MSL_TYPES[d.dtype]
        body = [f"device {t}* o_row = o_head + {offset('ulong(row)', d.o.strides[2])};"]
        body += store_rows("o_row", "o_tile", d.value_dim, cast=t, factor="inv_l", element=output(d).element,
                           vector="o" in d.vector_pairs)
        if d.return_lse:
            body += ["if (tc == 0) {",
                     f"  lse[{row_index('row')}] = {stored_lse(m='m', denominator='l', sinks=d.sinks)};",
                     "}"]
        return (["", "// O /= l; a row with nothing in its denominator stores 0 (and lse = -inf).",
                 head_pointer("o", d.o, "h", t, False),
                 "const float inv_l = l != 0.0f ? 1.0f / l : 0.0f;  // NaN stays NaN",
                 f"if (row < {d.keys.bounds.q_end}) {{"] + indent(body) + ["}"])

    @staticmethod
    def summary(d: KernelDescriptor) -> str:
        return f", sinks {'yes' if d.sinks else 'no'}, lse {'yes' if d.return_lse else 'no'}"


class SplitPartial:
    """The finish of the split-KV partial kernel: threadgroup z = b * S + split walks one
    split of the keys and stores its unnormalized O and (m, l); attention_combine adds the sink."""

    kernel_name = PARTIAL_KERNEL_NAME
    grid_z = Extent(1, ("B", "S"))
    batch = ["const uint b = group.z / S;", "const uint split = group.z % S;  // which share of the keys"]
    key_limits = ["key_begin = max(key_begin, int(split * Cs));  // this split's keys",
                  "key_end = min(key_end, int((split + 1) * Cs));"]
    merges_splits = False   # one split; attention_combine merges them

    @staticmethod
    def results(d: KernelDescriptor) -> list[Operand]:
        return operands.writes(d, "o_partial", "ml_partial")

    @staticmethod
    def initial_state(d: KernelDescriptor) -> list[str]:
        return ["float m = MASKED;", "float l = 0.0f;"]

    @staticmethod
    def store(d: KernelDescriptor) -> list[str]:
        body = [f"const ulong at = ulong(split) * B * Hq * R + {row_index('row')};",
                f"device float* o_split = o_partial + at * {d.value_dim};"]
        body += store_rows("o_split", "o_tile", d.value_dim, element=output(d).element,
                           vector="o_partial" in d.vector_pairs)
        body += ["if (tc == 0) {", "  ml_partial[at * 2] = m;", "  ml_partial[at * 2 + 1] = l;", "}"]
        return (["", "// This split's share: O before the division by l, and m, l.", "if (row < R) {"]
                + indent(body) + ["}"])

    @staticmethod
    def summary(d: KernelDescriptor) -> str:
        return "; split-KV partial pass: one split of S per threadgroup, finished by attention_combine"


def output(d: KernelDescriptor) -> Accumulator:
    """O, unnormalized: register tiles, or paged o_block features at a time (tables.py)."""
    return Accumulator("o_tile", d.value_dim, d.o_block, d.simdgroups)


def launch_plan(d: KernelDescriptor, finish=Normalized) -> LaunchPlan:
    ops = (operands.reads(d, "q", *d.k_storage.fields("k"), *d.v_storage.fields("v"), "mask", *buffers(d.scores),
                          *d.keys.key_lists) + finish.results(d) + operands.sizes(d))
    rows, heads = d.rows.grid(d.gqa_ratio, d.query_rows)
    return LaunchPlan(finish.kernel_name, tuple(ops), (rows, heads, GridAxis(finish.grid_z)), 32 * d.simdgroups,
                      d.sizes)


# ---------------------------------------------------------------------------
# Pieces of the kernel body. Each returns a list of lines.


def _staged(d: KernelDescriptor) -> list[StagedTensor]:
    """Staged (packed heads, stage_kv), the stage holds the step's K and V rows (quantized ones
    decoded), at once or, at large head dimension, in turn (stage_apart); else nothing."""
    if not d.stage_kv:
        return []
    tensors = [StagedTensor("k", d.head_dim, d.k, d.k_storage), StagedTensor("v", d.value_dim, d.v, d.v_storage)]
    return staging.apart(tensors) if stages_apart(d.family, d.dtype, d.head_dim, d.value_dim) else tensors


def _tensors(d: KernelDescriptor) -> dict[str, HeadTensor]:
    own = {"q": HeadTensor.of("q", d.q, d.head_dim, d.tile_type, pair_type(d, "q")),
           "k": HeadTensor.of("k", d.k, d.head_dim, d.tile_type),   # K: transposed loads, scalar
           "v": HeadTensor.of("v", d.v, d.value_dim, d.weight_tile_type, pair_type(d, "v"))}
    return staged_steps.read_from_stage(own, _staged(d))


def _kv_pointers(d: KernelDescriptor) -> list[str]:
    """k_head, v_head (and a quantized tensor's k_scales_head, ...) of kv head h_kv."""
    return (d.k_storage.pointers("k", d.k, "h_kv", d.dtype) + d.v_storage.pointers("v", d.v, "h_kv", d.dtype))


def _geometry(d: KernelDescriptor, finish) -> list[str]:
    t = MSL_TYPES[d.dtype]
    lines = d.rows.geometry(d.query_rows, d.gqa_ratio, finish.batch) + ["", head_pointer("q", d.q, "h", t, True)] + _kv_pointers(d)
    lines += d.keys.prologue()
    if d.rules.mask != "none":
        lines.append(mask_row_pointer(d.rules))
    return lines + staged_steps.declare(_staged(d), d.key_block, d.dtype, d.simdgroups, d.rules.mask) + forward_views(
        d, _tensors(d)).lines


def _key_steps(d: KernelDescriptor, rules: MaskRules, begin: str, end: str) -> list[str]:
    """The online softmax over the keys [begin, end), key_block at a time, with `rules`."""
    key_tiles = d.key_block // 8
    x = _tensors(d)
    body = bias_over_keys(rules, key_tiles, end, d.keys.bounds.origin, skip_here=not d.stage_kv)
    shared_by = "every head of the kv head" if d.rows.packed else "every simdgroup of the threadgroup"
    step = staged_steps.step(_staged(d), block=d.key_block, dtype=d.dtype, start="kb", end=end,
                             positions=d.keys.positions(end), simdgroups=d.simdgroups, mask=rules.mask,
                             shared_by=shared_by)
    fills, first, positions = step.fills, step.first, step.positions
    body += fills[0] + ["", "// S = Q K^T, 8x8 tiles; tiles past key_end stay 0 and are masked below."]
    views, where = forward_views(d, x), dict(position="key", first=first, positions=positions)
    body += zeroed("p_tile", key_tiles, "scores, then probabilities")
    body += scores_step(views.products, "p_tile", views=views.pair("q", "k"), count=key_tiles,
                        lhs=Rows(x["q"], "row_read", "q_tile" if d.cache_q else None, "q_i"), rhs=x["k"],
                        rhs_tile="k_tile", rhs_comment="K^T: rows are head dims, columns are keys",
                        reread="re-read: Q does not stay in registers at this head dimension", **where)
    body += online_softmax(d, key_tiles, output(d), at=element(d, "int(row)", "kb + j * 8 + int(tc) + e"))
    if fills[1]:
        body += ["", "// The step's V rows, staged over its K rows."] + fills[1]
    body += ["", "// O += P V."]
    body += sum_step(views.products, "o_tile", weights="p_tile", count=key_tiles, view=views.of("v"),
                     accumulator=output(d),
                     rhs=x["v"], rhs_tile="v_tile", rhs_comment="rows are keys, columns are value dims", **where)
    return block_loop("kb", begin, end, d.key_block, body)


def _visiting_rows(d: KernelDescriptor) -> dict[str, str]:
    """The queries whose keys a simdgroup visits (key_range's first and last): packed heads, the
    threadgroup's (its rows facet says); staged per head, the threadgroup's rows (every simdgroup
    walks the same blocks); else the simdgroup's own 8 rows."""
    if d.rows.packed:
        return {"last": d.rows.last_query}
    return threadgroup_span("q_first", d.query_rows, d.keys.bounds.q_end, d.stage_kv)


def _merged_visits(d: KernelDescriptor, state: list[str]) -> tuple[list[str], list[str]]:
    """Batch-invariant: the state with the merged total, and the key walk in splits of
    d.split_keys, each merged as it ends (invariance.py), the total then the rows' state."""
    part = output(d)
    total, declared = invariance.total_state(part)

    def splits(rules: MaskRules, begin: str, end: str) -> list[str]:
        return invariance.split_walk(d.split_keys, part, total, begin, end, d.keys.bounds.first_key,
                                     lambda first, last: _key_steps(d, rules, first, last))

    return state + declared, d.keys.keys(d, splits) + invariance.total_as_state(part, total)


def summary(d: KernelDescriptor, finish) -> list[str]:
    """The forward kernel's header lines: sizes, masking rules, tiles."""
    simdgroups = f"{d.simdgroups} simdgroup{'s' if d.simdgroups > 1 else ''}"
    return [f"{d.dtype}, D = {d.head_dim}, Dv = {d.value_dim}, GQA ratio {d.gqa_ratio}" + d.keys.summary(),
            d.rules.describe() + describe_scores(d.scores) + finish.summary(d),
            f"tiles ({d.gpu_family}): {d.query_rows} query rows per threadgroup ({simdgroups}), "
            f"{d.key_block} keys per block, Q {'in registers' if d.cache_q else 're-read per block'}"
            + (f", O paged through threadgroup memory {d.o_block} features at a time" if d.o_block else "")
            + (", K/V staged in threadgroup memory for every simdgroup" if d.stage_kv and not d.rows.packed else "")
            + (f", {d.tile_type} Q and K tiles" if d.tile_type != "float" and d.products != TENSOR_OPS else "")
            + (f", P and V as {d.weight_tile_type} tiles in O += P V"
               if d.weight_tile_type != "float" and d.products != TENSOR_OPS else "")
            + (f"; batch-invariant, splits of {d.split_keys} keys" if d.split_keys else "")
            + ("; products: Metal 4 tensor ops (matmul2d)" if d.products == TENSOR_OPS else "")]


def _kernel(d: KernelDescriptor, finish) -> KernelSource:
    q_cache = []
    if d.cache_q:
        q_cache = ["", f"// Q: 8 rows x {d.head_dim}, held in registers as 8x8 tiles."]
        q_cache += in_registers("q_tile", _tensors(d)["q"], "row_read")
    state = (["", "// Online softmax state of the lane's row (log2 domain) and its output accumulator."]
             + finish.initial_state(d) + output(d).declare("O, unnormalized"))
    keys = key_range(d.rules, bounds=d.keys.bounds, **_visiting_rows(d))
    if d.split_keys:
        keys += invariance.aligned_begin("key_begin", d.keys.bounds.first_key, d.key_block)
    if d.split_keys and finish.merges_splits:
        state, visits = _merged_visits(d, state)
    else:
        visits = d.keys.keys(d, lambda rules, begin, end: _key_steps(d, rules, begin, end))
    body = _geometry(d, finish) + keys + finish.key_limits + q_cache + state + setup(d) + visits + finish.store(d)
    return assemble(launch_plan(d, finish), summary=summary(d, finish), builtins=BUILTINS, body=body)


@lru_cache(maxsize=256)
def generate(d: KernelDescriptor) -> KernelSource:
    """The MSL source and launch plan of the one-pass forward kernel described by `d`."""
    return _kernel(d, Normalized)


@lru_cache(maxsize=64)
def generate_partial(d: KernelDescriptor) -> KernelSource:
    """The split-KV partial kernel of `d` (its sizes name S and Cs); attention_combine finishes it."""
    return _kernel(d, SplitPartial)
