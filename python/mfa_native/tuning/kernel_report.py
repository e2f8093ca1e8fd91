"""`emit attention --report`: the static report of each kernel (codegen/kernel/report.py) for
the built-in tile row and for every row that changes one of its columns (tables.DOMAINS)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .. import codegen
from ..codegen.attention import traffic
from ..codegen.attention.descriptor import describe
from ..codegen.kernel.report import report
from ..codegen.kernel.tables import DOMAINS, built_in_row, forced_rows
from ..codegen.attention.problem import AttentionProblem
from ..progress import Report, reporting, silent


def alternatives(row) -> list[tuple[str, object]]:
    """(label, row): the row itself, then each single-column change of it within DOMAINS."""
    rows = [("built-in", row)]
    for column, domain in DOMAINS[type(row)].items():
        rows += [(f"{column}={value}", replace(row, **{column: value}))
                 for value in domain if value != getattr(row, column)]
    return rows


def _pass(problem: AttentionProblem, backward: bool, family: str):
    if backward:
        return codegen.attention_backward_pass(codegen.AttentionBackwardProblem(problem), family=family)
    return codegen.attention_pass(problem, family=family)


def _bytes_per_mac(problem: AttentionProblem, backward: bool, family: str) -> str:
    if backward or not traffic.modelled(problem):
        return "-"
    return f"{traffic.forward_bytes(problem, describe(problem, family=family)) / traffic.useful_macs(problem):.4f}"


def lines(problem: AttentionProblem, backward: bool, family: str, progress: Report = silent) -> list[str]:
    """The report's table: one line per (row, kernel); progress(done, total, row) as each row is done."""
    direction = "backward" if backward else "forward"
    row = built_in_row(direction, family, problem.dtype, max(problem.head_dim, problem.value_dim))
    out = [f"{direction} kernels, {problem.dtype} D {problem.head_dim} Dv {problem.value_dim}, family {family}; "
           "registers: 32-bit per thread, every declared tile and scalar live (an estimate); "
           "bytes/MAC: device bytes per useful multiply-accumulate (modelled: dense unmasked per-head forward); "
           "accesses: device loads and stores in the kernel's text (of them vector: a lane's pair as one); "
           "products: simdgroup_matrix or tensor_ops (Metal 4 matmul2d)",
           f"{'row':<20} {'kernel':<28} {'registers':>9} {'(tiles)':>8} {'tg bytes':>9} {'barriers/block':>14} "
           f"{'bytes/MAC':>10} {'accesses (vector)':>17} {'products':>16}"]
    rows = list(alternatives(row))
    for index, (label, candidate) in enumerate(rows):
        progress(index, len(rows), label)
        with forced_rows(family, **{direction: candidate}) as forced:
            description = _pass(problem, backward, forced)
            per_mac = _bytes_per_mac(problem, backward, forced)
        for kernel in description.kernels:
            r = report(kernel.entry, kernel.source)
            accesses = f"{r.device_accesses} ({r.vector_accesses})"
            out.append(f"{label:<20} {r.entry:<28} {r.registers:>9} {r.tile_registers:>8} {r.threadgroup_bytes:>9} "
                       f"{r.barriers_per_block:>14} {per_mac:>10} {accesses:>17} {r.products:>16}")
    progress(len(rows), len(rows), "done")
    return out


def run(args: argparse.Namespace, problem: AttentionProblem) -> int:
    with reporting("emit --report", unit="row", quiet=args.quiet) as progress:
        table = lines(problem, args.backward or args.kernel == "attention-backward", args.family, progress)
    print("\n".join(table))
    return 0
