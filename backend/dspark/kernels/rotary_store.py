"""Rotary embedding fused with the paged KV store (and the optional per-head q/k RMSNorm before it).

One kernel covers four ops: `rotary` (q and k rotated into new tensors), `store_kv` (k and v written at
their slots), `rotary_store_kv` (the attention prologue: q/k norm, rotate q out, rotate k and store it
with v) and `inject_kv` (the drafter's KV injection: k-norm, rotate and store k, store v, no q).
A program handles one token, all of its heads. Rounding follows the reference step by step (norm ->
dtype, times weight -> dtype, rotation -> dtype, store -> cache dtype), so results match it to the bit
up to fp32 operation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import dependent_launch, next_pow2, round_cast, wait_for_previous


@triton.jit
def _head_norm(x1, x2, w_ptr, eps, offs_c, c_ok, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IN_PTR, OUT_PTR):
    """Per-row RMSNorm of heads given as halves x1, x2 [H, D/2] (fp32), rounded as the reference does:
    the normalized value to the input's dtype, its product with the weight [D] to the output's."""
    inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)
    w1 = tl.load(w_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    n1 = round_cast(x1 * inv[:, None], IN_PTR.dtype.element_ty).to(tl.float32) * w1[None, :]
    n2 = round_cast(x2 * inv[:, None], IN_PTR.dtype.element_ty).to(tl.float32) * w2[None, :]
    n1 = round_cast(n1, OUT_PTR.dtype.element_ty).to(tl.float32)
    n2 = round_cast(n2, OUT_PTR.dtype.element_ty).to(tl.float32)
    return n1, n2


@triton.jit
def _rotate(x1, x2, cos, sin):
    """Rotate-half: (x1 cos - x2 sin, x2 cos + x1 sin) for halves x1, x2 [H, D/2] (fp32)."""
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _token_layout(
    t,
    positions_ptr,
    cos_sin_ptr,
    slots_ptr,
    stride_cs,
    offs_c,
    c_ok,
    HALF: tl.constexpr,
    ROTATE: tl.constexpr,
    STORE: tl.constexpr,
):
    """Token t's cos and sin halves [BLOCK_HALF] fp32 (ROTATE; else zeros) and cache slot (STORE; else -1)."""
    cos = offs_c * 0.0
    sin = offs_c * 0.0
    slot = t * 0 - 1
    if ROTATE:
        pos = tl.load(positions_ptr + t).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_c, mask=c_ok, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    if STORE:
        slot = tl.load(slots_ptr + t).to(tl.int64)
    return cos, sin, slot


@triton.jit
def _rotary_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    positions_ptr,
    cos_sin_ptr,
    slots_ptr,
    eps,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_cs,
    HAS_Q: tl.constexpr,
    ROTATE: tl.constexpr,
    Q_NORM: tl.constexpr,
    K_NORM: tl.constexpr,
    K_OUT: tl.constexpr,
    STORE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    EARLY_LAYOUT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (num_tokens,). q [T, Hq, D], k/v [T, Hkv, D] (token and head strides given); outputs q_out
    [T, Hq, D], k_out [T, Hkv, D]; caches [slots, Hkv, D] at flat slots [T] (negative: skipped);
    positions [T]; cos_sin [max_pos, D] (cos halves then sin halves); q/k norm weights [D].
    EARLY_LAYOUT: positions and slots are not written by the kernel before: read them (and the token's
    cos and sin) before the wait for it."""
    t = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_ok = offs_c < HALF
    if EARLY_LAYOUT:
        cos, sin, slot = _token_layout(
            t, positions_ptr, cos_sin_ptr, slots_ptr, stride_cs, offs_c, c_ok, HALF, ROTATE, STORE
        )
    wait_for_previous(PDL)  # launched dependent on the kernel before: wait for it before touching memory
    if not EARLY_LAYOUT:
        cos, sin, slot = _token_layout(
            t, positions_ptr, cos_sin_ptr, slots_ptr, stride_cs, offs_c, c_ok, HALF, ROTATE, STORE
        )
    offs_h = tl.arange(0, BLOCK_HQ)
    offs_kh = tl.arange(0, BLOCK_HKV)

    if HAS_Q:
        q_mask = (offs_h[:, None] < num_q_heads) & c_ok[None, :]
        q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
        q1 = tl.load(q_row + offs_c[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + HALF + offs_c[None, :], mask=q_mask, other=0.0).to(tl.float32)
        if Q_NORM:
            q1, q2 = _head_norm(q1, q2, q_norm_ptr, eps, offs_c, c_ok, HEAD_DIM, HALF, q_ptr, q_out_ptr)
        if ROTATE:
            q1, q2 = _rotate(q1, q2, cos, sin)
        q_out_row = q_out_ptr + t * stride_qot + offs_h[:, None] * stride_qoh
        tl.store(q_out_row + offs_c[None, :], round_cast(q1, q_out_ptr.dtype.element_ty), mask=q_mask)
        tl.store(q_out_row + HALF + offs_c[None, :], round_cast(q2, q_out_ptr.dtype.element_ty), mask=q_mask)

    kv_mask = (offs_kh[:, None] < num_kv_heads) & c_ok[None, :]
    k_row = k_ptr + t * stride_kt + offs_kh[:, None] * stride_kh
    k1 = tl.load(k_row + offs_c[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_row + HALF + offs_c[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    if K_NORM:
        k1, k2 = _head_norm(k1, k2, k_norm_ptr, eps, offs_c, c_ok, HEAD_DIM, HALF, k_ptr, k_out_ptr)
    if ROTATE:
        k1, k2 = _rotate(k1, k2, cos, sin)
        # The reference rounds the rotated key to its own dtype before the cache cast.
        k1 = round_cast(k1, k_out_ptr.dtype.element_ty).to(tl.float32)
        k2 = round_cast(k2, k_out_ptr.dtype.element_ty).to(tl.float32)
    if K_OUT:
        k_out_row = k_out_ptr + t * stride_kot + offs_kh[:, None] * stride_koh
        tl.store(k_out_row + offs_c[None, :], round_cast(k1, k_out_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_out_row + HALF + offs_c[None, :], round_cast(k2, k_out_ptr.dtype.element_ty), mask=kv_mask)
    if STORE:
        store_mask = kv_mask & ((offs_kh[:, None] * 0 + slot) >= 0)
        kc_row = k_cache_ptr + slot * stride_kcs + offs_kh[:, None] * stride_kch
        tl.store(kc_row + offs_c[None, :], round_cast(k1, k_cache_ptr.dtype.element_ty), mask=store_mask)
        tl.store(
            kc_row + HALF + offs_c[None, :], round_cast(k2, k_cache_ptr.dtype.element_ty), mask=store_mask
        )
        v_row = v_ptr + t * stride_vt + offs_kh[:, None] * stride_vh
        vc_row = v_cache_ptr + slot * stride_vcs + offs_kh[:, None] * stride_vch
        v1 = tl.load(v_row + offs_c[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_row + HALF + offs_c[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        tl.store(vc_row + offs_c[None, :], round_cast(v1, v_cache_ptr.dtype.element_ty), mask=store_mask)
        tl.store(
            vc_row + HALF + offs_c[None, :], round_cast(v2, v_cache_ptr.dtype.element_ty), mask=store_mask
        )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _flat_cache(cache: torch.Tensor) -> torch.Tensor:
    """[num_pages, page_size, H, D] -> [slots, H, D] (a view; pages then slots must be contiguous)."""
    if cache.stride(0) != cache.shape[1] * cache.stride(1) or cache.stride(-1) != 1:
        raise ValueError("kv cache: pages then slots must be contiguous, head_dim unit-stride")
    return cache.view(-1, *cache.shape[2:])


def _launch(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_out: torch.Tensor | None,
    k_out: torch.Tensor | None,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    positions: torch.Tensor | None,
    cos_sin: torch.Tensor | None,
    slots: torch.Tensor | None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    early_layout: bool = False,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if head_dim % 2:
        raise ValueError("rotary: head_dim must be even")
    num_q_heads = q.shape[1] if q is not None else 1
    k_flat = _flat_cache(k_cache) if k_cache is not None else k
    v_flat = _flat_cache(v_cache) if v_cache is not None else k
    dummy = k  # stands in for absent tensors; constexpr flags keep the kernel from touching it
    q_ = q if q is not None else dummy
    qo = q_out if q_out is not None else dummy
    # Norm results are rounded to the dtype of what follows them: q_out / k_out (or the cache when no
    # k_out exists, which is then also the rotation's dtype).
    ko = k_out if k_out is not None else (k_cache if k_cache is not None else dummy)
    v_ = v if v is not None else dummy
    half = head_dim // 2
    block_half = next_pow2(half)
    block_hq = next_pow2(num_q_heads)
    block_hkv = next_pow2(num_kv_heads)
    elements = (block_hq + 2 * block_hkv) * 2 * block_half
    pdl = dependent_launch(k.device)  # see common.DEPENDENT_LAUNCH
    _rotary_store_kernel[(num_tokens,)](
        q_,
        k,
        v_,
        qo,
        ko,
        k_flat,
        v_flat,
        q_norm if q_norm is not None else dummy,
        k_norm if k_norm is not None else dummy,
        positions if positions is not None else dummy,
        cos_sin if cos_sin is not None else dummy,
        slots if slots is not None else dummy,
        eps,
        num_q_heads,
        num_kv_heads,
        q_.stride(0),
        q_.stride(1),
        k.stride(0),
        k.stride(1),
        v_.stride(0),
        v_.stride(1),
        qo.stride(0),
        qo.stride(1),
        ko.stride(0),
        ko.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        v_flat.stride(0),
        v_flat.stride(1),
        cos_sin.stride(0) if cos_sin is not None else 0,
        HAS_Q=q is not None,
        ROTATE=positions is not None,
        Q_NORM=q_norm is not None,
        K_NORM=k_norm is not None,
        K_OUT=k_out is not None,
        STORE=k_cache is not None,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv,
        EARLY_LAYOUT=early_layout,
        PDL=pdl,
        num_warps=4 if elements <= 8192 else 8,
        launch_pdl=pdl > 0,
    )


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding into new tensors (the reference's rotary).

    q: [num_tokens, num_q_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]; positions:
    [num_tokens] int; cos_sin: [max_positions, head_dim]. Returns (q_rot, k_rot), contiguous.
    """
    q, k = _unit_last(q), _unit_last(k)
    q_out, k_out = (
        out
        if out is not None
        else (
            torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
        )
    )
    _launch(q, k, None, q_out, k_out, None, None, positions, cos_sin, None)
    return q_out, k_out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write keys/values [num_tokens, num_kv_heads, head_dim] into paged caches [num_pages, page_size,
    num_kv_heads, head_dim] at flat slots [num_tokens] (page * page_size + offset; negative: skipped)."""
    _launch(None, _unit_last(k), _unit_last(v), None, None, k_cache, v_cache, None, None, slots)


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention prologue in one pass (the reference's rotary_store_kv): optional per-head RMSNorm
    of q and k (Qwen3), rotary on both, k and v stored into the paged caches at slots.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; positions, slots: [T]. Returns the rotated q [T, Hq, D].
    Launched dependent (common.dependent_launch), the kernel reads positions and slots before it waits
    for the kernel before it: they must not be written by that kernel (in the model the one before is
    the layer's qkv projection).
    """
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q_norm_weight is not None:
        out_dtype = torch.promote_types(q.dtype, q_norm_weight.dtype)
        if out.dtype != out_dtype:
            raise ValueError(f"rotary_store_kv: q_out must be {out_dtype} after the q norm")
    # Without a k_out the norm/rotation round to the cache dtype: valid when it is k's own dtype
    # (after the norm's promotion), which the engine's caches are.
    k_dtype = k.dtype if k_norm_weight is None else torch.promote_types(k.dtype, k_norm_weight.dtype)
    if k_dtype != k_cache.dtype:
        raise ValueError(f"rotary_store_kv: k_cache dtype {k_cache.dtype} must equal k's {k_dtype}")
    _launch(
        q,
        k,
        v,
        out,
        None,
        k_cache,
        v_cache,
        positions,
        cos_sin,
        slots,
        q_norm_weight,
        k_norm_weight,
        eps,
        early_layout=True,
    )
    return out


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
    """The drafter's KV injection store (the reference's inject_kv): k-norm, rotary and store of k,
    store of v, at slots (negative: skipped). k, v: [T, Hkv, D]; positions, slots: [T]."""
    k, v = _unit_last(k), _unit_last(v)
    k_dtype = k.dtype if k_norm_weight is None else torch.promote_types(k.dtype, k_norm_weight.dtype)
    if k_dtype != k_cache.dtype:
        raise ValueError(f"inject_kv: k_cache dtype {k_cache.dtype} must equal k's {k_dtype}")
    _launch(None, k, v, None, None, k_cache, v_cache, positions, cos_sin, slots, None, k_norm_weight, eps)
