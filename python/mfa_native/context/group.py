"""What context parallelism needs of a framework's process group, and array helpers over it.

A `Group` is this rank's view of the ring: it sends to rank + 1 and receives from rank - 1
(`shift`, started before the caller computes and waited for after), all-gathers small Python
values (`gather_objects`) and float32 arrays (`all_gather`), and does the few array operations
the ring's bookkeeping needs on the framework's arrays (torch tensors or MLX arrays: slicing,
`+`, `*`, `reshape` and `sum` are written the same in both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

Shape = tuple[int, ...]


@dataclass
class Traffic:
    """What a group's calls moved: bytes this rank sent to the next (ring shifts) and contributed to
    all-gathers, seconds it spent blocked waiting for shifted messages and in all-gathers, and the
    shifts themselves (so `bench ring` can replay them without the compute)."""

    sent: int = 0
    gathered: int = 0
    waited: float = 0.0
    gathering: float = 0.0
    shifts: list[tuple] = field(default_factory=list)


class Group(Protocol):
    rank: int
    size: int
    framework_name: str  # its array type, as errors name it ("torch.Tensor", "mx.array")
    traffic: Traffic

    def owns(self, x: Any) -> bool:
        """Whether x is one of the framework's arrays."""

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value` (a small picklable object), in rank order."""

    def all_gather(self, x: Any) -> list[Any]:
        """Every rank's float32 1-d array `x` (one length on every rank), in rank order."""

    def shift(self, arrays: Sequence[Any], incoming: Sequence[Shape], like: Any) -> Callable[[], list[Any]]:
        """Starts sending `arrays` (of `like`'s dtype) to the next rank and receiving the previous
        rank's, of the `incoming` shapes; the returned wait gives those, on `like`'s device. A ring
        of one rank passes `arrays` to itself."""

    def cat(self, arrays: Sequence[Any], axis: int) -> Any: ...

    def zeros(self, shape: Shape, like: Any, float32: bool = False) -> Any:
        """Zeros of `like`'s dtype (or float32) on its device."""

    def float32(self, x: Any) -> Any: ...

    def cast(self, x: Any, like: Any) -> Any:
        """x as `like`'s dtype."""

    def swap(self, x: Any, a: int, b: int) -> Any:
        """x with axes a and b exchanged."""

    def exp(self, x: Any) -> Any: ...

    def nbytes(self, x: Any) -> int: ...

    def int32(self, values: Sequence[int]) -> Any:
        """An int32 1-d array of the framework holding `values` (on the host)."""


def shift(group: Group, arrays: Sequence[Any], incoming: Sequence[Shape], like: Any) -> Callable[[], list[Any]]:
    """group.shift, its bytes and its waiting counted in group.traffic."""
    group.traffic.shifts.append((list(arrays), list(incoming), like))
    if group.size > 1:
        group.traffic.sent += sum(group.nbytes(x) for x in arrays)
    wait = group.shift(arrays, incoming, like)

    def counted() -> list[Any]:
        start = time.perf_counter()
        received = wait()
        group.traffic.waited += time.perf_counter() - start
        return received

    return counted


def resized(shape: Shape, axis: int, length: int) -> Shape:
    """`shape` with `axis` `length` long."""
    return (*shape[:axis], length, *shape[axis + 1:])


def narrow(x: Any, axis: int, start: int, length: int) -> Any:
    """Positions [start, start + length) of x along `axis`."""
    return x[(slice(None),) * axis + (slice(start, start + length),)]


def padded(group: Group, x: Any, axis: int, length: int, fill: float = 0.0) -> Any:
    """x extended along `axis` to `length` with `fill` (0 or -inf)."""
    missing = length - x.shape[axis]
    if missing == 0:
        return x
    tail = group.zeros(resized(tuple(x.shape), axis, missing), x)
    return group.cat([x, tail if fill == 0.0 else tail + fill], axis)
