"""Torch reference twins of every hot-path kernel: the CPU path and the parity oracle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same arithmetic as below in one fused op (the CPU serving path is fp32).
        return F.rms_norm(x, (x.shape[-1],), weight, eps), residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype) * weight), residual


def head_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of x [T, H, D] by weight [D] (None: x as it is)."""
    if weight is None:
        return x
    return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)[0].view(x.shape)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ weight [n, k]^T -> [..., n] for a few rows of x (a decode step's projection):
    accumulated in fp32, rounded once to x's dtype (F.linear without a bias)."""
    return F.linear(x, weight)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gate/up projection, then SwiGLU's activation: silu_mul(x @ weight^T) for weight [2n, k]
    (gate rows then up rows) -> [..., n]."""
    return silu_mul(few_rows_linear(x, weight))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: gate_up [..., 2 * width] (gate then up) -> silu(gate) * up [..., width]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class HostRotation:
    """A CPU step's rotary multipliers for every token, made once for all its layers (`host_rotation`)
    where `rotary` would gather and build them again in each (~4% of a CPU decode step of SmolLM2)."""

    positions: torch.Tensor  # the step's positions and the table they came from: a layer called with
    table: torch.Tensor  # other ones (same values or not) builds its own
    cos: torch.Tensor  # [num_tokens, 1, head_dim] fp32: [cos, cos]
    sin: torch.Tensor  # [num_tokens, 1, head_dim] fp32: [-sin, sin]


def host_rotation(positions: torch.Tensor, cos_sin: torch.Tensor) -> HostRotation:
    """The rotary multipliers of these positions from this cos/sin table (see `rotary`)."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return HostRotation(positions, cos_sin, torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    rotation: HostRotation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding (the Hugging Face Llama convention).

    q: [num_tokens, num_q_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim];
    positions: [num_tokens] int; cos_sin: [max_positions, head_dim] (cos halves, then sin halves);
    rotation: these positions' multipliers from this table, made once a step (`host_rotation`; one made
    from other tensors is not used).
    """
    half = q.shape[-1] // 2
    if rotation is None or rotation.positions is not positions or rotation.table is not cos_sin:
        rotation = host_rotation(positions, cos_sin)
    # q and k heads rotate together: half the ops of rotating each (this is the CPU serving path).
    num_q_heads = q.shape[1]
    x = torch.cat((q, k.to(q.dtype)), dim=1).float()
    # [x1, x2] * [cos, cos] + [x2, x1] * [-sin, sin]: the same roundings as x1 cos - x2 sin and
    # x2 cos + x1 sin (negating a product is exact), in fewer ops.
    out = x * rotation.cos + x.roll(half, dims=-1) * rotation.sin
    return out[:, :num_q_heads].to(q.dtype), out[:, num_q_heads:].to(k.dtype)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write new keys/values into paged caches.

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_pages, page_size, num_kv_heads,
    head_dim]; slots: [num_tokens] int64 flat slot = page * page_size + offset; negative slots (padding
    rows) are skipped.
    """
    keep = slots >= 0
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    if bool(keep.all()):  # no padding rows (the CPU pads no step): one copy each, no row selection
        k_flat.index_copy_(0, slots, k.to(k_cache.dtype))
        v_flat.index_copy_(0, slots, v.to(v_cache.dtype))
        return
    k_flat[slots[keep]] = k[keep].to(k_cache.dtype)
    v_flat[slots[keep]] = v[keep].to(v_cache.dtype)


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
    rotation: HostRotation | None = None,
) -> torch.Tensor:
    """The attention prologue: optional per-head RMSNorm of q and k (Qwen3), rotary on both, then k
    and v stored at slots. q: [T, Hq, D]; k, v: [T, Hkv, D]; positions, slots: [T]. Returns rotated q.
    rotation: see `rotary`.
    """
    q, k = head_norm(q, q_norm_weight, eps), head_norm(k, k_norm_weight, eps)
    q, k = rotary(q, k, positions, cos_sin, rotation)
    store_kv(k, v, k_cache, v_cache, slots)
    return q


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
    """The drafter's KV injection store: k-norm, rotary and store of the context keys, store of the
    values. k, v: [T, Hkv, D]; positions, slots: [T] (negative slots skipped)."""
    k = head_norm(k, k_norm_weight, eps)
    k, _ = rotary(k, k, positions, cos_sin)
    store_kv(k, v, k_cache, v_cache, slots)


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
    position; otherwise every query sees all kv_lens[r] keys. Returns [num_tokens, num_q_heads, head_dim]
    (rows past cu_seqlens_q[R], padding, are zeros; the kernel leaves them unwritten).

    One window is attended unpadded; more go through one padded batched attention (no per-request
    loop): requests are padded to the longest window and the longest key range, and masks hide the
    padding.
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    num_requests = q_lens.shape[0]
    max_q = int(q_lens.max()) if num_requests else 0
    max_kv = int(kv_lens.max()) if num_requests else 0
    # Rows past cu_seqlens_q[R] are padding (a captured step's fixed token count): left as zeros.
    result = torch.zeros_like(q)
    num_tokens = int(cu_seqlens_q[-1]) if num_requests else 0
    if num_tokens == 0 or max_kv == 0:
        return result
    q = q[:num_tokens]
    if num_requests == 1:
        # One window (the common batch-1 step): no padding to build or undo.
        result[:num_tokens] = _one_request_attention(
            q, k_cache, v_cache, page_table[0], max_kv, scale, causal
        )
        return result
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
        k.transpose(1, 2).float(),
        v.transpose(1, 2).float(),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=group > 1,
    )
    result[:num_tokens] = out.transpose(1, 2)[request_of, slot_of].to(q.dtype)
    return result


def _one_request_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    kv_len: int,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """paged_attention of a single window (the common batch-1 step): no padding to build or undo."""
    q_len = q.shape[0]
    page_size = k_cache.shape[1]
    used = pages[: -(-kv_len // page_size)].long()
    k = k_cache.index_select(0, used).flatten(0, 1)[:kv_len]  # [kv_len, num_kv_heads, head_dim]
    v = v_cache.index_select(0, used).flatten(0, 1)[:kv_len]
    mask = None
    if causal and q_len > 1:
        # Query i sits at position kv_len - q_len + i and sees keys up to it.
        key_pos = torch.arange(kv_len, device=q.device)
        mask = key_pos[None, :] <= (kv_len - q_len + torch.arange(q_len, device=q.device))[:, None]
    return _window_attention(q, k, v, mask, scale)


@dataclass(frozen=True)
class HostWindows:
    """A CPU step's windows laid out once for all its layers (`host_windows`), where the paged path
    works the layout out again in every layer: on a 2-core AMD EPYC, SmolLM2's attention took 13% of a
    decode step at one request and 24% at eight, mostly those reductions, host reads, gathers and
    masks (plain decoding ran 1.06x / 1.10x faster without them). Request r's keys are its first
    kv_lens[r] cache positions; its window the last of them."""

    num_tokens: int  # the windows' tokens, packed back to back
    num_keys: int  # the longest request's keys: each request's are padded to it
    first_page: int | None  # one request whose pages are one run from this page: its keys read in place
    key_slots: torch.Tensor  # [R * num_keys] int64 the cache slot of each request's keys (padding: 0)
    # Ragged windows: each token's request and its row (None: windows of one length, no padding).
    query_rows: tuple[torch.Tensor, torch.Tensor] | None
    # [R, 1, query rows, num_keys] fp32: 0 where a query sees a key, -inf where not; None: all seen.
    mask: torch.Tensor | None

    @property
    def num_windows(self) -> int:
        """R, the number of windows (requests)."""
        return self.key_slots.shape[0] // self.num_keys


def host_windows(
    pages: Sequence[Sequence[int]],
    starts: Sequence[int],
    lens: Sequence[int],
    page_size: int,
    causal: bool,
    device: torch.device,
) -> HostWindows:
    """The HostWindows of request r's window of lens[r] >= 1 positions from starts[r] over its pages
    (in position order); causal: query i sees keys up to its own position, else every key."""
    num_requests = len(lens)
    kv_lens = [s + n for s, n in zip(starts, lens, strict=True)]
    num_keys, max_q = max(kv_lens), max(lens)
    used = [list(row[: -(-kv // page_size)]) for row, kv in zip(pages, kv_lens, strict=True)]
    first = None
    # A free list hands pages out in order, so a lone request's pages are mostly one run.
    if num_requests == 1 and used[0] == list(range(used[0][0], used[0][0] + len(used[0]))):
        first = used[0][0]
    rows = np.zeros((num_requests, -(-num_keys // page_size)), dtype=np.int64)
    for row, request_pages in zip(rows, used, strict=True):
        row[: len(request_pages)] = request_pages
    table = torch.from_numpy(rows)
    key_pos = torch.arange(num_keys)
    kv = torch.tensor(kv_lens)
    key_slots = table[:, key_pos // page_size] * page_size + key_pos % page_size
    key_slots = key_slots.masked_fill(key_pos[None, :] >= kv[:, None], 0)
    query_rows = None
    if min(lens) != max_q:
        request_of = torch.repeat_interleave(torch.arange(num_requests), torch.tensor(lens))
        starts_of = torch.tensor([0, *lens]).cumsum(0)[:-1]
        query_rows = (request_of, torch.arange(sum(lens)) - starts_of[request_of])
    mask = None
    if min(kv_lens) != num_keys or (causal and max_q > 1):
        # Query i of request r sits at kv_lens[r] - lens[r] + i (a padding row past its window sees
        # every key of its request); a key past kv_lens[r] is padding.
        q_pos = (kv - torch.tensor(lens))[:, None] + torch.arange(max_q)[None, :]
        hidden = key_pos[None, None, :] >= kv[:, None, None]
        if causal:
            hidden = hidden | (key_pos[None, None, :] > q_pos[:, :, None])
        mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[:, None].to(device)
    return HostWindows(
        sum(lens),
        num_keys,
        first,
        key_slots.flatten().to(device),
        None if query_rows is None else (query_rows[0].to(device), query_rows[1].to(device)),
        mask,
    )


def host_windows_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, windows: HostWindows, scale: float
) -> torch.Tensor:
    """paged_attention of windows laid out as `windows`: the same result, [num_tokens, heads, D]."""
    num_requests, num_keys, n = windows.num_windows, windows.num_keys, windows.num_tokens
    num_heads, head_dim = q.shape[1], q.shape[2]
    if windows.first_page is not None:
        end = windows.first_page + -(-num_keys // k_cache.shape[1])
        k = k_cache[windows.first_page : end].flatten(0, 1)[None, :num_keys]
        v = v_cache[windows.first_page : end].flatten(0, 1)[None, :num_keys]
    else:
        shape = (num_requests, num_keys, *k_cache.shape[2:])
        k = k_cache.flatten(0, 1).index_select(0, windows.key_slots).view(shape)
        v = v_cache.flatten(0, 1).index_select(0, windows.key_slots).view(shape)
    if windows.query_rows is None:
        queries = q[:n].view(num_requests, n // num_requests, num_heads, head_dim)
    else:
        rows = int(windows.query_rows[1].max()) + 1
        queries = q.new_zeros(num_requests, rows, num_heads, head_dim)
        queries[windows.query_rows] = q[:n]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2).float(),
        k.transpose(1, 2).float(),
        v.transpose(1, 2).float(),
        attn_mask=windows.mask,
        scale=scale,
        enable_gqa=num_heads > k.shape[2],
    ).transpose(1, 2)
    if windows.query_rows is None:
        return out.reshape(n, num_heads, head_dim).to(q.dtype)
    return out[windows.query_rows].to(q.dtype)


def _window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One window's attention: q [q_len, heads, D] over k, v [num_keys, kv_heads, D] (mask: [q_len,
    num_keys], bool (True: seen) or fp32 added to the scores, or None), in fp32, back in q's dtype."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float()[None],
        k.transpose(0, 1).float()[None],
        v.transpose(0, 1).float()[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] > k.shape[1],
    )
    return out[0].transpose(0, 1).to(q.dtype)


def greedy_accept(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    cu_windows: torch.Tensor,
    verify_lens: torch.Tensor,
    commit_caps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance over ragged verify windows.

    draft_tokens: [R, block_size]; target_tokens: [num_window_tokens] the target's argmax at each window
    position, windows packed by cu_windows [R + 1] (window r has 1 + verify_lens[r] positions);
    commit_caps: optional [R] most drafts each request may commit (cap-accept).
    Returns (num_accepted [R], bonus [R]): drafts accepted while they equal the target's choice (at most
    the cap), and the target's token after the last accepted draft.
    """
    num_requests, block_size = draft_tokens.shape
    device = draft_tokens.device
    if num_requests == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty.clone()
    # All windows at once (no per-request loop): position k of window r is target_tokens[cu[r] + k].
    starts = cu_windows[:-1].long()
    lens = verify_lens.long()
    k = torch.arange(block_size, device=device)
    inside = k[None, :] < lens[:, None]
    index = (starts[:, None] + k[None, :]).clamp(max=max(target_tokens.shape[0] - 1, 0))
    matches = (draft_tokens == target_tokens[index]) & inside
    accepted = matches.long().cumprod(dim=1).sum(dim=1)
    if commit_caps is not None:
        accepted = torch.minimum(accepted, commit_caps.long())
    return accepted, target_tokens[starts + accepted].long()


def exponential_race_sample(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """Sample one token per row as argmax(p / E), E ~ Exp(1) (the Gumbel-max trick in exponential form).

    probs, exponentials: [num_rows, vocab]. Returns [num_rows] int64.
    """
    return (probs / exponentials).argmax(dim=-1)


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    cu_windows: torch.Tensor,
    verify_lens: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling over ragged windows, random numbers passed in.

    draft_tokens: [R, block_size]; draft_probs: [R, block_size, vocab] the drafter's (filtered) distributions;
    target_probs: [num_window_tokens, vocab] the target's, packed by cu_windows [R + 1] (window r has
    1 + verify_lens[r] rows); uniforms: [R, block_size] U(0, 1); exponentials: [R, vocab] Exp(1).
    Draft i is kept while u_i * p_d(d_i) < p_t(d_i) (exactly, in fp64); the first rejected position
    draws argmax(max(0, p_t - p_d) / E) (unnormalized: argmax is scale-free), or from p_t when the
    residual is all zero; if every draft passes, the bonus is argmax(p_t / E) at the last row.
    Returns (num_accepted [R] int64, next_token [R] int64).
    """
    num_requests = draft_tokens.shape[0]
    accepted = torch.empty(num_requests, dtype=torch.long, device=draft_tokens.device)
    next_token = torch.empty(num_requests, dtype=torch.long, device=draft_tokens.device)
    starts = cu_windows.tolist()
    for r, length in enumerate(verify_lens.tolist()):
        rows = target_probs[starts[r] : starts[r] + 1 + length]
        n = length
        for i in range(length):
            token = int(draft_tokens[r, i])
            q = draft_probs[r, i, token].double()
            if not bool(uniforms[r, i].double() * q < rows[i, token].double()):
                n = i
                break
        row = rows[n]
        if n < length:
            residual = (rows[n] - draft_probs[r, n].to(rows.dtype)).clamp_min(0.0)
            if bool(residual.max() > 0):
                row = residual
        accepted[r] = n
        next_token[r] = exponential_race_sample(row[None].float(), exponentials[r : r + 1].float())[0]
    return accepted, next_token


def sps_at(num_tokens: torch.Tensor, sps_tokens: torch.Tensor, sps_values: torch.Tensor) -> torch.Tensor:
    """SPS [same shape] fp64 at integer token counts: linear between table points [num_points] fp64,
    clamped outside them (SpsTable.at)."""
    xs, ys = sps_tokens.to(torch.float64), sps_values.to(torch.float64)
    n = num_tokens.to(torch.float64).clamp(xs[0], xs[-1])
    if len(xs) == 1:
        return ys[0].expand(n.shape).clone()
    i = (torch.searchsorted(xs, n, right=True) - 1).clamp(0, len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return torch.where(n >= xs[-1], ys[-1], y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def plan_verify_lens(
    survivals: torch.Tensor,
    max_lens: torch.Tensor,
    sps_tokens: torch.Tensor,
    sps_values: torch.Tensor,
    budget: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The planner's budgets and top-K split (dspark.spec.planner's algorithm, no validation).

    survivals: [R, block_size] non-increasing along block_size; max_lens: [R]; sps_tokens, sps_values:
    [num_points] fp64; budget: optional [1] draft budget (negative: plan as sync). Drafts rank by
    survival descending, ties position then request ascending. Returns (verify_lens [R] int64,
    sync_budget [1] int64: leading admissions that each strictly improve (R + sum a) * SPS(B),
    argmax_budget [1] int64: that objective's first maximum over budgets 0..N).
    """
    num_requests, block_size = survivals.shape
    device = survivals.device
    admissible = torch.arange(block_size, device=device)[None, :] < max_lens.to(device)[:, None]
    mask = admissible.t().reshape(-1)
    values = survivals.t().reshape(-1)[mask].to(torch.float64)
    requests = torch.arange(num_requests, device=device).repeat(block_size)[mask]
    order = torch.sort(values, descending=True, stable=True).indices
    ranked, ranked_requests = values[order], requests[order]
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    tau = num_requests + torch.cat([zero, torch.cumsum(ranked, 0)])
    tokens = num_requests + torch.arange(ranked.numel() + 1, device=device)
    objective = tau * sps_at(tokens, sps_tokens.to(device), sps_values.to(device))
    sync = int((objective[1:] > objective[:-1]).to(torch.int64).cumprod(0).sum())
    argmax = int(torch.argmax(objective))
    chosen = sync
    if budget is not None and int(budget.reshape(-1)[0]) >= 0:
        chosen = min(int(budget.reshape(-1)[0]), ranked.numel())
    lens = torch.bincount(ranked_requests[:chosen], minlength=num_requests)
    as_tensor = lambda k: torch.tensor([k], dtype=torch.int64, device=device)  # noqa: E731
    return lens.to(torch.int64), as_tensor(sync), as_tensor(argmax)


def build_window_layout(
    window_starts: torch.Tensor,
    window_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed layout of R windows: window r covers positions [start, start + len) of request r.

    window_starts, window_lens: [R]; page_table: [R, max_pages]; num_tokens >= sum(lens) rows (the
    rest padding: position 0, slot -1). Returns (positions [num_tokens] int64, slots [num_tokens]
    int64, cu_seqlens [R + 1] int32, kv_lens [R] int32).
    """
    device = window_lens.device
    lens = window_lens.to(torch.int64)
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    kv_lens = (window_starts.to(torch.int64) + lens).to(torch.int32)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    owner = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens)
    used = owner.shape[0]
    offsets = torch.arange(used, device=device) - cu[:-1].to(torch.int64)[owner]
    positions[:used] = window_starts.to(torch.int64)[owner] + offsets
    pages = page_table[owner, positions[:used] // page_size].to(torch.int64)
    slots[:used] = pages * page_size + positions[:used] % page_size
    return positions, slots, cu, kv_lens


def pack_verify_tokens(
    anchors: torch.Tensor,
    drafts: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify-window tokens packed by cu_seqlens [R + 1]: window r = [anchors[r], drafts[r, :len - 1]].

    anchors: [R]; drafts: [R, block_size]. Returns [num_tokens] int64 (padding rows 0). With `out`
    [num_tokens], the windows' rows are written into it and rows from cu_seqlens[R] on keep what
    they hold (the tokens of windows packed after the verify windows, e.g. prompt chunks).
    """
    device = anchors.device
    tokens = torch.zeros(num_tokens, dtype=torch.int64, device=device) if out is None else out
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    owner = torch.repeat_interleave(torch.arange(anchors.shape[0], device=device), lens)
    offsets = torch.arange(owner.shape[0], device=device) - cu[:-1][owner]
    if drafts.shape[1]:
        draft = drafts[owner, (offsets - 1).clamp(min=0)].to(torch.int64)
    else:
        draft = torch.zeros_like(offsets)
    tokens[: owner.shape[0]] = torch.where(offsets == 0, anchors.to(torch.int64)[owner], draft)
    return tokens


def markov_decode(
    base_logits: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Greedy Markov decode of a draft block: draft k = argmax_v (U[r, k, v] + W2[v] · W1[x_{k-1}]),
    x_{-1} the anchor, the correction summed in fp32 and rounded to w2's dtype (ties to the lowest v).

    base_logits: [R, block_size, vocab]; anchors: [R]; w1, w2: [vocab, rank]. Returns [R, block_size] int64.
    """
    num_requests, block_size, _ = base_logits.shape
    previous = anchors.to(torch.int64)
    w2_t = w2.float().t()
    drafts = []
    for k in range(block_size):
        correction = (w1[previous].float() @ w2_t).to(w2.dtype).float()
        previous = (base_logits[:, k].float() + correction).argmax(dim=-1)
        drafts.append(previous)
    if not drafts:
        return torch.zeros(num_requests, 0, dtype=torch.int64, device=base_logits.device)
    return torch.stack(drafts, dim=1)
