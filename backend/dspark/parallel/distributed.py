"""Tensor-parallel context: this process's rank in the model's TP group, its collectives, and joining
or leaving that group (the default torch.distributed process group: one TP group per process)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


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


def rendezvous_store(port: int, timeout_s: float) -> dist.TCPStore:
    """The TP group's meeting point on this host.

    port 0 (the driver): a store on a port the kernel picks free at bind time, so two engines on one
    host never collide; its `.port` is what the other ranks pass here to connect.
    """
    return dist.TCPStore(
        LOOPBACK,
        port,
        None,
        is_master=port == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_group(
    rank: int, size: int, store: dist.Store, timeout_s: float, device: torch.device
) -> TensorParallel:
    """Join this process to the TP group: NCCL for CUDA devices, gloo on CPU.

    `timeout_s` bounds every collective: a rank that hangs makes the others' collectives raise.
    """
    check_no_group()
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if cuda else None,
    )
    return TensorParallel(rank, size)


def check_no_group() -> None:
    """RuntimeError if this process already belongs to a TP group (one per process)."""
    if dist.is_initialized():
        raise RuntimeError(
            "tensor_parallel_size: this process already hosts a tensor-parallel group "
            "(one tensor-parallel engine per process; close the other one first)"
        )


def leave_group() -> None:
    """Destroy this process's TP group, if it has one (safe after a peer died)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_group() -> None:
    """Release a rank blocked in a NCCL collective whose peer died (gloo raises on its own)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
