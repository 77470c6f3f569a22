"""Helpers shared by the kernel modules (imported by kernels/runtime.py, in the load's mode)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Fixed when the kernel modules are imported (runtime.load_kernels sets TRITON_INTERPRET around that).
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return triton.next_power_of_2(max(int(n), 1))


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether a kernel runs its tl.dot in fp32: always in the interpreter (its bf16 dot is wrong), and
    for fp32 data (exact parity instead of tf32)."""
    return INTERPRET or dtype == torch.float32


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Programmatic dependent launch: the per-layer kernels of a step (norm, products, rotary + store,
# attention) are launched so that each one's launch overlaps the end of the kernel before it, and each
# waits for that kernel (`wait_for_previous`) before it loads or stores what that kernel may write. A
# kernel boundary inside a CUDA graph on an H200 cost 1.19 us as launched plainly and 0.79 us so
# (RESULTS.md, session 27). Off only for a benchmark's side-by-side.
DEPENDENT_LAUNCH = True
# Once it has waited, a kernel also lets the kernel after it launch (`gdc_launch_dependents`): that one's
# programs start while this one runs and wait there, so its launch is hidden. It changes no result: the
# kernel after still waits for this one to end. On an H200 the Qwen3-8B-shaped decode step at batch 8
# took 0.8-2.4% less time with it, at batch 1 from 0.8% less to 3.5% more (RESULTS.md, session 28).
# Off only for a benchmark's side-by-side.
LAUNCH_NEXT_EARLY = True


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def dependent_launch(device: torch.device) -> int:
    """How a kernel on `device` is launched (Hopper and later, not in the interpreter; see DEPENDENT_LAUNCH
    and LAUNCH_NEXT_EARLY): 0 plainly; 1 dependent on the kernel before it; 2 dependent, and it lets the
    kernel after it launch once it has waited. Pass it as the kernel's PDL and `launch_pdl=pdl > 0`; the
    kernel must run `wait_for_previous(PDL)` before any load or store."""
    if not DEPENDENT_LAUNCH or INTERPRET or device.type != "cuda":
        return 0
    if _capability(device.index if device.index is not None else torch.cuda.current_device())[0] < 9:
        return 0
    return 2 if LAUNCH_NEXT_EARLY else 1


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A dependent kernel's wait for the kernel before it to end (its writes then visible), then its
    signal that the kernel after it may launch (PDL == 2; see dependent_launch)."""
    if PDL >= 1:
        gdc_wait()
    if PDL >= 2:
        gdc_launch_dependents()


@functools.lru_cache(maxsize=16)
def _shared_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def shared_memory_bytes(device: torch.device) -> int:
    """Shared memory one program may use on the device (a nominal 227 KiB, an H100/H200's, off CUDA)."""
    if device.type != "cuda":
        return 227 << 10
    return _shared_memory(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (a nominal 132, an H100/H200's count, off CUDA)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


if INTERPRET:

    @triton.jit
    def round_cast(x, dtype: tl.constexpr):
        """x (fp32) cast to dtype rounding to nearest even, as torch and the GPU do.

        The interpreter truncates fp32 -> bf16, so the rounding is done on the bits first."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
        return x.to(dtype)

else:

    @triton.jit
    def round_cast(x, dtype: tl.constexpr):
        """x (fp32) cast to dtype (the GPU rounds to nearest even)."""
        return x.to(dtype)


@triton.jit
def find_window(cu_seqlens_ptr, num_requests, index, num_steps, TILE: tl.constexpr):
    """For each `index` (scalar or vector): the last request r with first(r) <= index, where
    first(r) = cu[r] // TILE + r if TILE > 1, else cu[r].

    With TILE = 1 that is the window holding packed token `index` (empty windows are skipped); with TILE
    a q-tile height, the request owning q-tile program `index` (attention.py). Binary search over
    cu [R + 1]; num_steps >= R.bit_length() (fixed, so vector lanes stay in step)."""
    lo = index * 0
    hi = index * 0 + (num_requests - 1)
    for _ in range(num_steps):
        mid = (lo + hi + 1) // 2
        if TILE == 1:
            first = tl.load(cu_seqlens_ptr + mid)
        else:
            first = tl.load(cu_seqlens_ptr + mid) // TILE + mid
        lo = tl.where(first <= index, mid, lo)
        hi = tl.where(first <= index, hi, mid - 1)
    return lo
