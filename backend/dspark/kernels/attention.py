"""Paged ragged attention: prefill chunks, plain decode, DSpark verify windows and the drafter's block.

One kernel family serves every case. Query windows are packed back to back (cu_seqlens_q); window r
is the last q_len positions of request r's kv_lens[r] keys, which live in pages listed by its
page-table row. A program owns one kv head, one request and a tile of BLOCK_M rows that are
(token, q head) pairs of that kv head's group, so every K/V tile is loaded once for all the q heads
that share it (GQA). Softmax is online in fp32 (exp2 with the scale folded in).

Few query tokens over long contexts leave most multiprocessors idle with one program per (block,
kv head); then the key range is split over NUM_SPLITS programs that write partial results (output
and log-sum-exp), and a second kernel combines them (the last split program to finish combining them
in place of that kernel was slower on an H200: RESULTS.md, session 28).

The q-block grid needs no host sync: request r owns the program ids [cu[r] // BLOCK_Q + r,
cu[r+1] // BLOCK_Q + r + 1), at least cdiv(q_len, BLOCK_Q) of them, so cdiv-free T // BLOCK_Q + R
programs cover every window; a program finds its request by binary search and exits when idle.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from dspark.kernels.common import (
    INTERPRET,
    dependent_launch,
    dot_in_fp32,
    find_window,
    next_pow2,
    num_sms,
    round_cast,
    wait_for_previous,
)

LOG2E = 1.4426950408889634
logger = logging.getLogger(__name__)


def _configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in (
            (16, 64, 4, 2),
            (16, 128, 4, 2),
            (32, 64, 4, 2),
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (128, 32, 4, 2),
        )
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Keep tiles that hold at least one token of the group and suit the window-length class."""
    group = kwargs["GROUP"]
    window_class = kwargs["WINDOW_CLASS"]
    smallest = max(16, next_pow2(group))
    if kwargs["DOT_FP32"]:
        # fp32 data is for parity tests only: one cheap-to-compile tile (an fp32 ieee dot compiles slowly).
        return [triton.Config({"BLOCK_M": smallest, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # Decode rows are one token's group; verify windows and draft blocks hold up to 16 tokens' worth.
    most = {0: smallest, 1: max(64, smallest)}.get(window_class, 128)
    least = 64 if window_class >= 2 else smallest
    keep = [c for c in configs if least <= c.kwargs["BLOCK_M"] <= most and c.kwargs["BLOCK_M"] >= group]
    return keep or [max(configs, key=lambda c: c.kwargs["BLOCK_M"])]


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    table_row_ptr,
    q_pos,
    n_lo,
    n_hi,
    kv_end,
    qk_scale,
    stride_ks,
    stride_vs,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Fold keys [n_lo, n_hi) into the running (acc [M, D], m_i [M], l_i [M]); MASKED applies the
    key-range bound kv_end and, if CAUSAL, key <= q_pos [M]; unmasked ranges are whole BLOCK_N tiles."""
    offs_d = tl.arange(0, BLOCK_D)
    for start in range(n_lo, n_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if MASKED:
            n_ok = offs_n < kv_end
            page = tl.load(table_row_ptr + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            kv_mask = n_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        else:
            # Unmasked blocks are whole and in range by construction (see the caller).
            page = tl.load(table_row_ptr + offs_n // PAGE_SIZE).to(tl.int64)
            kv_mask = (offs_n[:, None] >= 0) & (offs_d[None, :] < HEAD_DIM)
        slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
        k_ptrs = k_ptr + slot[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_ptr + slot[:, None] * stride_vs + offs_d[None, :]
        if MASKED or HEAD_DIM != BLOCK_D:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if MASKED:
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 there instead (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.autotune(
    configs=_configs(),
    key=["GROUP", "HEAD_DIM", "WINDOW_CLASS", "SPLIT"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    page_table_ptr,
    cu_seqlens_ptr,
    kv_lens_ptr,
    num_requests,
    num_tokens,
    num_q_heads,
    num_splits,
    search_steps,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOW_CLASS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T // BLOCK_Q + R, num_kv_heads, num_splits); q/out [T, Hq, D]; k/v cache [slots, Hkv, D]
    (flat slots); page_table [R, max_pages]; part_out [splits, T, Hq, D] and part_lse [splits, T, Hq]
    fp32 when SPLIT."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    qblock = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The windows' layout (cu_seqlens, kv_lens) is written before the layer's rotary + store kernel, the
    # one this kernel follows: read it while that one ends (see paged_attention).
    req = find_window(cu_seqlens_ptr, num_requests, qblock, search_steps, BLOCK_Q)
    q_start = tl.load(cu_seqlens_ptr + req)
    q_len = tl.load(cu_seqlens_ptr + req + 1) - q_start
    local = qblock - (q_start // BLOCK_Q + req)
    kv_len = tl.load(kv_lens_ptr + req)
    wait_for_previous(PDL)  # launched dependent on the kernel before: wait for it before q, k and v
    if local * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = local * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    d_ok = offs_d < HEAD_DIM
    row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = kv_len - q_len + tok

    # Keys this block can see at all, and the prefix every row of it sees (no mask needed there).
    if CAUSAL:
        kv_end = kv_len - q_len + tl.minimum((local + 1) * BLOCK_Q, q_len)
        shared_end = kv_len - q_len + local * BLOCK_Q
    else:
        kv_end = kv_len
        shared_end = kv_len
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        n_lo = split * chunk
        n_hi = tl.minimum(n_lo + chunk, kv_end)
    else:
        n_lo = 0
        n_hi = kv_end
    # n_lo and the aligned shared prefix are BLOCK_N multiples, so [n_lo, full_hi) is whole tiles.
    full_hi = tl.maximum(tl.minimum(n_hi, (shared_end // BLOCK_N) * BLOCK_N), n_lo)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    table_row = page_table_ptr + req.to(tl.int64) * stride_pt
    acc, m_i, l_i = _attend(
        acc,
        m_i,
        l_i,
        q,
        k_base,
        v_base,
        table_row,
        q_pos,
        n_lo,
        full_hi,
        n_hi,
        qk_scale,
        stride_ks,
        stride_vs,
        PAGE_SIZE,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        False,
        CAUSAL,
        DOT_FP32,
    )
    acc, m_i, l_i = _attend(
        acc,
        m_i,
        l_i,
        q,
        k_base,
        v_base,
        table_row,
        q_pos,
        full_hi,
        n_hi,
        n_hi,
        qk_scale,
        stride_ks,
        stride_vs,
        PAGE_SIZE,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        True,
        CAUSAL,
        DOT_FP32,
    )

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part_row = (split * num_tokens + row) * num_q_heads + head
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
    else:
        tl.store(
            out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            round_cast(out, out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    cu_seqlens_ptr,
    num_requests,
    num_tokens,
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, Hq): out[t, h] = sum_s 2^(lse_s - lse_max) o_s / sum_s 2^(lse_s - lse_max).

    part_out [splits, T, Hq, D], part_lse [splits, T, Hq] fp32; rows past cu[R] are left alone."""
    wait_for_previous(PDL)  # launched dependent on the kernel before: wait for it before touching memory
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(cu_seqlens_ptr + num_requests):
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    part_row = (offs_s.to(tl.int64) * num_tokens + t) * num_q_heads + h
    lse = tl.load(part_lse_ptr + part_row, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - lse_max)
    o = tl.load(
        part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
        round_cast(out, out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def _window_class(num_tokens: int, num_requests: int) -> int:
    """0: decode (about one token per window); 1: verify / draft blocks (<= 16); 2: prefill chunks."""
    average = num_tokens / max(num_requests, 1)
    if average <= 1.5:
        return 0
    return 1 if average <= 16 else 2


def choose_num_splits(num_tokens: int, num_requests: int, num_kv_heads: int, device: torch.device) -> int:
    """Key-range splits for short windows that would leave multiprocessors idle (1 = no split)."""
    if _window_class(num_tokens, num_requests) == 2:
        return 1
    programs = num_requests * num_kv_heads
    sms = num_sms(device)
    if programs >= sms:
        return 1
    return min(16, max(2, -(-2 * sms // programs)))


@functools.lru_cache(maxsize=64)
def _is_flat_cache(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Pages then slots must be contiguous so that a flat slot index addresses [pages * page_size]."""
    return stride[-1] == 1 and stride[0] == shape[1] * stride[1]


# A tile within this share of the fastest one's time counts as fast: `tune` keeps the first such tile in
# `_configs()`'s order, not the fastest, so that two starts choose alike (a tile sums keys in its own
# order, and in bf16 another order can flip a near-tie in greedy output: two plain engines tuned apart
# agreed on 73-93% of greedy sequences on an H100, RESULTS.md, session 42).
TILE_TOLERANCE = 0.10


def reproducible_tile(timings: dict, order: list) -> object:
    """The first tile in `order` whose time is within TILE_TOLERANCE of the fastest (`timings`: tile ->
    its time, or a list whose first entry is the median, as Triton's autotuner keeps them)."""

    def median(value: object) -> float:
        return float(value[0]) if isinstance(value, (list, tuple)) else float(value)  # type: ignore[arg-type]

    fastest = min(timings, key=lambda tile: median(timings[tile]))
    bound = median(timings[fastest]) * (1 + TILE_TOLERANCE)
    # The fastest when none of `order` was timed (the autotuner timed copies): never worse than its choice.
    return next((tile for tile in order if tile in timings and median(timings[tile]) <= bound), fastest)


# The windows the autotuner times a kind's tiles on (`tune`), per window class: tokens a window, keys a
# request; a kind that splits its key ranges is timed over 4 requests (1 for a prefill chunk), one
# that does not over enough requests to fill the device.
_TUNING_WINDOWS = {0: (1, 1024), 1: (4, 1024), 2: (512, 512)}
_tuned: set[tuple] = set()


def tune(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    window_class: int,
    split: bool,
) -> None:
    """Let the autotuner choose the tile of one kind of call (window class, split key ranges or not)
    on scratch windows with keys to read (`_TUNING_WINDOWS`), once per kind, head layout, page size and
    dtype in a process.

    The autotuner chooses a kind's tile at its first call and keeps it for the process. In the engine
    that first call is a CUDA graph capture's warm-up over an all-padding layout, whose programs exit
    at once: the choice was the timing noise of empty launches, a different tile in each process. Of
    the tiles timed here, the first in `_configs()`'s order within TILE_TOLERANCE of the fastest is
    kept (`reproducible_tile`), not the fastest: tiles a few percent apart would otherwise flip between
    starts with the timing noise, and with them bf16 greedy output."""
    signature = (num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, window_class, split)
    if signature in _tuned or torch.cuda.is_current_stream_capturing():
        return  # tuned, or inside a capture (whose warm-up, outside it, tunes)
    _tuned.add(signature)
    if dot_in_fp32(dtype):
        return  # one tile (see _prune): nothing to choose
    window, keys = _TUNING_WINDOWS[window_class]
    if split:
        requests = 1 if window_class == 2 else 4
    else:
        requests = 1 if window_class == 2 else max(64, -(-2 * num_sms(device) // num_kv_heads))
    tokens, pages_each = requests * window, -(-keys // page_size)
    num_pages = requests * pages_each
    num_splits = max(2, choose_num_splits(tokens, requests, num_kv_heads, device)) if split else 1
    generator = torch.Generator(device).manual_seed(0)  # the process's random streams stay untouched
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    q = torch.randn(tokens, num_q_heads, head_dim, generator=generator, device=device).to(dtype)
    k = torch.randn(shape, generator=generator, device=device).to(dtype)
    v = torch.randn(shape, generator=generator, device=device).to(dtype)
    page_table = torch.arange(num_pages, dtype=torch.int32, device=device).view(requests, pages_each)
    cu_seqlens = torch.arange(0, tokens + 1, window, dtype=torch.int32, device=device)
    kv_lens = torch.full((requests,), keys, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    known = set(_paged_attention_kernel.cache)
    paged_attention(q, k, v, page_table, cu_seqlens, kv_lens, scale, True, num_splits, tuning=True)
    del q, k, v
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the scratch windows' memory back to the device (the KV cache budget)
    group = num_q_heads // num_kv_heads
    kind = (group, head_dim, window_class, split)  # the autotuner's key starts with these (then dtypes)
    cache = _paged_attention_kernel.cache
    timed = [key for key in cache if key not in known and key[:4] == kind]  # the key this call timed
    timings = getattr(_paged_attention_kernel, "configs_timings", None)  # its tiles' times
    if len(timed) == 1 and timings:
        cache[timed[0]] = reproducible_tile(timings, _paged_attention_kernel.configs)
    chosen = (
        cache[timed[0]] if len(timed) == 1 else next((c for k, c in cache.items() if k[:4] == kind), None)
    )
    logger.info(
        "paged attention tile for group %d, head_dim %d, window class %d, split %s: %s",
        group,
        head_dim,
        window_class,
        split,
        chosen,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tuning: bool = False,
) -> torch.Tensor:
    """Attention of packed ragged query windows over paged keys (the reference's paged_attention).

    q: [num_tokens, num_q_heads, head_dim]; k_cache, v_cache: [num_pages, page_size, num_kv_heads,
    head_dim]; page_table: [R, max_pages] int32; cu_seqlens_q: [R + 1] int32; kv_lens: [R] int32 (each
    >= its window). Returns [num_tokens, num_q_heads, head_dim] in q's dtype; rows past cu_seqlens_q[R]
    are not written. num_splits: key-range splits (None: chosen from the shapes, no host sync); out:
    optional preallocated result. Launched dependent (common.dependent_launch), the kernel reads
    cu_seqlens_q and kv_lens before it waits for the kernel before it: they must not be written by that
    kernel (in the model the one before is the layer's rotary + store). On a GPU, outside a graph
    capture, the first call of a kind (head layout, window class, split or not) first has the kernel's
    tile for it chosen on scratch windows (`tune`; `tuning`: this call is one of its own).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    num_requests = kv_lens.shape[0]
    group = num_q_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    for cache in (k_cache, v_cache):
        if not _is_flat_cache(tuple(cache.shape), tuple(cache.stride())):
            raise ValueError("paged_attention: k/v caches must be contiguous in (page, slot, ..., dim)")
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    window_class = _window_class(num_tokens, num_requests)
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens, num_requests, num_kv_heads, q.device)
    split = num_splits > 1
    if not (tuning or INTERPRET) and q.is_cuda:
        tune(num_q_heads, num_kv_heads, head_dim, page_size, q.dtype, q.device, window_class, split)
    if split:
        part_out = torch.empty(
            num_splits, num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_splits, num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out

    def grid(meta: dict) -> tuple[int, int, int]:
        block_q = meta["BLOCK_M"] // group
        return (num_tokens // block_q + num_requests, num_kv_heads, num_splits)

    pdl = dependent_launch(q.device)  # see common.DEPENDENT_LAUNCH
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        page_table,
        cu_seqlens_q,
        kv_lens,
        num_requests,
        num_tokens,
        num_q_heads,
        num_splits,
        num_requests.bit_length(),
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),  # tl.dot needs K >= 16
        CAUSAL=causal,
        SPLIT=split,
        WINDOW_CLASS=window_class,
        DOT_FP32=dot_in_fp32(q.dtype),
        PDL=pdl,
        launch_pdl=pdl > 0,
    )
    if split:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_lse,
            cu_seqlens_q,
            num_requests,
            num_tokens,
            num_q_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, next_pow2(head_dim)),  # tl.dot needs K >= 16
            BLOCK_S=next_pow2(num_splits),
            PDL=pdl,
            launch_pdl=pdl > 0,
        )
    return out
