"""Torch reference twins of every hot-path kernel: the CPU path and the parity oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm with optional fused residual add.

    x, residual: [num_tokens, hidden]; weight: [hidden]. With a residual, returns
    (norm(x + residual) * weight, x + residual); without, (norm(x) * weight, None).
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype) * weight), residual


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding (the Hugging Face Llama convention).

    q: [num_tokens, num_q_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim];
    positions: [num_tokens] int; cos_sin: [max_positions, head_dim] (cos halves, then sin halves).
    """
    half = q.shape[-1] // 2
    cs = cos_sin[positions]
    cos = cs[:, None, :half].float()
    sin = cs[:, None, half:].float()

    def apply(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return apply(q), apply(k)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write new keys/values into paged caches.

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_pages, page_size, num_kv_heads,
    head_dim]; slots: [num_tokens] int64 flat slot = page * page_size + offset.
    """
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Attention of packed ragged query windows over each request's paged keys.

    q: [num_tokens, num_q_heads, head_dim], windows packed back to back by cu_seqlens_q [R + 1];
    request r's keys are its first kv_lens[r] cache positions, found through page_table [R, max_pages].
    The window is the last q_len positions of those keys; causal: query i sees keys up to its own
    position; otherwise every query sees all kv_lens[r] keys. Returns [num_tokens, num_q_heads, head_dim].

    All requests go through one padded batched attention (no per-request loop): requests are padded
    to the longest window and the longest key range, and masks hide the padding.
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    num_requests = q_lens.shape[0]
    max_q = int(q_lens.max()) if num_requests else 0
    max_kv = int(kv_lens.max()) if num_requests else 0
    if num_tokens == 0 or max_kv == 0:
        return torch.zeros_like(q)
    max_pages = -(-max_kv // page_size)
    # Which request and which window slot each packed token is.
    request_of = torch.repeat_interleave(torch.arange(num_requests, device=device), q_lens)
    slot_of = torch.arange(num_tokens, device=device) - cu_seqlens_q[:-1].long()[request_of]
    q_pad = q.new_zeros(num_requests, max_q, num_heads, head_dim)
    q_pad[request_of, slot_of] = q
    pages = page_table[:, :max_pages].long()
    k = k_cache[pages].flatten(1, 2)[:, :max_kv]  # [R, max_kv, num_kv_heads, head_dim]
    v = v_cache[pages].flatten(1, 2)[:, :max_kv]
    key_pos = torch.arange(max_kv, device=device)
    q_pos = (kv_lens.long() - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    mask = key_pos[None, None, :] < kv_lens.long()[:, None, None]
    if causal:
        mask = mask & (key_pos[None, None, :] <= q_pos[:, :, None])
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2).float(),
        k.transpose(1, 2).float().repeat_interleave(group, dim=1),
        v.transpose(1, 2).float().repeat_interleave(group, dim=1),
        attn_mask=mask[:, None],
        scale=scale,
    )
    return out.transpose(1, 2)[request_of, slot_of].to(q.dtype)


def greedy_accept(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    cu_windows: torch.Tensor,
    verify_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance over ragged verify windows.

    draft_tokens: [R, gamma]; target_tokens: [num_window_tokens] the target's argmax at each window
    position, windows packed by cu_windows [R + 1] (window r has 1 + verify_lens[r] positions).
    Returns (num_accepted [R], bonus [R]): drafts accepted while they equal the target's choice, and the
    target's token after the last accepted draft.
    """
    num_requests = draft_tokens.shape[0]
    accepted = torch.zeros(num_requests, dtype=torch.long, device=draft_tokens.device)
    bonus = torch.empty(num_requests, dtype=torch.long, device=draft_tokens.device)
    starts = cu_windows.tolist()
    for r, length in enumerate(verify_lens.tolist()):
        window = target_tokens[starts[r] : starts[r] + 1 + length]
        matches = (draft_tokens[r, :length] == window[:length]).long()
        n = int(matches.cumprod(0).sum()) if length else 0
        accepted[r] = n
        bonus[r] = window[n]
    return accepted, bonus


def exponential_race_sample(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """Sample one token per row as argmax(p / E), E ~ Exp(1) (the Gumbel-max trick in exponential form).

    probs, exponentials: [num_rows, vocab]. Returns [num_rows] int64.
    """
    return (probs / exponentials).argmax(dim=-1)
