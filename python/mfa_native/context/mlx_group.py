"""`Group` over mx.distributed: send and recv between ring neighbours (the ring backend allows no
other), each direction on a stream of its own so that both are in flight at once and overlap the
caller's compute; all_gather for the merges and the descriptors."""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from .group import Shape, Traffic

_STREAMS: list[Any] = []   # (send, receive): made once, on first use


def _streams() -> tuple[Any, Any]:
    if not _STREAMS:
        _STREAMS.extend([mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)])
    return _STREAMS[0], _STREAMS[1]


def _start(pending: list[mx.array]) -> Callable[[], None]:
    """Starts evaluating the messages; returns the wait for them. Under mx.grad or mx.vjp MLX
    refuses async_eval (and its streams belong to one thread): there the messages go when
    awaited, both directions at once, not overlapped with the compute."""
    try:
        mx.async_eval(*pending)
    except ValueError:
        pass
    return lambda: mx.eval(*pending)


class MlxGroup:
    framework_name = "mx.array"

    def __init__(self, group: Any = None) -> None:
        self.group = mx.distributed.init() if group is None else group
        self.traffic = Traffic()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.next, self.previous = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def owns(self, x: Any) -> bool:
        return isinstance(x, mx.array)

    def gather_objects(self, value: Any) -> list[Any]:
        data = np.frombuffer(pickle.dumps(value), np.uint8)
        self.traffic.gathered += data.size
        start = time.perf_counter()
        lengths = np.array(mx.distributed.all_gather(mx.array([data.size], mx.int32), group=self.group))
        padded = np.zeros(int(lengths.max()), np.uint8)
        padded[:data.size] = data
        everything = np.array(mx.distributed.all_gather(mx.array(padded)[None], group=self.group))
        self.traffic.gathering += time.perf_counter() - start
        return [pickle.loads(row[:n].tobytes()) for row, n in zip(everything, lengths)]

    def all_gather(self, x: mx.array) -> list[mx.array]:
        self.traffic.gathered += self.nbytes(x)
        start = time.perf_counter()
        gathered = mx.distributed.all_gather(x[None], group=self.group)
        mx.eval(gathered)
        self.traffic.gathering += time.perf_counter() - start
        return [gathered[r] for r in range(self.size)]

    def shift(self, arrays: Sequence[mx.array], incoming: Sequence[Shape], like: mx.array) -> Callable[[], list]:
        if self.size == 1:
            return lambda: list(arrays)
        send_stream, receive_stream = _streams()
        sizes = [int(np.prod(shape)) for shape in incoming]
        pending = []
        if arrays and sum(x.size for x in arrays):
            outgoing = mx.concatenate([x.reshape(-1) for x in arrays])
            pending.append(mx.distributed.send(outgoing, self.next, group=self.group, stream=send_stream))
        received = None
        if sum(sizes):
            received = mx.distributed.recv((sum(sizes),), like.dtype, self.previous, group=self.group,
                                           stream=receive_stream)
            pending.append(received)
        waiting = _start(pending)

        def wait() -> list[mx.array]:
            waiting()
            starts = np.cumsum([0, *sizes])
            return [mx.zeros(shape, like.dtype) if received is None else received[a:b].reshape(shape)
                    for a, b, shape in zip(starts, starts[1:], incoming)]

        return wait

    def cat(self, arrays: Sequence[mx.array], axis: int) -> mx.array:
        return mx.concatenate(list(arrays), axis)

    def zeros(self, shape: Shape, like: mx.array, float32: bool = False) -> mx.array:
        return mx.zeros(shape, mx.float32 if float32 else like.dtype)

    def float32(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32)

    def cast(self, x: mx.array, like: mx.array) -> mx.array:
        return x.astype(like.dtype)

    def swap(self, x: mx.array, a: int, b: int) -> mx.array:
        return mx.swapaxes(x, a, b)

    def nbytes(self, x) -> int:
        return int(x.nbytes)

    def int32(self, values: Sequence[int]):
        return mx.array(list(values), mx.int32)

    def exp(self, x: mx.array) -> mx.array:
        return mx.exp(x)
