"""`mfa_native.block_sparse_attention` and its backward: attention over the key blocks a
BlockMask lists (FlexAttention's semantics), with the dense kernels' rules inside partial
blocks. The kernels are attention's, walking block lists instead of one key range."""

from __future__ import annotations

from dataclasses import replace

from .. import codegen
from ..runtime.devices import Device, resolve_device, tuning_facts
from .attention import Validated, forward_results, validate
from .attention_backward import gradients, validate_backward
from .arguments import is_empty
from .block_mask import PAIRS, BlockMask, check_lists
from .empty import empty_backward, empty_forward
from .given_kind import returns_given_kind
from .warm import SignatureCache, prepared_call, run, signature

LISTS = tuple(name for pair in PAIRS for name in pair)
ARGUMENTS = ("q", "k", "v", "mask", "sinks") + LISTS
BACKWARD_ARGUMENTS = ("q", "k", "v", "o", "lse", "dout", "mask", "sinks") + LISTS
_forward_calls = SignatureCache()
_backward_calls = SignatureCache()


@returns_given_kind(("q", "k", "v"), ("mask", "sinks"))
def block_sparse_attention(q, k, v, block_mask: BlockMask, *, scale=None, causal=False, mask=None, window=None,
                           sinks=None, layout="bhsd", return_lse=False, device: Device | str | None = None):
    """Attention over the key blocks `block_mask` lists for each query block.

    Query (b, h, r) sees key c iff c lies in a block its query block lists, and either the
    block is in the full lists, or it is in the partial lists and causal, window and a
    boolean `mask` allow (r, c) exactly as in `attention`. An additive `mask` is added to
    the logit wherever (r, c) is visited. A block listed twice (in one list, or in both) is
    visited twice (its keys count twice in the softmax), as in FlexAttention.

    Args:
        q, k, v, scale, causal, mask, window, sinks, layout, return_lse, device: as in
            `attention` (shapes, dtypes, GQA, D and Dv). The block mask's H axis is the
            query-head count, or 1.
        block_mask: a `BlockMask` for (R, C) = (q's length, k's length).

    Returns:
        As `attention`: the output, and with return_lse the (B, Hq, R) float32 lse. Rows that
        see nothing give 0, and lse -inf (the sink's logit with sinks).

    Raises:
        TypeError, ValueError naming the argument that is wrong (block_mask included).
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a mfa_native.BlockMask, got {type(block_mask).__name__}")
    device = resolve_device(device)
    arrays = (q, k, v, mask, sinks) + tuple(block_mask.arrays.get(name) for name in LISTS)
    key = signature(arrays, (scale, causal, window, layout, return_lse, block_mask.structure), device)

    def prepare():
        checked = _with_lists(validate(arrays[:5], scale=scale, causal=causal, window=window, layout=layout,
                                       return_lse=return_lse), block_mask)
        p = checked.problem
        if is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
            return empty_forward(p, ARGUMENTS, checked)
        description = codegen.attention_pass(p, family=tuning_facts(device).family)
        return prepared_call(description, device, checked, ARGUMENTS, forward_results(return_lse),
                             _list_check(block_mask, p, first=5))

    return run(_forward_calls, key, arrays, prepare)


@returns_given_kind(("q", "k", "v"), ("o", "lse", "do", "mask", "sinks"))
def block_sparse_attention_backward(q, k, v, o, lse, do, block_mask: BlockMask, *, scale=None, causal=False,
                                    mask=None, window=None, sinks=None, layout="bhsd",
                                    device: Device | str | None = None):
    """Gradients of `block_sparse_attention`, as `attention_backward` returns them:
    (dq, dk, dv), and dsinks with sinks. No atomics: the dK/dV kernel walks the transposed
    lists (the block mask's q lists, or built on the device in the same pass).

    Args:
        q, k, v, o, lse, do, scale, causal, mask, window, sinks, layout, device: as in
            `attention_backward`; o and lse are what `block_sparse_attention(...,
            return_lse=True)` returned for the same block mask.
        block_mask: the `BlockMask` of the forward call.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a mfa_native.BlockMask, got {type(block_mask).__name__}")
    device = resolve_device(device)
    arrays = (q, k, v, o, lse, do, mask, sinks) + tuple(block_mask.arrays.get(name) for name in LISTS)
    key = signature(arrays, (scale, causal, window, layout, block_mask.structure), device)

    def prepare():
        backward = validate_backward(arrays[:8], scale=scale, causal=causal, window=window, layout=layout)
        forward = _with_lists(Validated(backward.problem.forward, backward.bound, backward.converts), block_mask)
        problem = replace(backward.problem, forward=forward.problem)
        p = problem.forward
        if is_empty(p.batch, p.q_heads, p.q_len, p.kv_len):
            return empty_backward(p, BACKWARD_ARGUMENTS, forward)
        description = codegen.attention_backward_pass(problem, family=tuning_facts(device).family)
        return prepared_call(description, device, forward, BACKWARD_ARGUMENTS, gradients(p.sinks),
                             _list_check(block_mask, p, first=8))

    return run(_backward_calls, key, arrays, prepare)


def _with_lists(call: Validated, block_mask: BlockMask) -> Validated:
    """`call` (attention's checked arguments) with the block mask's lists checked for its problem."""
    p = call.problem
    checked = block_mask.checked(p.batch, p.q_heads, p.q_len, p.kv_len)
    converts = {**call.converts, **{name: None for name in checked.arrays}}
    return Validated(replace(p, keys=checked.lists), {**call.bound, **checked.arrays}, converts)


def _list_check(block_mask: BlockMask, p, first: int):
    """The warm path's check of the lists' contents (arguments first.. are the lists)."""
    block_size = block_mask.block_size
    sizes = (p.batch, p.q_heads, p.q_len, p.kv_len)
    return lambda arguments: check_lists(dict(zip(LISTS, arguments[first:])), block_size, *sizes)
