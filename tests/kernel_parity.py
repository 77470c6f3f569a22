"""Parity cases and checks (test support, not part of the runtime), shared by the kernel tests (small
shapes, CPU interpreter) and the GPU benchmark `benchmarks/gpu_kernels.py` (realistic shapes): each
`make_*` draws a fresh random case, each `check_*` runs the kernel on poisoned outputs and compares it
with its torch reference twin, raising AssertionError on a mismatch and returning the error it
measured.

Random inputs are never zeros; outputs are poisoned (NaN, or a sentinel for integers) before the call
so that an unwritten element fails the check; page tables hold valid but wrong page ids past each
request's pages, so reading beyond a request's keys changes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dspark.kernels import reference


def tolerance(dtype: torch.dtype) -> float:
    """Relative-error bound ||out - ref|| / ||ref|| for a kernel whose math runs in fp32."""
    return 2e-5 if dtype == torch.float32 else 1e-2


def ulp_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Elementwise assert_close bounds of about two units in the last place of dtype."""
    return {
        torch.float32: {"rtol": 2e-6, "atol": 2e-6},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    }[dtype]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN anywhere gives NaN)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor full of NaN (floating) or an integer no kernel produces (int_poison)."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, int_poison(dtype), dtype=dtype, device=device)


def int_poison(dtype: torch.dtype) -> int:
    """The integer poison of dtype: near its minimum, far from any token, slot or length."""
    return torch.iinfo(dtype).min + 7


def randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """Standard normal values (never exactly zero in practice)."""
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _assert_written(out: torch.Tensor, name: str) -> None:
    bad = torch.isnan(out) if out.dtype.is_floating_point else out == int_poison(out.dtype)
    count = int(bad.sum())
    assert count == 0, f"{name}: {count} of {out.numel()} elements not written"


def _assert_err(err: float, bound: float, name: str) -> None:
    assert err == err and err <= bound, f"{name}: relative error {err:.3e} > {bound:.1e}"


# Attention ---------------------------------------------------------------------------------------


@dataclass
class AttentionCase:
    """Inputs of paged_attention (see reference.paged_attention for shapes)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens: torch.Tensor
    kv_lens: torch.Tensor
    scale: float
    causal: bool

    def args(self) -> tuple:
        """Positional arguments of paged_attention."""
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.page_table,
            self.cu_seqlens,
            self.kv_lens,
            self.scale,
            self.causal,
        )


def make_attention_case(
    q_lens: list[int],
    prefixes: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    causal: bool,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> AttentionCase:
    """Windows of q_lens tokens after prefixes cached tokens, pages shuffled over the cache."""
    num_requests = len(q_lens)
    kv_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    pages_needed = [-(-n // page_size) for n in kv_lens]
    max_pages = max(pages_needed) + 1
    num_pages = sum(pages_needed) + 3
    order = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    table = torch.randint(
        0, num_pages, (num_requests, max_pages), generator=gen, device=device, dtype=torch.int32
    )
    used = 0
    for r, n in enumerate(pages_needed):
        table[r, :n] = order[used : used + n]
        used += n
    cu = torch.zeros(num_requests + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, device=device), 0)
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    return AttentionCase(
        q=randn((sum(q_lens), num_q_heads, head_dim), dtype, device, gen),
        k_cache=randn(cache_shape, dtype, device, gen),
        v_cache=randn(cache_shape, dtype, device, gen),
        page_table=table,
        cu_seqlens=cu,
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        causal=causal,
    )


def check_attention(kernels: SimpleNamespace, case: AttentionCase, num_splits: int | None = None) -> float:
    """Kernel vs reference paged attention; returns the relative error."""
    out = poisoned(tuple(case.q.shape), case.q.dtype, case.q.device)
    kernels.attention.paged_attention(*case.args(), num_splits=num_splits, out=out)
    ref = reference.paged_attention(*case.args())
    _assert_written(out, "paged_attention")
    err = rel_err(out, ref)
    _assert_err(err, tolerance(case.q.dtype), "paged_attention")
    return err


# Norm, rotary, KV store --------------------------------------------------------------------------


def check_rms_norm(
    kernels: SimpleNamespace,
    num_rows: int,
    hidden: int,
    dtype: torch.dtype,
    residual: bool,
    device: torch.device,
    gen: torch.Generator,
) -> float:
    """Fused RMSNorm (+ residual) vs reference; returns the normed output's relative error."""
    x = randn((num_rows, hidden), dtype, device, gen)
    res = randn((num_rows, hidden), dtype, device, gen) if residual else None
    weight = randn((hidden,), dtype, device, gen)
    out = (
        poisoned((num_rows, hidden), dtype, device),
        poisoned((num_rows, hidden), dtype, device) if residual else None,
    )
    normed, summed = kernels.norm.rms_norm(x, weight, 1e-6, res, out=out)
    ref_normed, ref_summed = reference.rms_norm(x, weight, 1e-6, res)
    _assert_written(normed, "rms_norm")
    torch.testing.assert_close(normed, ref_normed, **ulp_tolerance(dtype))
    if residual:
        _assert_written(summed, "rms_norm residual")
        torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    return rel_err(normed, ref_normed)


def check_silu_mul(
    kernels: SimpleNamespace,
    num_rows: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    row_stride: int = 0,
) -> float:
    """Fused silu(gate) * up vs reference on rows of [gate | up] (row_stride > 2 * width: the rows are
    a strided view of a wider buffer); returns the relative error."""
    wide = randn((num_rows, max(row_stride, 2 * width)), dtype, device, gen) * 4
    gate_up = wide[:, : 2 * width]
    out = poisoned((num_rows, width), dtype, device)
    got = kernels.activation.silu_mul(gate_up, out=out)
    _assert_written(got, "silu_mul")
    ref = reference.silu_mul(gate_up)
    torch.testing.assert_close(got, ref, **ulp_tolerance(dtype))
    return rel_err(got, ref)


@dataclass
class RotaryCase:
    """Inputs of the rotary / store ops: q [T, Hq, D], k, v [T, Hkv, D], positions, slots [T] (some -1),
    cos_sin [max_pos, D], paged caches, per-head norm weights [D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


def make_rotary_case(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    padding_rows: int = 0,
) -> RotaryCase:
    """Tokens at random positions storing into distinct random slots; the last padding_rows are -1.

    q/k/v are strided views of one fused qkv projection, as the model produces them."""
    num_pages = -(-(num_tokens + 8) // page_size)
    qkv = randn((num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim), dtype, device, gen)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    slots = torch.randperm(num_pages * page_size, generator=gen, device=device)[:num_tokens]
    if padding_rows:
        slots[num_tokens - padding_rows :] = -1
    max_pos = 4 * num_tokens + 64
    cos_sin = torch.rand((max_pos, head_dim), generator=gen, device=device) * 2 - 1
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    return RotaryCase(
        q=q.view(num_tokens, num_q_heads, head_dim),
        k=k.view(num_tokens, num_kv_heads, head_dim),
        v=v.view(num_tokens, num_kv_heads, head_dim),
        positions=torch.randint(0, max_pos, (num_tokens,), generator=gen, device=device),
        slots=slots,
        cos_sin=cos_sin,
        k_cache=poisoned(cache_shape, dtype, device),
        v_cache=poisoned(cache_shape, dtype, device),
        q_norm=randn((head_dim,), dtype, device, gen),
        k_norm=randn((head_dim,), dtype, device, gen),
    )


def _assert_caches(
    kernel_caches: tuple[torch.Tensor, ...],
    ref_caches: tuple[torch.Tensor, ...],
    dtype: torch.dtype,
    name: str,
) -> None:
    """Same slots written (the rest still poisoned) with the same values."""
    for got, want in zip(kernel_caches, ref_caches, strict=True):
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: wrote a different set of slots"
        torch.testing.assert_close(got, want, equal_nan=True, **ulp_tolerance(dtype))


def check_rotary(kernels: SimpleNamespace, case: RotaryCase) -> float:
    """rotary vs reference; returns the larger relative error of q and k."""
    out = (
        poisoned(tuple(case.q.shape), case.q.dtype, case.q.device),
        poisoned(tuple(case.k.shape), case.k.dtype, case.k.device),
    )
    q, k = kernels.rotary_store.rotary(case.q, case.k, case.positions, case.cos_sin, out=out)
    ref_q, ref_k = reference.rotary(case.q, case.k, case.positions, case.cos_sin)
    _assert_written(q, "rotary q")
    _assert_written(k, "rotary k")
    torch.testing.assert_close(q, ref_q, **ulp_tolerance(q.dtype))
    torch.testing.assert_close(k, ref_k, **ulp_tolerance(k.dtype))
    return max(rel_err(q, ref_q), rel_err(k, ref_k))


def check_store_kv(kernels: SimpleNamespace, case: RotaryCase) -> float:
    """store_kv vs reference (exact); returns 0."""
    caches = (case.k_cache.clone(), case.v_cache.clone())
    ref_caches = (case.k_cache.clone(), case.v_cache.clone())
    kernels.rotary_store.store_kv(case.k, case.v, *caches, case.slots)
    reference.store_kv(case.k, case.v, *ref_caches, case.slots)
    for got, want in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    return 0.0


def check_rotary_store_kv(kernels: SimpleNamespace, case: RotaryCase, qk_norm: bool) -> float:
    """The fused attention prologue vs reference; returns q's relative error."""
    norms = (case.q_norm, case.k_norm) if qk_norm else (None, None)
    caches = (case.k_cache.clone(), case.v_cache.clone())
    ref_caches = (case.k_cache.clone(), case.v_cache.clone())
    out = poisoned(tuple(case.q.shape), case.q.dtype, case.q.device)
    q = kernels.rotary_store.rotary_store_kv(
        case.q, case.k, case.v, case.positions, case.cos_sin, *caches, case.slots, *norms, 1e-6, out=out
    )
    ref_q = reference.rotary_store_kv(
        case.q, case.k, case.v, case.positions, case.cos_sin, *ref_caches, case.slots, *norms, 1e-6
    )
    _assert_written(q, "rotary_store_kv q")
    torch.testing.assert_close(q, ref_q, **ulp_tolerance(q.dtype))
    _assert_caches(caches, ref_caches, q.dtype, "rotary_store_kv")
    return rel_err(q, ref_q)


def check_inject_kv(kernels: SimpleNamespace, case: RotaryCase, k_norm: bool) -> float:
    """The drafter's injection store vs reference; returns 0 (elementwise bounds are asserted)."""
    caches = (case.k_cache.clone(), case.v_cache.clone())
    ref_caches = (case.k_cache.clone(), case.v_cache.clone())
    weight = case.k_norm if k_norm else None
    kernels.rotary_store.inject_kv(
        case.k, case.v, weight, 1e-6, case.positions, case.cos_sin, *caches, case.slots
    )
    reference.inject_kv(case.k, case.v, weight, 1e-6, case.positions, case.cos_sin, *ref_caches, case.slots)
    _assert_caches(caches, ref_caches, case.k.dtype, "inject_kv")
    return 0.0


# Acceptance, sampling, planning ------------------------------------------------------------------


def ragged_windows(verify_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(verify_lens [R] int64, cu_windows [R + 1] int32) for windows of 1 + verify_lens[r] rows."""
    lens = torch.tensor(verify_lens, dtype=torch.int64, device=device)
    cu = torch.zeros(len(verify_lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lens + 1, 0)
    return lens, cu


def _assert_equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], name: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_written(g, f"{name}[{i}]")
        assert torch.equal(g.cpu(), w.cpu()), (
            f"{name}[{i}]: kernel {g.tolist()[:16]} != ref {w.tolist()[:16]}"
        )


def check_greedy_accept(
    kernels: SimpleNamespace,
    verify_lens: list[int],
    block_size: int,
    vocab: int,
    caps: bool,
    device: torch.device,
    gen: torch.Generator,
) -> float:
    """Greedy accept (+ bonus, optional commit caps) vs reference, exactly; small vocab so that
    drafts often match. Returns 0."""
    lens, cu = ragged_windows(verify_lens, device)
    num_requests = len(verify_lens)
    drafts = torch.randint(0, vocab, (num_requests, block_size), generator=gen, device=device)
    targets = torch.randint(0, vocab, (int(cu[-1]),), generator=gen, device=device)
    # Make long matching prefixes likely: copy each window's targets into its drafts, then break some.
    for r in range(num_requests):
        s, n = int(cu[r]), verify_lens[r]
        drafts[r, :n] = targets[s : s + n]
        cut = int(torch.randint(0, n + 2, (1,), generator=gen, device=device))
        if cut < n:
            drafts[r, cut] = (targets[s + cut] + 1) % vocab
    commit_caps = (
        torch.randint(0, block_size + 1, (num_requests,), generator=gen, device=device) if caps else None
    )
    out = tuple(poisoned((num_requests,), torch.int64, device) for _ in range(2))
    got = kernels.accept.greedy_accept(drafts, targets, cu, lens, commit_caps, out=out)
    want = reference.greedy_accept(drafts, targets, cu, lens, commit_caps)
    _assert_equal(got, want, "greedy_accept")
    return 0.0


def make_distributions(
    rows: int, vocab: int, device: torch.device, gen: torch.Generator, sharpness: float = 3.0
) -> torch.Tensor:
    """[rows, vocab] fp32 probability rows, some entries exactly zero (as top-k/top-p leave them)."""
    logits = randn((rows, vocab), torch.float32, device, gen) * sharpness
    drop = torch.rand((rows, vocab), generator=gen, device=device) < 0.3
    return torch.softmax(logits.masked_fill(drop, float("-inf")), dim=-1)


def check_rejection_accept(
    kernels: SimpleNamespace,
    verify_lens: list[int],
    block_size: int,
    vocab: int,
    device: torch.device,
    gen: torch.Generator,
    num_splits: int | None = None,
) -> float:
    """Lossless rejection sampling vs its reference twin with the same random numbers, exactly.

    Target rows are mixtures with the draft rows so that acceptances and rejections both occur, and the
    first request's target equals its draft on the drafted rows (every draft kept: the bonus path).
    Returns 0."""
    lens, cu = ragged_windows(verify_lens, device)
    num_requests = len(verify_lens)
    draft_probs = make_distributions(num_requests * block_size, vocab, device, gen).view(
        num_requests, block_size, vocab
    )
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(
        num_requests, block_size
    )
    target_probs = make_distributions(int(cu[-1]), vocab, device, gen)
    for r in range(num_requests):
        s, n = int(cu[r]), verify_lens[r]
        mix = float(torch.rand((), generator=gen, device=device))
        target_probs[s : s + n] = mix * draft_probs[r, :n] + (1 - mix) * target_probs[s : s + n]
        if r == 0:
            target_probs[s : s + n] = draft_probs[r, :n]
    uniforms = torch.rand((num_requests, block_size), generator=gen, device=device)
    exponentials = torch.empty((num_requests, vocab), device=device).exponential_(generator=gen)
    out = tuple(poisoned((num_requests,), torch.int64, device) for _ in range(2))
    args = (draft_tokens, draft_probs, target_probs, cu, lens, uniforms, exponentials)
    got = kernels.accept.rejection_accept(*args, num_splits=num_splits, out=out)
    want = reference.rejection_accept(*args)
    _assert_equal(got, want, "rejection_accept")
    return 0.0


def check_exponential_race(
    kernels: SimpleNamespace,
    rows: int,
    vocab: int,
    device: torch.device,
    gen: torch.Generator,
    num_splits: int | None = None,
    ties: bool = False,
) -> float:
    """Exponential-race sampling vs reference, exactly; with ties, rows hold repeated maxima so that the
    lowest index must win. Returns 0."""
    probs = make_distributions(rows, vocab, device, gen)
    exponentials = torch.empty((rows, vocab), device=device).exponential_(generator=gen)
    if ties:
        probs = torch.full_like(probs, 1.0 / vocab)
        exponentials = torch.ones_like(exponentials)
        exponentials[:, vocab // 3 :: 7] = 0.5  # the first maximum is at vocab // 3
    out = poisoned((rows,), torch.int64, device)
    got = kernels.sampling.exponential_race_sample(probs, exponentials, num_splits=num_splits, out=out)
    want = reference.exponential_race_sample(probs, exponentials)
    _assert_equal((got,), (want,), "exponential_race_sample")
    return 0.0


def make_survivals(
    num_requests: int, block_size: int, device: torch.device, gen: torch.Generator, ties: bool = False
) -> torch.Tensor:
    """[R, block_size] fp32 survivals a_j = c_1 ... c_j; with ties, confidences come from a few values so that
    equal survivals across requests and positions exercise the tie order."""
    if ties:
        levels = torch.tensor([1.0, 0.5, 0.25], device=device)
        conf = levels[torch.randint(0, 3, (num_requests, block_size), generator=gen, device=device)]
    else:
        conf = torch.rand((num_requests, block_size), generator=gen, device=device) * 0.6 + 0.4
    return torch.cumprod(conf, dim=1)


def check_plan_verify_lens(
    kernels: SimpleNamespace,
    num_requests: int,
    block_size: int,
    points: list[tuple[int, float]],
    device: torch.device,
    gen: torch.Generator,
    budget: int | None = None,
    ties: bool = False,
) -> float:
    """Device planner (lens, sync budget, argmax budget) vs reference twin, exactly. Returns 0."""
    survivals = make_survivals(num_requests, block_size, device, gen, ties)
    max_lens = torch.randint(0, block_size + 1, (num_requests,), generator=gen, device=device)
    xs = torch.tensor([p[0] for p in points], dtype=torch.float64, device=device)
    ys = torch.tensor([p[1] for p in points], dtype=torch.float64, device=device)
    budget_t = None if budget is None else torch.tensor([budget], dtype=torch.int64, device=device)
    out = (
        poisoned((num_requests,), torch.int64, device),
        poisoned((1,), torch.int64, device),
        poisoned((1,), torch.int64, device),
    )
    got = kernels.planner.plan_verify_lens(survivals, max_lens, xs, ys, budget_t, out=out)
    want = reference.plan_verify_lens(survivals, max_lens, xs, ys, budget_t)
    _assert_equal(got, want, "plan_verify_lens")
    return 0.0


# Layout ------------------------------------------------------------------------------------------


def check_layout(
    kernels: SimpleNamespace,
    window_starts: list[int],
    window_lens: list[int],
    page_size: int,
    padding: int,
    block_size: int,
    device: torch.device,
    gen: torch.Generator,
) -> float:
    """build_window_layout and pack_verify_tokens vs their references, exactly."""
    num_requests = len(window_lens)
    starts = torch.tensor(window_starts, dtype=torch.int64, device=device)
    lens = torch.tensor(window_lens, dtype=torch.int64, device=device)
    max_pages = max(-(-(s + n) // page_size) for s, n in zip(window_starts, window_lens, strict=True)) + 1
    table = (
        torch.randperm(num_requests * max_pages + 5, generator=gen, device=device)[: num_requests * max_pages]
        .view(num_requests, max_pages)
        .to(torch.int32)
    )
    num_tokens = sum(window_lens) + padding
    out = (
        poisoned((num_tokens,), torch.int64, device),
        poisoned((num_tokens,), torch.int64, device),
        poisoned((num_requests + 1,), torch.int32, device),
        poisoned((num_requests,), torch.int32, device),
    )
    got = kernels.layout.build_window_layout(starts, lens, table, page_size, num_tokens, out=out)
    want = reference.build_window_layout(starts, lens, table, page_size, num_tokens)
    _assert_equal(got, want, "build_window_layout")
    _, _, cu, _ = want
    anchors = torch.randint(1, 1000, (num_requests,), generator=gen, device=device)
    drafts = torch.randint(
        1, 1000, (num_requests, max(block_size, max(window_lens, default=1))), generator=gen, device=device
    )
    tokens = kernels.layout.pack_verify_tokens(
        anchors, drafts, cu, num_tokens, out=poisoned((num_tokens,), torch.int64, device)
    )
    _assert_equal(
        (tokens,), (reference.pack_verify_tokens(anchors, drafts, cu, num_tokens),), "pack_verify_tokens"
    )
    # Into a step whose later rows hold other windows' tokens: those rows must survive.
    held = torch.randint(1, 1000, (num_tokens,), generator=gen, device=device)
    got = kernels.layout.pack_verify_tokens(
        anchors, drafts, cu, num_tokens, out=held.clone(), keep_past_end=True
    )
    want = reference.pack_verify_tokens(anchors, drafts, cu, num_tokens, out=held.clone())
    _assert_equal((got,), (want,), "pack_verify_tokens keep_past_end")
    end = int(cu[-1])
    assert torch.equal(got[end:], held[end:]), "pack_verify_tokens keep_past_end overwrote later rows"
    return 0.0


def check_markov_decode(
    kernels: SimpleNamespace,
    num_requests: int,
    block_size: int,
    vocab: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    strided: bool = False,
) -> float:
    """markov_decode vs reference, exactly (random logits: no ties within the sums' rounding). With
    `strided`, the base logits are a view of a wider tensor (the kernel reads them through strides).
    Returns 0."""
    shape = (num_requests, block_size, vocab)
    wide = torch.randn(
        num_requests, block_size + 2 if strided else block_size, vocab, generator=gen, device=device
    )
    base = (wide[:, 1 : block_size + 1] if strided else wide).to(dtype)
    assert base.shape == shape
    # Anchors as the proposer passes them: the first column of a [R, block_size] block (a strided view).
    block = torch.randint(0, vocab, (num_requests, max(block_size, 1)), generator=gen, device=device)
    anchors = block[:, 0]
    # Weights that move the argmax: the Markov correction is as large as the base logits.
    w1 = (torch.randn(vocab, rank, generator=gen, device=device) / rank**0.25).to(dtype)
    w2 = (torch.randn(vocab, rank, generator=gen, device=device) / rank**0.25).to(dtype)
    out = poisoned((num_requests, block_size), torch.int64, device)
    got = kernels.markov.markov_decode(base, anchors, w1, w2, out=out)
    want = reference.markov_decode(base, anchors, w1, w2)
    _assert_equal((got,), (want,), "markov_decode")
    if num_requests * block_size >= 4:  # the correction must matter, or the test would not see it
        assert not torch.equal(want.cpu(), base.float().argmax(dim=-1).cpu()), "no draft changed"
    return 0.0


def generator(device: torch.device, seed: int | None = None) -> tuple[torch.Generator, int]:
    """A generator on device seeded with `seed`, or with a fresh random seed (returned, for replays)."""
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(torch.seed())))
    return torch.Generator(device=device).manual_seed(seed), seed
