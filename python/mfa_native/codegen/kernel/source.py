"""KernelSource: one generated kernel, its MSL and its launch plan, assembled the same way
for every kernel family."""

from __future__ import annotations

from dataclasses import dataclass

from .msl import constants, functions, header, indent, signature, sizes_struct
from .plan import LaunchPlan
from .products import libraries


@dataclass(frozen=True)
class KernelSource:
    source: str
    plan: LaunchPlan


def assemble(plan: LaunchPlan, *, summary: list[str], builtins: list[str], body: list[str]) -> KernelSource:
    """Header comment, sizes struct, signature (from the plan's operands), then the body
    behind declarations of the sizes and named constants it uses."""
    text = "\n".join(body)
    declarations = constants(plan.sizes, text)
    lines = (header(plan, summary, libraries(text)) + functions(text) + sizes_struct(plan.sizes)
             + signature(plan, builtins)
             + ["{"] + indent(declarations + [""] + body) + ["}"])
    return KernelSource("\n".join(lines) + "\n", plan)
