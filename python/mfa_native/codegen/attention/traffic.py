"""Device bytes of the dense per-head forward kernel, from its descriptor: what the cpu
backend's traffic counters count for a non-causal, unmasked problem without sinks (a model of
the kernel's loads: every simdgroup with a row below R reads every key row up to C rounded up
to 8, or, with K/V staged (stage_kv), every threadgroup reads each key row once; Q once per
simdgroup of the grid when cached, else once per key block by every simdgroup that walks the
keys: those with a row below R, or staged, all of them)."""

from __future__ import annotations

from .descriptor import KernelDescriptor
from .keys import DENSE
from .problem import AttentionProblem
from .stage_sizes import ITEM_BYTES


def modelled(problem: AttentionProblem) -> bool:
    """Whether forward_bytes models `problem`'s kernel."""
    p = problem
    return (p.causal == "none" and p.mask == "none" and p.window is None and not p.sinks
            and not p.rows.packed and p.keys is DENSE)


def forward_bytes(problem: AttentionProblem, d: KernelDescriptor) -> int:
    """Bytes the one-pass forward kernel reads and writes on the device."""
    p, item = problem, ITEM_BYTES[problem.dtype]
    active = p.batch * p.q_heads * -(-p.q_len // 8)
    grid = p.batch * p.q_heads * -(-p.q_len // d.query_rows) * d.simdgroups
    walking = grid if d.stage_kv else active
    key_rows = grid // d.simdgroups * p.kv_len if d.stage_kv else active * -(-p.kv_len // 8) * 8
    q_reads = grid if d.cache_q else walking * -(-p.kv_len // d.key_block)
    reads = (key_rows * (p.head_dim + p.value_dim) + q_reads * 8 * p.head_dim) * item
    writes = p.batch * p.q_heads * p.q_len * (p.value_dim * item + (4 if p.return_lse else 0))
    return reads + writes


def useful_macs(problem: AttentionProblem) -> int:
    """Scalar multiply-accumulates of S = Q K^T and O = P V (every pair visible)."""
    p = problem
    return p.batch * p.q_heads * p.q_len * p.kv_len * (p.head_dim + p.value_dim)
