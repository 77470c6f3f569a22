"""The ops the engine calls. Each name is the one seam where a Triton kernel takes over from its torch
reference: per call, on the data's device, a CUDA tensor goes to the kernel and anything else to the
reference (reference.py documents each op's contract; the kernel modules match it), but for `rms_norm`
and `rotary_store_kv`, whose fp32 CPU calls take the CPU extension's C++ where it is built
(`kernels/cpu/`; the products' CPU paths are `layers.linear`'s). Callers never choose, and nothing is
frozen at construction.

The kernels are inference-only (no backward): a call that autograd must differentiate through (grad
mode on and an input that requires grad, as in drafter training) takes the reference on any device, so
training on a GPU trains every weight instead of silently cutting the graph at the first kernel.

The kernel modules are imported on the first CUDA call only (kernels/runtime.py), so a CPU-only
install never needs Triton.
"""

from __future__ import annotations

import torch

from dspark.kernels import reference
from dspark.kernels.cpu import linear as cpu_kernels
from dspark.kernels.runtime import load_kernels


def _on_gpu(t: torch.Tensor, *differentiable: torch.Tensor | None) -> bool:
    """Whether this call runs the kernel: `t` is on CUDA and autograd needs no gradient through
    `t` or `differentiable`."""
    if not t.is_cuda:
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(x is not None and x.requires_grad for x in (t, *differentiable))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See reference.rms_norm; on a CPU the C++ one where it runs (`_on_cpu_kernel`)."""
    if _on_gpu(x, weight, residual):
        return load_kernels().norm.rms_norm(x, weight, eps, residual)
    if _on_cpu_kernel(x, weight, residual):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        rest = None if residual is None else residual.reshape(flat.shape).contiguous()
        normed, summed = cpu_kernels.rms_norm_rows(flat, weight.contiguous(), eps, rest)
        return normed.view(x.shape), None if summed is None else summed.view(x.shape)
    return reference.rms_norm(x, weight, eps, residual)


def _on_cpu_kernel(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether a CPU norm runs in C++ (`kernels/cpu/norm.cpp`, one call for torch's six, each row normed
    alone): `_cpu_extension_takes` them, a residual of x's shape."""
    if residual is not None and residual.shape != x.shape:
        return False
    return _cpu_extension_takes(x, weight, *(() if residual is None else (residual,)))


def _cpu_extension_takes(first: torch.Tensor, *rest: torch.Tensor) -> bool:
    """Whether the CPU extension may take these operands: fp32 CPU tensors, the first not empty, no
    gradient wanted through any, the extension built here."""
    tensors = (first, *rest)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return first.numel() > 0 and cpu_kernels.available()


# Rows up to which a GPU projection takes the skinny-product kernel (kernels/gemv.py), and the widest
# weight it takes: measured faster than cuBLAS at 1-8 rows for every projection of the Qwen3-8B and
# SmolLM2 shapes on an H200 (bf16; 24576 outputs: the 8B gate_up, at parity). 9-16 rows run the very
# program 1-8 rows run (x padded to one 16-row tile for the tensor cores: the same loads of W, the same
# products), so they cost what 8 rows cost, while cuBLAS at 16 rows costs what it costs at 8 (the 8B step
# at 8 requests, session 28: 5.81 ms at 2 rows a request against 5.90 at 1). On an H100 (session 56,
# SmolLM2, the shipped drafter, side by side with FEW_ROWS 8) plain decoding at 16 requests ran 1.28x.
# 17-32 rows run the 32-row tiles: the Qwen3-8B step at 32 rows (H100, session 57, random weights,
# 1024 cached tokens a request) took 6.78 ms against cuBLAS's 7.14 at 8 requests x windows of 4, 7.18
# against 7.49 at 16 x 2; at 64 rows the kernel lost (8.41 against 7.77), so a large weight stops at 32.
# The LM heads (49152 and 151936 outputs) stay with cuBLAS, which reads them at the copy bandwidth
# already.
FEW_ROWS = 32
FEW_ROWS_MAX_OUTPUTS = 24576
# A small weight takes the kernel up to SMALL_WEIGHT_ROWS rows (its 32- and 64-row tiles): there cuBLAS
# pays its fixed cost on a product that reads little. On an H100 (session 56, SmolLM2: every target
# projection at most 1.8M elements, side by side against FEW_ROWS for all) plain decoding at 64 requests
# ran 1.19x, `static` at 8 and 16 requests 1.20x and 1.17x (verify windows of 32 and 64 rows), greedy
# output identical. A Qwen3-8B projection (4.2M-50M elements) keeps cuBLAS past FEW_ROWS (measured).
SMALL_WEIGHT_ROWS = 64
SMALL_WEIGHT_MAX_ELEMENTS = 1 << 21


def takes_few_rows(rows: int, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny-product kernel takes `rows` rows of x times weight: half-precision CUDA
    tensors of one dtype, at most FEW_ROWS rows (SMALL_WEIGHT_ROWS for a weight of at most
    SMALL_WEIGHT_MAX_ELEMENTS) and FEW_ROWS_MAX_OUTPUTS weight rows, no gradient wanted (fp32 stays with
    cuBLAS: the kernel was not measured there)."""
    if rows > FEW_ROWS and (rows > SMALL_WEIGHT_ROWS or weight.numel() > SMALL_WEIGHT_MAX_ELEMENTS):
        return False
    return (
        _on_gpu(x, weight)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.shape[0] <= FEW_ROWS_MAX_OUTPUTS
    )


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See reference.few_rows_linear; the kernel where `takes_few_rows`, F.linear otherwise."""
    if takes_few_rows(_rows(x), x, weight):
        return load_kernels().gemv.gemv(x, weight)
    return reference.few_rows_linear(x, weight)


# Whether SwiGLU's activation runs in the gate/up product's epilogue where the skinny-product kernel
# takes the product (one kernel instead of two); off only for a benchmark's side-by-side.
SILU_IN_GATE_UP = True


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See reference.silu_mul_linear; one kernel where `takes_few_rows` (and SILU_IN_GATE_UP), the
    product then the activation otherwise."""
    if SILU_IN_GATE_UP and takes_few_rows(_rows(x), x, weight):
        return load_kernels().gemv.silu_mul_gemv(x, weight)
    return silu_mul(few_rows_linear(x, weight))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See reference.silu_mul."""
    if _on_gpu(gate_up):
        return load_kernels().activation.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.rotary."""
    if _on_gpu(q, k):
        return load_kernels().rotary_store.rotary(q, k, positions, cos_sin)
    return reference.rotary(q, k, positions, cos_sin)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """See reference.store_kv."""
    if _on_gpu(k):
        load_kernels().rotary_store.store_kv(k, v, k_cache, v_cache, slots)
    else:
        reference.store_kv(k, v, k_cache, v_cache, slots)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rotation: reference.HostRotation | None = None,
) -> torch.Tensor:
    """See reference.rotary_store_kv. rotation: the step's rotary multipliers made once on the host
    (`reference.host_rotation`), which a CPU reads (a GPU computes its own); with them, fp32 CPU tensors
    take the C++ one (`kernels/cpu/rotary.cpp`, one call for ~12 torch ops; q/k norms, where the model
    has them, first in torch)."""
    if _on_gpu(q):
        return load_kernels().rotary_store.rotary_store_kv(
            q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm_weight, k_norm_weight, eps
        )
    cpu_prologue = rotation is not None and _rotary_on_cpu_kernel(
        q, k, v, k_cache, v_cache, positions, cos_sin, rotation
    )
    if cpu_prologue:
        q, k = reference.head_norm(q, q_norm_weight, eps), reference.head_norm(k, k_norm_weight, eps)
        return cpu_kernels.rotary_store_rows(q, k, v, rotation.cos, rotation.sin, k_cache, v_cache, slots)
    return reference.rotary_store_kv(
        q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm_weight, k_norm_weight, eps, rotation
    )


def _rotary_on_cpu_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotation: reference.HostRotation,
) -> bool:
    """Whether a CPU attention prologue runs in C++: `_cpu_extension_takes` its operands, head values
    contiguous, caches contiguous, multipliers made from these positions and table."""
    if rotation.positions is not positions or rotation.table is not cos_sin:
        return False  # made for another step's positions: `reference.rotary` makes its own
    if any(t.stride(-1) != 1 for t in (q, k, v)) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    return _cpu_extension_takes(q, k, v, k_cache, v_cache)


def inject_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """See reference.inject_kv."""
    impl = load_kernels().rotary_store if _on_gpu(k) else reference
    impl.inject_kv(k, v, k_norm_weight, eps, positions, cos_sin, k_cache, v_cache, slots)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool,
    host_windows: reference.HostWindows | None = None,
) -> torch.Tensor:
    """See reference.paged_attention. host_windows: the same layout worked out on the host once a step
    (`reference.host_windows`), which a CPU reads instead (a GPU reads the tensors)."""
    if _on_gpu(q):
        return load_kernels().attention.paged_attention(
            q, k_cache, v_cache, page_table, cu_seqlens_q, kv_lens, scale, causal
        )
    if host_windows is not None:
        return reference.host_windows_attention(q, k_cache, v_cache, host_windows, scale)
    return reference.paged_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, kv_lens, scale, causal)


def greedy_accept(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    cu_windows: torch.Tensor,
    verify_lens: torch.Tensor,
    commit_caps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.greedy_accept."""
    impl = load_kernels().accept if _on_gpu(target_tokens) else reference
    return impl.greedy_accept(draft_tokens, target_tokens, cu_windows, verify_lens, commit_caps)


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    cu_windows: torch.Tensor,
    verify_lens: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.rejection_accept."""
    impl = load_kernels().accept if _on_gpu(target_probs) else reference
    return impl.rejection_accept(
        draft_tokens, draft_probs, target_probs, cu_windows, verify_lens, uniforms, exponentials
    )


def exponential_race_sample(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """See reference.exponential_race_sample."""
    if _on_gpu(probs):
        return load_kernels().sampling.exponential_race_sample(probs, exponentials)
    return reference.exponential_race_sample(probs, exponentials)


def markov_decode(
    base_logits: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor | None, w2: torch.Tensor | None
) -> torch.Tensor:
    """See reference.markov_decode; without a Markov head (w1, w2 None) each draft is the argmax of
    its base logits."""
    if w1 is None or w2 is None:
        return base_logits.float().argmax(dim=-1)
    impl = load_kernels().markov if _on_gpu(base_logits) else reference
    return impl.markov_decode(base_logits, anchors, w1, w2)


def plan_verify_lens(
    survivals: torch.Tensor,
    max_lens: torch.Tensor,
    sps_tokens: torch.Tensor,
    sps_values: torch.Tensor,
    budget: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.plan_verify_lens."""
    impl = load_kernels().planner if _on_gpu(survivals) else reference
    return impl.plan_verify_lens(survivals, max_lens, sps_tokens, sps_values, budget)


def build_window_layout(
    window_starts: torch.Tensor,
    window_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    num_tokens: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.build_window_layout; `out` (positions, slots, cu_seqlens, kv_lens): written in
    place and returned (what a captured step needs: static outputs)."""
    if _on_gpu(window_lens):
        layout = load_kernels().layout
        return layout.build_window_layout(window_starts, window_lens, page_table, page_size, num_tokens, out)
    result = reference.build_window_layout(window_starts, window_lens, page_table, page_size, num_tokens)
    if out is None:
        return result
    for target, value in zip(out, result, strict=True):
        target.copy_(value)
    return out


def pack_verify_tokens(
    anchors: torch.Tensor,
    drafts: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor | None = None,
    keep_past_end: bool = False,
) -> torch.Tensor:
    """See reference.pack_verify_tokens; `out` [num_tokens]: written in place and returned (with
    keep_past_end, its rows past the windows keep what they hold)."""
    if _on_gpu(anchors):
        return load_kernels().layout.pack_verify_tokens(
            anchors, drafts, cu_seqlens, num_tokens, out, keep_past_end
        )
    assert out is not None or not keep_past_end, "keep_past_end writes into `out`"
    if out is not None and not keep_past_end:
        out.zero_()  # padding rows are 0, as the reference's own tensor has them
    return reference.pack_verify_tokens(anchors, drafts, cu_seqlens, num_tokens, out)


__all__ = [
    "build_window_layout",
    "exponential_race_sample",
    "greedy_accept",
    "inject_kv",
    "markov_decode",
    "pack_verify_tokens",
    "paged_attention",
    "plan_verify_lens",
    "rejection_accept",
    "rms_norm",
    "rotary",
    "rotary_store_kv",
    "store_kv",
]
