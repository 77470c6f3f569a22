"""Tensor-parallel context: this process's rank in the model's TP group and its collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """Rank and size of the tensor-parallel group; size 1 makes every collective a no-op."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel layer across ranks (in place)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate per-rank shards along the last dimension (vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, columns); a clear error when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        return total // self.size


SINGLE = TensorParallel()
