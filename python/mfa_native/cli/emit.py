"""Print the MSL generated for a problem: `emit KIND --head-dim 64 ...`, one KIND per pass codegen builds."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator

from .. import codegen
from ..codegen import AttentionProblem
from ..codegen.attention import merge as codegen_merge
from ..codegen.int8 import passes as int8_passes
from ..codegen.sparse import topk as codegen_topk
from ..codegen.storage import quantize as codegen_quantize
from ..quant_formats import FORMATS, QuantFormat
from ..runtime import templates
from ..runtime.templates import PassTemplate, evaluate
from ..tuning import kernel_report

Built = tuple[PassTemplate, dict[str, int]]   # a family's pass template and the problem's own runtime sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = "kernel families:\n" + "\n".join(f"  {name:<19} {doc}" for name, (_, doc) in KINDS.items())
    parser.add_argument("kernel", choices=list(KINDS), help="which pass to generate (see above)")
    shape = parser.add_argument_group("problem")
    shape.add_argument("--head-dim", type=int, required=True,
                       help="D, the q/k head dimension (quantize: x's last axis; sparse-topk: Di)")
    shape.add_argument("--value-dim", type=int, help="Dv, the v head dimension (default: D)")
    shape.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float16")
    shape.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd")
    shape.add_argument("--batch", type=int, default=1)
    shape.add_argument("--q-heads", type=int, default=1,
                       help="Hq (quantize: x's head axis; sparse-topk: the indexer heads Hi)")
    shape.add_argument("--kv-heads", type=int, help="default: --q-heads")
    shape.add_argument("--q-len", type=int, default=128,
                       help="R (a runtime value unless --bake-lengths; quantize: x's rows per head)")
    shape.add_argument("--kv-len", type=int, help="C (default: R)")
    shape.add_argument("--causal", choices=["none", "lower_right", "upper_left"], default="none",
                       help="sparse-topk: lower_right (its only alignment) or none")
    shape.add_argument("--mask", choices=["none", "bool", "additive"], default="none")
    shape.add_argument("--mask-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                       help="element type of an additive mask")
    shape.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), help="sliding window, -1 = unbounded")
    shape.add_argument("--sinks", action="store_true", help="one extra logit per head")
    shape.add_argument("--lse", action="store_true", help="also store the log-sum-exp")
    shape.add_argument("--scale", type=float, help="default: 1/sqrt(D)")
    shape.add_argument("--batch-invariant", action="store_true",
                       help='deterministic="batch_invariant": fixed splits merged in order')
    family = parser.add_argument_group("family options")
    family.add_argument("--topk", type=int, default=64,
                        help="sparse-attention: entries per key list; sparse-topk: keys kept per row (default 64)")
    family.add_argument("--qk-scale", choices=["token", "tile"], default="token", help="int8-attention")
    family.add_argument("--no-smooth-k", action="store_true", help="int8-attention: quantize K without its mean")
    family.add_argument("--pv", choices=["int8", "float"], default="int8", help="int8-attention")
    family.add_argument("--format", choices=list(FORMATS), default="affine", help="quantize")
    family.add_argument("--bits", type=int, help="quantize: affine 2, 3, 4, 5, 6 or 8 (default 8)")
    family.add_argument("--group-size", type=int, help="quantize: affine 32, 64 or 128 (default 64)")
    family.add_argument("--parts", type=int, default=2, help="merge: attention parts to merge (default 2)")
    tuning = parser.add_argument_group("kernel")
    tuning.add_argument("--family", choices=codegen.FAMILIES, default=codegen.CPU_FAMILY, help="tile table to use")
    tuning.add_argument("--bake-lengths", action="store_true",
                        help="sizes as literals instead of a runtime struct (attention families)")
    tuning.add_argument("--parallel-threadgroups", type=int, metavar="N",
                        help="attention: threadgroups the device runs at once: decode problems that leave it idle "
                             "get the split-KV pair of kernels (default: never split)")
    tuning.add_argument("--plan", action="store_true",
                        help="print the pass: each kernel's grid and the buffers it binds, instead of the source")
    tuning.add_argument("--json", action="store_true",
                        help="print the pass template as JSON (sizes symbolic); with --sizes, the evaluated pass")
    tuning.add_argument("--sizes", metavar="NAME=N,...",
                        help="with --json: evaluate the template for these runtime sizes "
                             "(e.g. B=2,Hq=8,Hkv=2,R=1,C=4096); the problem's own fill the rest")
    tuning.add_argument("--report", action="store_true",
                        help="attention, attention-backward: per kernel, registers per thread (estimate), "
                             "threadgroup memory, barriers per block and device bytes per useful MAC, for the "
                             "built-in tile row and each row that changes one of its columns (a progress bar on "
                             "a terminal)")
    tuning.add_argument("--quiet", action="store_true", help="with --report: no progress bar")
    tuning.add_argument("--backward", action="store_true",
                        help="attention, sparse-attention: the backward pass's kernels instead of the forward's")


def problem_from(args: argparse.Namespace) -> AttentionProblem:
    mask_dtype = None
    if args.mask == "bool":
        mask_dtype = "bool"
    elif args.mask == "additive":
        mask_dtype = args.mask_dtype
    return AttentionProblem(
        batch=args.batch, q_heads=args.q_heads, kv_heads=args.kv_heads or args.q_heads,
        q_len=args.q_len, kv_len=args.kv_len or args.q_len,
        head_dim=args.head_dim, value_dim=args.value_dim or args.head_dim,
        dtype=args.dtype, layout=args.layout, causal=args.causal,
        window=tuple(args.window) if args.window else None,
        mask=args.mask, mask_dtype=mask_dtype, sinks=args.sinks, scale=args.scale, return_lse=args.lse,
        batch_invariant=args.batch_invariant,
        aligned=codegen.ALLOCATED)   # the kernels of arrays numpy allocates (vector pairs where the row allows)


def _forward(args: argparse.Namespace, problem: AttentionProblem) -> Built:
    template = codegen.attention_template(problem, family=args.family, bake_lengths=args.bake_lengths,
                                          parallel_threadgroups=args.parallel_threadgroups)
    return template, codegen.call_sizes(problem, args.parallel_threadgroups)


def _backward(args: argparse.Namespace, problem: AttentionProblem) -> Built:
    template = codegen.attention_backward_template(codegen.AttentionBackwardProblem(problem), family=args.family,
                                                   bake_lengths=args.bake_lengths)
    return template, codegen.call_sizes(problem)


def attention(args: argparse.Namespace) -> Built:
    return (_backward if args.backward else _forward)(args, problem_from(args))


def attention_backward(args: argparse.Namespace) -> Built:
    return _backward(args, problem_from(args))


def sparse_attention(args: argparse.Namespace) -> Built:
    """Token lists, contiguous (B, Hkv, R, topk) indices, as `sparse_attention` builds them."""
    problem = problem_from(args)
    if args.topk < 1:
        raise ValueError(f"--topk must be positive, got {args.topk}")
    lists = (problem.batch, problem.kv_heads, problem.q_len, args.topk)
    problem = replace(problem, keys=codegen.TokenLists(args.topk, codegen.contiguous_strides("bhsd", lists)))
    return (_backward if args.backward else _forward)(args, problem)


def int8_attention(args: argparse.Namespace) -> Built:
    problem = codegen.Int8Problem(problem_from(args), qk_scale=args.qk_scale, smooth_k=not args.no_smooth_k,
                                  pv=args.pv)
    with _evaluated(int8_passes) as seen:
        int8_passes.int8_attention_pass(problem, family=args.family, bake_lengths=args.bake_lengths)
    return seen[-1]


def quantize(args: argparse.Namespace) -> Built:
    """x of shape (--batch, --q-heads, --q-len, --head-dim), contiguous, as `quantize` binds it."""
    f = QuantFormat.of(args.format, args.bits, args.group_size)
    shape = (args.batch, args.q_heads, args.q_len, args.head_dim)
    if args.head_dim % f.group_size:
        raise ValueError(f"--head-dim ({args.head_dim}) must be a multiple of the group size ({f.group_size})")
    with _evaluated(codegen_quantize) as seen:
        codegen_quantize.quantize_pass(codegen_quantize.QuantizeDescriptor(args.dtype, f), shape)
    return seen[-1]


def sparse_topk(args: argparse.Namespace) -> Built:
    """The indexer: q (B, Hi, R, Di), k (B, 1, C, Di), weights (B, Hi, R), contiguous."""
    if args.causal == "upper_left":
        raise ValueError("sparse-topk's causal rule is lower_right (c <= r + C - R) or none")
    if args.topk < 0:
        raise ValueError(f"--topk must not be negative, got {args.topk}")
    sizes = dict(B=args.batch, Hi=args.q_heads, R=args.q_len, C=args.kv_len or args.q_len, K=args.topk,
                 Di=args.head_dim)
    B, Hi, R, C, Di = (sizes[n] for n in ("B", "Hi", "R", "C", "Di"))
    q = codegen.contiguous_strides(args.layout, (B, Hi, R, Di))   # logical order, as the op passes them
    k = codegen.contiguous_strides(args.layout, (B, 1, C, Di))
    w = (Hi * R, R, 1) if args.layout == "bhsd" else (R * Hi, 1, Hi)   # weights (B, Hi, R) or (B, R, Hi)
    weights = (*w, 0)
    descriptor = codegen_topk.describe_topk(dtype=args.dtype, shape=sizes, strides=dict(q=q, k=k, weights=weights),
                                            layout=args.layout, causal=args.causal != "none")
    given = {**sizes, "P": args.parallel_threadgroups or 1}   # P: splits of long rows fill the device
    return codegen_topk.topk_template(descriptor), {n: given[n] for n in codegen_topk.GIVEN_SIZES}


def merge(args: argparse.Namespace) -> Built:
    """`merge_attention` of --parts parts of (B, Hq, R, Dv) outputs and their lse."""
    if args.parts < 1:
        raise ValueError(f"--parts must be positive, got {args.parts}")
    descriptor = codegen_merge.describe_merge(dtype=args.dtype, value_dim=args.value_dim or args.head_dim,
                                              parts=args.parts, layout=args.layout)
    return codegen_merge.merge_template(descriptor), dict(B=args.batch, Hq=args.q_heads, R=args.q_len)


KINDS: dict[str, tuple[Callable[[argparse.Namespace], Built], str]] = {
    "attention": (attention, "attention's forward pass (the split-KV pair with --parallel-threadgroups)"),
    "attention-backward": (attention_backward, "attention_backward: the dQ and dK/dV kernels (and dsinks)"),
    "sparse-attention": (sparse_attention, "sparse_attention over --topk token lists (--backward: its gradients)"),
    "int8-attention": (int8_attention, "int8_attention: the int8 quantizers and the integer attention kernel"),
    "quantize": (quantize, "quantize: x (B, Hq, R, D) to --format [--bits --group-size]"),
    "sparse-topk": (sparse_topk, "sparse_topk: the lightning indexer's scores and the top --topk of each row"),
    "merge": (merge, "merge_attention of --parts parts"),
}


def summary() -> str:
    """The command's line in `python -m mfa_native --help`: every kind by name."""
    return f"Print the MSL (or the pass) generated for a problem: `emit KIND ...`, KIND one of {', '.join(KINDS)}."


@contextmanager
def _evaluated(module) -> Iterator[list[Built]]:
    """The templates `module`'s pass builder evaluates, with their sizes. int8 attention's and
    quantize's builders return the evaluated pass only; this sees the template they evaluate,
    so --json prints a template for every family without a second copy of a builder."""
    seen: list[Built] = []

    def evaluating(template: PassTemplate, sizes):
        seen.append((template, dict(sizes)))
        return templates.evaluate(template, sizes)

    original = module.evaluate
    module.evaluate = evaluating
    try:
        yield seen
    finally:
        module.evaluate = original


def run(args: argparse.Namespace) -> int:
    if args.report:
        if args.kernel not in ("attention", "attention-backward"):
            print("emit: --report covers the attention and attention-backward kernels", file=sys.stderr)
            return 2
        try:
            return kernel_report.run(args, problem_from(args))
        except ValueError as error:
            print(f"emit: {error}", file=sys.stderr)
            return 2
    try:
        template, sizes = KINDS[args.kernel][0](args)
        description = evaluate(template, {**sizes, **_sizes(args.sizes)})
    except ValueError as error:
        print(f"emit: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(description.to_json() if args.sizes else template.to_json())
        return 0
    for kernel in description.kernels:
        if not args.plan:
            print(kernel.source, end="")
            continue
        groups = ", ".join(map(str, kernel.threadgroups))
        print(f"kernel {kernel.entry}: threadgroups ({groups}), {kernel.threads_per_threadgroup[0]} threads each")
        for index, name in enumerate(kernel.buffers):
            b = description.buffer(name)
            layout = f" strides {b.strides}" if b.strides is not None else ""
            print(f"  [[buffer({index})]] {name}: {b.role} {b.dtype} {b.shape}{layout}")
    return 0


def _sizes(text: str | None) -> dict[str, int]:
    """--sizes NAME=N,...: runtime sizes."""
    sizes = {}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if not name.strip() or not value.strip().isdigit():
            raise ValueError(f"--sizes takes NAME=N pairs separated by commas, got {item!r}")
        sizes[name.strip()] = int(value)
    return sizes
