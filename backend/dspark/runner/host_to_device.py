"""Copies between host and device that do not make the host wait for the device.

A plain `tensor.to("cuda")` from pageable memory ends in a stream synchronisation: the host stops
until every kernel queued before the copy has run. A step makes several such copies (window numbers,
logit rows, acceptance inputs) while the drafter's and the target's graphs are still running, so each
one used to drain the device and leave it idle while the host prepared the next launch. Staged through
pinned memory and queued with `non_blocking`, the copy is ordered on the stream like a kernel and the
host goes on queuing; the caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, queued without waiting for the device (a no-op off CUDA or when it is there)."""
    if device.type != "cuda" or host.device.type == "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_device(dest: torch.Tensor, host: torch.Tensor) -> None:
    """dest.copy_(host) queued the same way: the host does not wait, and may reuse `host` at once."""
    if dest.device.type != "cuda" or host.device.type == "cuda":
        dest.copy_(host)
    else:
        dest.copy_(host.pin_memory(), non_blocking=True)


def to_host_queued(device_tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `device_tensor`, queued on its stream like a kernel: the host does not wait, and
    the copy holds the values once any later event on that stream has passed (e.g. the step's
    acceptance). Off CUDA, a copy made now."""
    if device_tensor.device.type != "cuda":
        return device_tensor.clone()
    host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=True)
    host.copy_(device_tensor, non_blocking=True)
    return host
