"""`Group` over torch.distributed: point-to-point ops for the ring (any backend that has them;
gloo's messages go through host memory), all_gather for the merges."""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .group import Shape, Traffic


class TorchGroup:
    framework_name = "torch.Tensor"

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.traffic = Traffic()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        self.next, self.previous = global_rank((self.rank + 1) % self.size), global_rank((self.rank - 1) % self.size)
        self.wire = torch.device("cpu") if dist.get_backend(group) == "gloo" else None  # gloo sends CPU tensors

    def owns(self, x: Any) -> bool:
        return isinstance(x, Tensor)

    def gather_objects(self, value: Any) -> list[Any]:
        self.traffic.gathered += len(pickle.dumps(value))
        values: list[Any] = [None] * self.size
        start = time.perf_counter()
        dist.all_gather_object(values, value, group=self.group)
        self.traffic.gathering += time.perf_counter() - start
        return values

    def all_gather(self, x: Tensor) -> list[Tensor]:
        self.traffic.gathered += self.nbytes(x)
        wire = x.device if self.wire is None else self.wire
        parts = [torch.empty_like(x, device=wire) for _ in range(self.size)]
        start = time.perf_counter()
        dist.all_gather(parts, x.to(wire), group=self.group)
        self.traffic.gathering += time.perf_counter() - start
        return [part.to(x.device) for part in parts]

    def shift(self, arrays: Sequence[Tensor], incoming: Sequence[Shape], like: Tensor) -> Callable[[], list[Tensor]]:
        if self.size == 1:
            return lambda: list(arrays)
        wire = like.device if self.wire is None else self.wire
        outgoing = torch.cat([x.reshape(-1) for x in arrays]).to(wire) if arrays else None
        sizes = [torch.Size(shape).numel() for shape in incoming]
        received = torch.empty(sum(sizes), dtype=like.dtype, device=wire)
        ops = ([dist.P2POp(dist.isend, outgoing, self.next, self.group)] if outgoing is not None and outgoing.numel()
               else []) + ([dist.P2POp(dist.irecv, received, self.previous, self.group)] if received.numel() else [])
        requests = dist.batch_isend_irecv(ops) if ops else []

        def wait() -> list[Tensor]:
            for request in requests:
                request.wait()
            ops.clear()  # the sent tensor was held until here
            parts = received.to(like.device).split(sizes)
            return [part.view(shape) for part, shape in zip(parts, incoming)]

        return wait

    def cat(self, arrays: Sequence[Tensor], axis: int) -> Tensor:
        return torch.cat(list(arrays), axis)

    def zeros(self, shape: Shape, like: Tensor, float32: bool = False) -> Tensor:
        return torch.zeros(shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)

    def float32(self, x: Tensor) -> Tensor:
        return x.detach().float()

    def cast(self, x: Tensor, like: Tensor) -> Tensor:
        return x.to(like.dtype)

    def swap(self, x: Tensor, a: int, b: int) -> Tensor:
        return x.transpose(a, b)

    def nbytes(self, x) -> int:
        return int(x.numel() * x.element_size())

    def int32(self, values: Sequence[int]):
        return torch.tensor(list(values), dtype=torch.int32)

    def exp(self, x: Tensor) -> Tensor:
        return torch.exp(x)
