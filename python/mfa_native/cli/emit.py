"""Print the MSL generated for a problem: `emit attention --head-dim 64 --causal lower_right ...`."""

from __future__ import annotations

import argparse
import sys

from .. import codegen
from ..codegen import AttentionProblem
from ..runtime.templates import evaluate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kernel", choices=["attention"], help="which kernel to generate")
    shape = parser.add_argument_group("problem")
    shape.add_argument("--head-dim", type=int, required=True, help="D, the q/k head dimension")
    shape.add_argument("--value-dim", type=int, help="Dv, the v head dimension (default: D)")
    shape.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float16")
    shape.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd")
    shape.add_argument("--batch", type=int, default=1)
    shape.add_argument("--q-heads", type=int, default=1)
    shape.add_argument("--kv-heads", type=int, help="default: --q-heads")
    shape.add_argument("--q-len", type=int, default=128, help="R (a runtime value unless --bake-lengths)")
    shape.add_argument("--kv-len", type=int, help="C (default: R)")
    shape.add_argument("--causal", choices=["none", "lower_right", "upper_left"], default="none")
    shape.add_argument("--mask", choices=["none", "bool", "additive"], default="none")
    shape.add_argument("--mask-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                       help="element type of an additive mask")
    shape.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), help="sliding window, -1 = unbounded")
    shape.add_argument("--sinks", action="store_true", help="one extra logit per head")
    shape.add_argument("--lse", action="store_true", help="also store the log-sum-exp")
    shape.add_argument("--scale", type=float, help="default: 1/sqrt(D)")
    tuning = parser.add_argument_group("kernel")
    tuning.add_argument("--family", choices=codegen.FAMILIES, default=codegen.CPU_FAMILY, help="tile table to use")
    tuning.add_argument("--bake-lengths", action="store_true", help="sizes as literals instead of a runtime struct")
    tuning.add_argument("--parallel-threadgroups", type=int, metavar="N",
                        help="threadgroups the device runs at once: decode problems that leave it idle "
                             "get the split-KV pair of kernels (default: never split)")
    tuning.add_argument("--plan", action="store_true",
                        help="print the pass: each kernel's grid and the buffers it binds, instead of the source")
    tuning.add_argument("--json", action="store_true",
                        help="print the pass template as JSON (sizes symbolic); with --sizes, the evaluated pass")
    tuning.add_argument("--sizes", metavar="NAME=N,...",
                        help="with --json: evaluate the template for these runtime sizes "
                             "(e.g. B=2,Hq=8,Hkv=2,R=1,C=4096); the problem's own fill the rest")
    tuning.add_argument("--backward", action="store_true",
                        help="the backward pass's kernels (dQ, then dK/dV) instead of the forward's")


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
        mask=args.mask, mask_dtype=mask_dtype, sinks=args.sinks, scale=args.scale, return_lse=args.lse)


def run(args: argparse.Namespace) -> int:
    try:
        problem = problem_from(args)
        if args.backward:
            template = codegen.attention_backward_template(codegen.AttentionBackwardProblem(problem),
                                                           family=args.family, bake_lengths=args.bake_lengths)
        else:
            template = codegen.attention_template(problem, family=args.family, bake_lengths=args.bake_lengths,
                                                  parallel_threadgroups=args.parallel_threadgroups)
        sizes = {**codegen.call_sizes(problem, args.parallel_threadgroups), **_sizes(args.sizes)}
        attention_pass = evaluate(template, sizes)
    except ValueError as error:
        print(f"emit: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(attention_pass.to_json() if args.sizes else template.to_json())
        return 0
    for kernel in attention_pass.kernels:
        if not args.plan:
            print(kernel.source, end="")
            continue
        groups = ", ".join(map(str, kernel.threadgroups))
        print(f"kernel {kernel.entry}: threadgroups ({groups}), {kernel.threads_per_threadgroup[0]} threads each")
        for index, name in enumerate(kernel.buffers):
            b = attention_pass.buffer(name)
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
