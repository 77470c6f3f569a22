"""dspark.runner.host_to_device: copies that arrive intact and, on a GPU, do not make the host wait."""

from __future__ import annotations

import time

import pytest
import torch

from dspark.runner.host_to_device import copy_to_device, to_device, to_host_queued

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_values_arrive_on_the_cpu(gen) -> None:
    host = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(gen.initial_seed()))
    assert torch.equal(to_device(host, torch.device("cpu")), host)
    dest = torch.zeros(40, dtype=host.dtype)
    copy_to_device(dest[:37], host)
    assert torch.equal(dest[:37], host) and not dest[37:].any()


@pytest.mark.gpu
@gpu
def test_the_host_does_not_wait_for_a_busy_gpu_and_may_reuse_its_buffer_at_once() -> None:
    """Behind ~0.2 s of queued device work, both copies return at once (a plain .to() would wait for
    it), and overwriting the host tensors right after does not change what arrives."""
    device = torch.device("cuda")
    host = torch.arange(4096, dtype=torch.long)
    expected = host.clone()
    dest = torch.zeros(4096, dtype=torch.long, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # cycles: a few hundred ms of queued device work
    started = time.perf_counter()
    moved = to_device(host, device)
    copy_to_device(dest, host)
    queued_s = time.perf_counter() - started
    host.fill_(-1)  # the caller may reuse its tensor as soon as the call returns
    torch.cuda.synchronize()
    assert queued_s < 0.05, f"the copies waited {queued_s:.3f} s for the device"
    assert torch.equal(moved.cpu(), expected)
    assert torch.equal(dest.cpu(), expected)


def test_a_queued_host_copy_off_cuda_is_a_copy_made_now(gen) -> None:
    values = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(gen.initial_seed()))
    copied = to_host_queued(values)
    values.fill_(-1)
    assert copied.min() >= 0


@pytest.mark.gpu
@gpu
def test_a_queued_host_copy_does_not_wait_and_holds_the_values_after_a_later_event() -> None:
    """Behind ~0.2 s of queued device work the copy returns at once; once an event recorded after it
    has passed, it holds the device tensor's values as they were when the copy was queued, whatever
    the device writes into that tensor afterwards."""
    device = torch.device("cuda")
    values = torch.arange(64, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    started = time.perf_counter()
    host = to_host_queued(values)
    queued_s = time.perf_counter() - started
    values.fill_(-1)  # a later replay overwriting the graph's output
    later = torch.cuda.Event()
    later.record()
    assert queued_s < 0.05, f"the copy waited {queued_s:.3f} s for the device"
    later.synchronize()
    assert host.device.type == "cpu" and torch.equal(host, torch.arange(64))
