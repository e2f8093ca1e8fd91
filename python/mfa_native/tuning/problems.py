"""The tuner's problem sets: one attention shape per (direction, dtype, head dims)."""

from __future__ import annotations

from dataclasses import dataclass

from ..codegen.kernel.tables import DIRECTION_ROWS

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class TuningProblem:
    """One problem a candidate runs: `direction` ("forward" or "backward": the dQ and dK/dV
    kernels, one row), B, Hq, Hkv, R, C, D, Dv, dtype, causal."""

    direction: str
    dtype: str
    head_dim: int
    value_dim: int
    batch: int = 1
    q_heads: int = 2
    kv_heads: int = 2
    q_len: int = 64
    kv_len: int = 64
    causal: bool = False

    def __post_init__(self) -> None:
        if self.direction not in DIRECTION_ROWS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTION_ROWS)}, got {self.direction!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def describe(self) -> str:
        return (f"{self.direction} {self.dtype} D{self.head_dim}/Dv{self.value_dim} B{self.batch} "
                f"H{self.q_heads}/{self.kv_heads} R{self.q_len} C{self.kv_len}{' causal' if self.causal else ''}")


def problem_set(directions=tuple(DIRECTION_ROWS), dtypes=DTYPES, head_dims=(64, 128, 256),
                q_len: int = 1024, kv_len: int = 1024, heads: int = 8) -> list[TuningProblem]:
    """The default set: every direction, dtype and head dim (D = Dv), at a timing size."""
    return [TuningProblem(direction, dtype, d, d, q_heads=heads, kv_heads=heads, q_len=q_len, kv_len=kv_len)
            for direction in directions for dtype in dtypes for d in head_dims]
