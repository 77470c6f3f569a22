"""GPU kernel report: parity at realistic sizes, the device's ceilings, and every kernel against torch.

On one H200 (about 5 minutes; the first calls compile and autotune):
    python3 benchmarks/gpu_kernels.py --out benchmarks/results/gpu_kernels
On a CPU, the same logic at toy sizes under Triton's interpreter (numbers meaningless):
    python benchmarks/gpu_kernels.py --tiny --out /tmp/gpu_kernels
On a CPU, an offline sm_90 compile of every kernel variant, with registers, spills and the matrix /
copy instructions each one got (needs no GPU; catches compile errors before device time is spent):
    python benchmarks/gpu_kernels.py --compile-only --out /tmp/gpu_kernels

Shapes are Qwen3-8B-like: 32 q heads, 8 kv heads, head_dim 128, hidden 4096, vocabulary 151936, page
size 16, bf16, batches 1..256, prefixes up to 4096. Every timing is triton.testing.do_bench's median
(L2 flushed between runs), with a CUDA-graph replay time for the kernel beside it; achieved GB/s and
TFLOP/s count the fewest bytes each op must move and the FLOPs it must do, against the copy bandwidth
and bf16 matrix rate measured at the start of the same run. Writes results.json and results.md into
--out and prints the tables last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _import_root() -> None:
    """Make `dspark.kernels` importable from a plain checkout (the GPU image has no editable install),
    and the kernel tests' parity checks (tests/kernel_parity.py, test support) beside it."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import dspark.kernels  # noqa: F401
    except ImportError:
        package = ModuleType("dspark")
        package.__path__ = [str(ROOT / "backend" / "dspark")]
        sys.modules["dspark"] = package
        spec = importlib.util.spec_from_file_location(
            "dspark.kernels",
            ROOT / "backend" / "dspark" / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "backend" / "dspark" / "kernels")],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["dspark.kernels"] = module
        spec.loader.exec_module(module)


@dataclass
class Shapes:
    """Problem sizes of one run."""

    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    page_size: int
    block_size: int
    decode_batches: tuple[int, ...]
    verify_batches: tuple[int, ...]
    long_prefix: int
    verify_prefix: int
    prefill: int
    norm_rows: tuple[int, ...]
    reject_batch: int
    race_rows: tuple[int, ...]
    plan_batches: tuple[int, ...]


FULL = Shapes(
    32,
    8,
    128,
    4096,
    151_936,
    16,
    7,
    (1, 16, 64, 256),
    (1, 64, 256),
    4096,
    2048,
    2048,
    (256, 4096),
    64,
    (1, 256),
    (1, 64, 256),
)
TINY = Shapes(4, 2, 32, 64, 3000, 8, 7, (1, 3), (1, 3), 48, 24, 40, (8,), 3, (1, 3), (1, 5))


@dataclass
class Report:
    """Everything the run measured, as written to results.json."""

    device: dict = field(default_factory=dict)
    ceilings: dict = field(default_factory=dict)
    parity: list = field(default_factory=list)
    timings: list = field(default_factory=list)
    compile: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


class Runner:
    """Runs checks and timings, recording failures instead of stopping, within a time budget."""

    def __init__(self, report: Report, budget_s: float, tiny: bool, only: str | None) -> None:
        self.report = report
        self.deadline = time.monotonic() + budget_s
        self.tiny = tiny
        self.only = only

    def wanted(self, name: str) -> bool:
        if self.only and self.only not in name:
            return False
        if time.monotonic() > self.deadline:
            self.report.skipped.append(name)
            return False
        return True

    def parity(self, name: str, check: Callable[[], float]) -> None:
        if not self.wanted(name):
            return
        start = time.monotonic()
        try:
            err = check()
            entry = {"name": name, "ok": True, "error": err}
        except Exception as exc:  # noqa: BLE001 - one failing check must not stop the report
            entry = {
                "name": name,
                "ok": False,
                "message": f"{type(exc).__name__}: {exc}"[:600],
                "traceback": traceback.format_exc()[-2000:],
            }
        entry["seconds"] = round(time.monotonic() - start, 2)
        self.report.parity.append(entry)
        print(f"parity {name}: {'ok' if entry['ok'] else 'FAIL ' + entry['message']}", flush=True)

    def time(
        self,
        name: str,
        kernel: Callable[[], object],
        torch_fn: Callable[[], object] | None,
        bytes_moved: float,
        flops: float,
        torch_label: str,
    ) -> None:
        if not self.wanted(name):
            return
        entry: dict = {"name": name, "bytes": bytes_moved, "flops": flops, "torch": torch_label}
        try:
            entry["kernel_ms"] = bench(kernel, self.tiny)
            entry["kernel_graph_ms"] = bench_graph(kernel, self.tiny)
            if torch_fn is not None:
                entry["torch_ms"] = bench(torch_fn, self.tiny)
        except Exception as exc:  # noqa: BLE001
            entry["message"] = f"{type(exc).__name__}: {exc}"[:600]
            entry["traceback"] = traceback.format_exc()[-2000:]
        self.report.timings.append(entry)
        print(
            f"time {name}: {entry.get('kernel_ms')} ms vs torch {entry.get('torch_ms')} ms "
            f"{entry.get('message', '')}",
            flush=True,
        )


def bench(fn: Callable[[], object], tiny: bool) -> float:
    """Median milliseconds of fn: do_bench on a GPU, a few host-timed runs in the interpreter."""
    if tiny:
        fn()  # the interpreter is slow: one warm call, one timed
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    fn()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_graph(fn: Callable[[], object], tiny: bool) -> float | None:
    """Median milliseconds of a CUDA-graph replay of fn (launch gaps removed); None in the interpreter."""
    if tiny:
        return None
    import torch
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


# Ceilings ----------------------------------------------------------------------------------------


def measure_ceilings(report: Report, device, tiny: bool) -> None:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matrix rate, on random data."""
    import torch

    n_bytes = (16 << 20) if tiny else (2 << 30)
    src = torch.randint(-(2**31), 2**31 - 1, (n_bytes // 4,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src), tiny)
    size = 256 if tiny else 8192
    dtype = torch.float32 if tiny else torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    mm_ms = bench(lambda: a @ b, tiny)
    report.ceilings = {
        "copy_GBps": 2 * n_bytes / copy_ms / 1e6,
        "copy_bytes": n_bytes,
        "matmul_TFLOPs": 2 * size**3 / mm_ms / 1e9,
        "matmul_size": size,
        "matmul_dtype": str(dtype),
    }
    print(f"ceilings: {report.ceilings}", flush=True)


# Torch baselines ---------------------------------------------------------------------------------


def dense_sdpa(case, window: int, prefix: int):
    """SDPA over K/V already gathered into dense [R, Hkv, L, D] tensors (no paging: torch's best case),
    GQA through enable_gqa, the window causal at the end of the keys."""
    import torch
    import torch.nn.functional as F

    num_requests = case.kv_lens.shape[0]
    kv_len = prefix + window
    page_size = case.k_cache.shape[1]
    pages = case.page_table[:, : -(-kv_len // page_size)].long()
    k = case.k_cache[pages].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
    v = case.v_cache[pages].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
    q = case.q.view(num_requests, window, -1, case.q.shape[-1]).transpose(1, 2).contiguous()
    if case.causal and window > 1 and prefix == 0:
        # A whole causal prompt: is_causal lets torch take its flash path.
        return lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=case.scale, enable_gqa=True
        )
    mask = None
    if case.causal and window > 1:
        rows = torch.arange(prefix, kv_len, device=q.device)[:, None]
        mask = torch.arange(kv_len, device=q.device)[None, :] <= rows
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale, enable_gqa=True)


def greedy_torch(drafts, targets, cu, lens):
    """Vectorized eager greedy accept (no host sync): padded windows, cumprod of matches, gathered bonus."""
    import torch

    block_size = drafts.shape[1]
    j = torch.arange(block_size, device=drafts.device)
    index = (cu[:-1, None].long() + j[None, :]).clamp_max(targets.shape[0] - 1)
    match = (drafts == targets[index]) & (j[None, :] < lens[:, None])
    accepted = match.long().cumprod(1).sum(1)
    return accepted, targets[cu[:-1].long() + accepted]


def rejection_torch(draft_tokens, draft_probs, target_probs, cu, lens, uniforms, exponentials):
    """Vectorized eager rejection sampling (no host sync), the same math as the kernel."""
    import torch

    num_requests, block_size = draft_tokens.shape
    j = torch.arange(block_size, device=draft_tokens.device)
    rows = (cu[:-1, None].long() + j[None, :]).clamp_max(target_probs.shape[0] - 1)
    p = target_probs[rows, draft_tokens]
    q = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    in_window = j[None, :] < lens[:, None]
    reject = in_window & ~(uniforms.double() * q.double() < p.double())
    n = torch.where(reject, j[None, :], block_size).min(1).values.minimum(lens)
    t_row = target_probs[cu[:-1].long() + n]
    d_row = draft_probs[torch.arange(num_requests, device=n.device), n.clamp_max(block_size - 1)]
    residual = (t_row - d_row).clamp_min(0)
    use = (n < lens) & (residual.amax(1) > 0)
    row = torch.where(use[:, None], residual, t_row)
    return n, (row / exponentials).argmax(1)


# Cases -------------------------------------------------------------------------------------------


def attention_bytes_flops(case) -> tuple[float, float]:
    """Fewest bytes (each request's K/V once, q in, out) and FLOPs (QK and PV over visible keys)."""
    lens = case.kv_lens.tolist()
    cu = case.cu_seqlens.tolist()
    heads, dim = case.q.shape[1], case.q.shape[2]
    kv_heads = case.k_cache.shape[2]
    elem = case.q.element_size()
    kv_bytes = sum(lens) * kv_heads * dim * 2 * elem
    visible = 0
    for r, kv_len in enumerate(lens):
        window = cu[r + 1] - cu[r]
        if case.causal:
            visible += sum(kv_len - window + i + 1 for i in range(window))
        else:
            visible += window * kv_len
    return kv_bytes + 2 * case.q.numel() * elem, 4.0 * visible * heads * dim


def run_attention(runner: Runner, kernels, parity, reference, shapes: Shapes, device, gen) -> None:
    import torch

    dtype = torch.float32 if runner.tiny else torch.bfloat16
    heads = (shapes.q_heads, shapes.kv_heads)

    def make(q_lens, prefixes, causal=True):
        return parity.make_attention_case(
            q_lens, prefixes, *heads, shapes.head_dim, shapes.page_size, causal, dtype, device, gen
        )

    def rand_prefixes(n, high):
        return torch.randint(1, high, (n,), generator=gen, device=device).tolist()

    # Parity on ragged random shapes.
    for batch in shapes.decode_batches:
        runner.parity(
            f"attention decode b={batch} ragged prefixes <= {shapes.long_prefix}",
            lambda b=batch: parity.check_attention(
                kernels, make([1] * b, rand_prefixes(b, shapes.long_prefix))
            ),
        )
    for batch in shapes.verify_batches:
        runner.parity(
            f"attention verify b={batch} ragged windows 1..{shapes.block_size + 1}",
            lambda b=batch: parity.check_attention(
                kernels,
                make(
                    torch.randint(1, shapes.block_size + 2, (b,), generator=gen, device=device).tolist(),
                    rand_prefixes(b, shapes.long_prefix),
                ),
            ),
        )
    runner.parity(
        "attention verify forced 4 splits",
        lambda: parity.check_attention(
            kernels, make([shapes.block_size + 1] * 4, rand_prefixes(4, shapes.long_prefix)), num_splits=4
        ),
    )
    runner.parity(
        "attention draft block (non-causal)",
        lambda: parity.check_attention(
            kernels, make([shapes.block_size] * 16, rand_prefixes(16, shapes.verify_prefix), causal=False)
        ),
    )
    runner.parity(
        "attention prefill chunks + decode mix",
        lambda: parity.check_attention(
            kernels,
            make(
                [shapes.prefill, shapes.prefill // 4, 1, shapes.block_size + 1],
                [0, 1000 % shapes.long_prefix, 37, 500 % shapes.long_prefix],
            ),
        ),
    )

    # Timings on uniform shapes, so that dense SDPA is a fair torch equivalent.
    def timed(name, window, batch, prefix, causal=True):
        if not runner.wanted(name):
            return
        case = make([window] * batch, [prefix] * batch, causal)
        moved, flops = attention_bytes_flops(case)
        torch_fn = dense_sdpa(case, window, prefix)

        def baseline_agrees() -> float:
            # The baseline must compute the same function, or its time says nothing.
            dense = torch_fn().transpose(1, 2).reshape(case.q.shape)
            err = parity.rel_err(dense, kernels.attention.paged_attention(*case.args()))
            assert err < parity.tolerance(case.q.dtype), f"SDPA baseline differs: {err:.2e}"
            return err

        runner.parity(f"{name}: SDPA baseline agrees", baseline_agrees)
        runner.time(
            name,
            lambda: kernels.attention.paged_attention(*case.args()),
            torch_fn,
            moved,
            flops,
            "SDPA over dense pre-gathered KV",
        )

    for batch in shapes.decode_batches:
        timed(f"attention decode b={batch} prefix={shapes.long_prefix}", 1, batch, shapes.long_prefix)
    for batch in shapes.verify_batches:
        timed(
            f"attention verify w={shapes.block_size + 1} b={batch} prefix={shapes.verify_prefix}",
            shapes.block_size + 1,
            batch,
            shapes.verify_prefix,
        )
    block_batch = min(64, max(shapes.verify_batches))
    timed(
        f"attention draft block w={shapes.block_size} b={block_batch} prefix={shapes.verify_prefix}",
        shapes.block_size,
        block_batch,
        shapes.verify_prefix,
        causal=False,
    )
    timed(f"attention prefill {shapes.prefill} tokens", shapes.prefill, 1, 0)
    timed(
        f"attention prefill chunk 4x{shapes.prefill // 4} after {shapes.prefill // 2}",
        shapes.prefill // 4,
        4,
        shapes.prefill // 2,
    )


def run_norm_rotary(runner: Runner, kernels, parity, reference, shapes: Shapes, device, gen) -> None:
    import torch

    dtype = torch.float32 if runner.tiny else torch.bfloat16
    elem = 4 if runner.tiny else 2
    for rows in shapes.norm_rows:
        runner.parity(
            f"rms_norm+residual {rows}x{shapes.hidden}",
            lambda r=rows: parity.check_rms_norm(kernels, r, shapes.hidden, dtype, True, device, gen),
        )
    runner.parity(
        f"rms_norm per-head {4096 if not runner.tiny else 64}x{shapes.head_dim}",
        lambda: parity.check_rms_norm(
            kernels, 4096 if not runner.tiny else 64, shapes.head_dim, dtype, False, device, gen
        ),
    )
    heads = (shapes.q_heads, shapes.kv_heads, shapes.head_dim, shapes.page_size)
    for tokens in (max(shapes.norm_rows[0], 8), shapes.prefill):
        case = parity.make_rotary_case(tokens, *heads, dtype, device, gen, padding_rows=3)
        runner.parity(f"rotary T={tokens}", lambda c=case: parity.check_rotary(kernels, c))
        runner.parity(f"store_kv T={tokens}", lambda c=case: parity.check_store_kv(kernels, c))
        for qk_norm in (True, False):
            runner.parity(
                f"rotary_store_kv qk_norm={qk_norm} T={tokens}",
                lambda c=case, n=qk_norm: parity.check_rotary_store_kv(kernels, c, n),
            )
        runner.parity(f"inject_kv T={tokens}", lambda c=case: parity.check_inject_kv(kernels, c, True))

    for rows in shapes.norm_rows:
        x, res = (parity.randn((rows, shapes.hidden), dtype, device, gen) for _ in range(2))
        w = parity.randn((shapes.hidden,), dtype, device, gen)
        runner.time(
            f"rms_norm+residual {rows}x{shapes.hidden}",
            lambda x=x, r=res, w=w: kernels.norm.rms_norm(x, w, 1e-6, r),
            lambda x=x, r=res, w=w: reference.rms_norm(x, w, 1e-6, r),
            5 * x.numel() * elem,
            0,
            "eager torch (reference)",
        )
    for tokens in (max(shapes.norm_rows[0], 8), shapes.prefill):
        c = parity.make_rotary_case(tokens, *heads, dtype, device, gen)
        qkv = (shapes.q_heads + 2 * shapes.kv_heads) * shapes.head_dim * tokens * elem
        moved = qkv + shapes.q_heads * shapes.head_dim * tokens * elem + tokens * shapes.head_dim * 4
        moved += 2 * shapes.kv_heads * shapes.head_dim * tokens * elem
        args = (
            c.q,
            c.k,
            c.v,
            c.positions,
            c.cos_sin,
            c.k_cache,
            c.v_cache,
            c.slots,
            c.q_norm,
            c.k_norm,
            1e-6,
        )
        runner.time(
            f"rotary_store_kv+qk_norm T={tokens}",
            lambda a=args: kernels.rotary_store.rotary_store_kv(*a),
            lambda a=args: reference.rotary_store_kv(*a),
            moved,
            0,
            "eager torch (reference)",
        )
        inject = (c.k, c.v, c.k_norm, 1e-6, c.positions, c.cos_sin, c.k_cache, c.v_cache, c.slots)
        moved = 4 * shapes.kv_heads * shapes.head_dim * tokens * elem + tokens * shapes.head_dim * 4
        runner.time(
            f"inject_kv T={tokens}",
            lambda a=inject: kernels.rotary_store.inject_kv(*a),
            lambda a=inject: reference.inject_kv(*a),
            moved,
            0,
            "eager torch (reference)",
        )


def run_activation(runner: Runner, kernels, parity, reference, shapes: Shapes, device, gen) -> None:
    """SwiGLU's silu(gate) * up at the 8B shape's width (3 x hidden, Qwen3-8B's 12288): one pass
    against torch's two (silu, then the product)."""
    import torch

    dtype = torch.float32 if runner.tiny else torch.bfloat16
    elem = 4 if runner.tiny else 2
    width = 3 * shapes.hidden
    for rows in shapes.norm_rows:
        runner.parity(
            f"silu_mul {rows}x{width}",
            lambda r=rows: parity.check_silu_mul(kernels, r, width, dtype, device, gen),
        )
        gate_up = parity.randn((rows, 2 * width), dtype, device, gen)
        runner.time(
            f"silu_mul {rows}x{width}",
            lambda g=gate_up: kernels.activation.silu_mul(g),
            lambda g=gate_up: reference.silu_mul(g),
            3 * rows * width * elem,
            0,
            "eager torch (silu, then the product)",
        )


def run_accept(runner: Runner, kernels, parity, reference, shapes: Shapes, device, gen) -> None:
    import torch

    block_size, vocab = shapes.block_size, shapes.vocab
    big = max(shapes.plan_batches)
    lens_list = torch.randint(0, block_size + 1, (big,), generator=gen, device=device).tolist()
    runner.parity(
        f"greedy_accept R={big} (+caps)",
        lambda: parity.check_greedy_accept(kernels, lens_list, block_size, 4, True, device, gen),
    )
    runner.parity(
        f"rejection_accept R={shapes.reject_batch} V={vocab}",
        lambda: parity.check_rejection_accept(
            kernels, lens_list[: shapes.reject_batch], block_size, vocab, device, gen
        ),
    )
    for rows in shapes.race_rows:
        runner.parity(
            f"exponential_race rows={rows} V={vocab}",
            lambda r=rows: parity.check_exponential_race(kernels, r, vocab, device, gen),
        )
    runner.parity(
        "exponential_race ties",
        lambda: parity.check_exponential_race(kernels, 4, vocab, device, gen, ties=True),
    )
    points = [(1, 100.0), (64, 95.0), (256, 80.0), (1024, 40.0), (2048, 22.0)]
    for batch in shapes.plan_batches:
        for ties in (False, True):
            runner.parity(
                f"plan_verify_lens R={batch} ties={ties}",
                lambda b=batch, t=ties: parity.check_plan_verify_lens(
                    kernels, b, block_size, points, device, gen, ties=t
                ),
            )

    def given_budgets() -> float:
        for budget in (-1, 0, 17, 10**6):
            parity.check_plan_verify_lens(kernels, big, block_size, points, device, gen, budget=budget)
        return 0.0

    runner.parity("plan_verify_lens given budgets", given_budgets)

    lens, cu = parity.ragged_windows(lens_list, device)
    drafts = torch.randint(0, 4, (big, block_size), generator=gen, device=device)
    targets = torch.randint(0, 4, (int(cu[-1]),), generator=gen, device=device)
    runner.time(
        f"greedy_accept R={big}",
        lambda: kernels.accept.greedy_accept(drafts, targets, cu, lens),
        lambda: greedy_torch(drafts, targets, cu, lens),
        8 * (drafts.numel() + targets.numel()),
        0,
        "vectorized eager torch",
    )
    n = shapes.reject_batch
    r_lens, r_cu = parity.ragged_windows(lens_list[:n], device)
    draft_probs = parity.make_distributions(n * block_size, vocab, device, gen).view(n, block_size, vocab)
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(n, block_size)
    target_probs = parity.make_distributions(int(r_cu[-1]), vocab, device, gen)
    uniforms = torch.rand((n, block_size), generator=gen, device=device)
    exps = torch.empty((n, vocab), device=device).exponential_(generator=gen)
    args = (draft_tokens, draft_probs, target_probs, r_cu, r_lens, uniforms, exps)
    runner.time(
        f"rejection_accept R={n} V={vocab}",
        lambda: kernels.accept.rejection_accept(*args),
        lambda: rejection_torch(*args),
        3 * n * vocab * 4,
        0,
        "vectorized eager torch",
    )
    for rows in shapes.race_rows:
        probs = parity.make_distributions(rows, vocab, device, gen)
        e = torch.empty((rows, vocab), device=device).exponential_(generator=gen)
        runner.time(
            f"exponential_race rows={rows} V={vocab}",
            lambda p=probs, e=e: kernels.sampling.exponential_race_sample(p, e),
            lambda p=probs, e=e: reference.exponential_race_sample(p, e),
            2 * probs.numel() * 4,
            0,
            "eager torch (reference)",
        )
    xs = torch.tensor([p[0] for p in points], dtype=torch.float64, device=device)
    ys = torch.tensor([p[1] for p in points], dtype=torch.float64, device=device)
    for batch in shapes.plan_batches:
        surv = parity.make_survivals(batch, block_size, device, gen)
        caps = torch.full((batch,), block_size, device=device)
        runner.time(
            f"plan_verify_lens R={batch}",
            lambda s=surv, c=caps: kernels.planner.plan_verify_lens(s, c, xs, ys),
            lambda s=surv, c=caps: reference.plan_verify_lens(s, c, xs, ys),
            surv.numel() * 4,
            0,
            "eager torch twin (sorts, syncs)",
        )


def run_markov(runner: Runner, kernels, parity, reference, shapes: Shapes, device, gen) -> None:
    """The draft block's greedy Markov decode (rank 32, the shipped drafters') against the torch loop
    it replaced: per position a W1 gather, a bf16 linear, casts, an add and an argmax."""
    import torch

    rank, block_size = 32, shapes.block_size
    for batch in shapes.plan_batches:
        runner.parity(
            f"markov_decode R={batch}",
            lambda b=batch: parity.check_markov_decode(
                kernels, b, block_size, shapes.vocab, rank, torch.bfloat16, device, gen
            ),
        )
        base = torch.randn(batch, block_size, shapes.vocab, generator=gen, device=device).to(torch.bfloat16)
        anchors = torch.randint(0, shapes.vocab, (batch,), generator=gen, device=device)
        w1 = torch.randn(shapes.vocab, rank, generator=gen, device=device).to(torch.bfloat16)
        w2 = torch.randn(shapes.vocab, rank, generator=gen, device=device).to(torch.bfloat16)

        def torch_loop(base=base, anchors=anchors, w1=w1, w2=w2):
            previous, drafts = anchors, []
            for k in range(block_size):
                correction = torch.nn.functional.linear(w1[previous], w2).float()
                previous = (base[:, k].float() + correction).argmax(dim=-1)
                drafts.append(previous)
            return torch.stack(drafts, dim=1)

        runner.time(
            f"markov_decode R={batch} block_size={block_size}",
            lambda b=base, a=anchors, x=w1, y=w2: kernels.markov.markov_decode(b, a, x, y),
            torch_loop,
            base.numel() * 2 + w2.numel() * 2 * block_size,
            2 * batch * block_size * shapes.vocab * rank,
            "eager torch loop (gather, bf16 linear, casts, add, argmax a position)",
        )


def run_layout(runner: Runner, kernels, parity, reference, shapes: Shapes, device, gen) -> None:
    import torch

    big = max(shapes.plan_batches)
    starts = torch.randint(0, shapes.long_prefix, (big,), generator=gen, device=device)
    lens = torch.randint(1, shapes.block_size + 2, (big,), generator=gen, device=device)
    runner.parity(
        f"layout R={big} (+padding)",
        lambda: parity.check_layout(
            kernels, starts.tolist(), lens.tolist(), shapes.page_size, 100, shapes.block_size, device, gen
        ),
    )
    max_pages = (shapes.long_prefix + shapes.block_size + 1) // shapes.page_size + 2
    table = torch.randint(0, 10**5, (big, max_pages), generator=gen, device=device, dtype=torch.int32)
    num_tokens = int(lens.sum())
    runner.time(
        f"build_window_layout R={big}",
        lambda: kernels.layout.build_window_layout(starts, lens, table, shapes.page_size, num_tokens),
        lambda: reference.build_window_layout(starts, lens, table, shapes.page_size, num_tokens),
        num_tokens * 20,
        0,
        "eager torch twin (repeat_interleave)",
    )
    anchors = torch.randint(0, shapes.vocab, (big,), generator=gen, device=device)
    drafts = torch.randint(0, shapes.vocab, (big, shapes.block_size), generator=gen, device=device)
    cu = torch.zeros(big + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lens, 0)
    runner.time(
        f"layout pack_verify_tokens R={big}",
        lambda: kernels.layout.pack_verify_tokens(anchors, drafts, cu, num_tokens),
        lambda: reference.pack_verify_tokens(anchors, drafts, cu, num_tokens),
        num_tokens * 16 + big * 8,
        0,
        "eager torch twin (repeat_interleave)",
    )


# Offline compile report --------------------------------------------------------------------------


def compile_report(report: Report, kernels, only: str | None) -> None:
    """Compile every kernel variant for sm_90 without a GPU; record registers, spills and key SASS ops."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    target = GPUTarget("cuda", 90, 32)

    def jit_fn(kernel):
        while not isinstance(kernel, triton.runtime.jit.JITFunction):
            kernel = kernel.fn
        return kernel

    def one(name, kernel, ptrs, consts, floats=(), num_warps=4, num_stages=2, div16=()):
        if only and only not in name:
            return
        fn = jit_fn(kernel)
        sig = {}
        for arg in fn.arg_names:
            if arg in consts:
                sig[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                sig[arg] = "*" + ptrs.get(arg, "i64")
            else:
                sig[arg] = "fp32" if arg in floats else "i32"
        # Pointers, strides and the sizes named in div16 get the 16-divisibility hint that a real launch
        # gives arguments divisible by 16 (the realistic shapes are).
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, arg in enumerate(fn.arg_names)
            if sig[arg].startswith("*") or arg.startswith("stride") or arg in div16
        }
        entry = {"name": name, "warps": num_warps, "stages": num_stages}
        start = time.monotonic()
        try:
            compiled = triton.compile(
                ASTSource(fn, sig, consts, attrs),
                target=target,
                options={"num_warps": num_warps, "num_stages": num_stages},
            )
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run(
                    [str(bindir / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
                ).stdout
                sass = subprocess.run(
                    [str(bindir / "cuobjdump"), "-sass", f.name], capture_output=True, text=True
                ).stdout
            match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
            entry.update(
                {
                    "ok": True,
                    "regs": int(match.group(1)),
                    "stack": int(match.group(2)),
                    "shared": compiled.metadata.shared,
                    "sass": dict(
                        Counter(re.findall(r"\b(HGMMA|HMMA|LDGSTS|LDL|STL|(?:LDG|STG)[.\w]*)\b", sass))
                    ),
                }
            )
        except Exception as exc:  # noqa: BLE001
            entry.update({"ok": False, "message": f"{type(exc).__name__}: {exc}"[:800]})
        entry["seconds"] = round(time.monotonic() - start, 1)
        report.compile.append(entry)
        print(f"compile {name}: {entry}", flush=True)

    att = dict(
        q_ptr="bf16",
        k_ptr="bf16",
        v_ptr="bf16",
        out_ptr="bf16",
        part_out_ptr="fp32",
        part_lse_ptr="fp32",
        page_table_ptr="i32",
        cu_seqlens_ptr="i32",
        kv_lens_ptr="i32",
    )
    from dspark.kernels.attention import _configs

    for window_class, split in ((0, True), (1, False), (2, False)):
        for config in _configs():
            bm = config.kwargs["BLOCK_M"]
            if (window_class < 2 and bm > 64) or (window_class == 2 and bm < 64):
                continue
            consts = dict(
                PAGE_SIZE=16,
                GROUP=4,
                HEAD_DIM=128,
                BLOCK_D=128,
                CAUSAL=window_class != 1 or not split,
                SPLIT=split,
                WINDOW_CLASS=window_class,
                DOT_FP32=False,
                **config.kwargs,
            )
            one(
                f"attention class={window_class} split={split} {config.kwargs}",
                kernels.attention._paged_attention_kernel,
                att,
                consts,
                ("qk_scale",),
                config.num_warps,
                config.num_stages,
            )
    one(
        "attention fp32 (tests)",
        kernels.attention._paged_attention_kernel,
        {**att, **{k: "fp32" for k in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}},
        dict(
            PAGE_SIZE=16,
            GROUP=4,
            HEAD_DIM=128,
            BLOCK_D=128,
            CAUSAL=True,
            SPLIT=False,
            WINDOW_CLASS=1,
            DOT_FP32=True,
            BLOCK_M=16,
            BLOCK_N=32,
        ),
        ("qk_scale",),
        4,
        1,
    )
    one(
        "attention combine",
        kernels.attention._combine_splits_kernel,
        dict(out_ptr="bf16", part_out_ptr="fp32", part_lse_ptr="fp32", cu_seqlens_ptr="i32"),
        dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16),
    )
    one(
        "attention one request (R=1 specialised)",
        kernels.attention._paged_attention_kernel,
        att,
        dict(
            PAGE_SIZE=16,
            GROUP=4,
            HEAD_DIM=128,
            BLOCK_D=128,
            CAUSAL=True,
            SPLIT=True,
            WINDOW_CLASS=0,
            DOT_FP32=False,
            BLOCK_M=16,
            BLOCK_N=64,
            num_requests=1,
            search_steps=1,
        ),
    )
    for residual in (True, False):
        one(
            f"rms_norm residual={residual}",
            kernels.norm._rms_norm_kernel,
            dict(x_ptr="bf16", res_ptr="bf16", w_ptr="bf16", out_ptr="bf16", res_out_ptr="bf16"),
            dict(HAS_RESIDUAL=residual, BLOCK_H=4096, ROWS=1),
            ("eps",),
            8,
            div16=("hidden",),
        )
    rs = dict(
        q_ptr="bf16",
        k_ptr="bf16",
        v_ptr="bf16",
        q_out_ptr="bf16",
        k_out_ptr="bf16",
        k_cache_ptr="bf16",
        v_cache_ptr="bf16",
        q_norm_ptr="bf16",
        k_norm_ptr="bf16",
        positions_ptr="i64",
        cos_sin_ptr="fp32",
        slots_ptr="i64",
    )
    for label, flags in (
        ("rotary_store_kv+qk_norm", (True, True, True, True, False, True)),
        ("rotary", (True, True, False, False, True, False)),
        ("store_kv", (False, False, False, False, False, True)),
        ("inject_kv", (False, True, False, True, False, True)),
    ):
        consts = dict(zip(("HAS_Q", "ROTATE", "Q_NORM", "K_NORM", "K_OUT", "STORE"), flags, strict=True))
        consts.update(HEAD_DIM=128, HALF=64, BLOCK_HALF=64, BLOCK_HQ=32, BLOCK_HKV=8)
        one(label, kernels.rotary_store._rotary_store_kernel, rs, consts, ("eps",), 4)
    one(
        "greedy_accept",
        kernels.accept._greedy_accept_kernel,
        dict(
            draft_ptr="i64",
            target_ptr="i64",
            cu_ptr="i32",
            lens_ptr="i64",
            caps_ptr="i64",
            accepted_ptr="i64",
            bonus_ptr="i64",
        ),
        dict(HAS_CAPS=True, BLOCK_R=32, BLOCK_G=8),
    )
    one(
        "rejection partial",
        kernels.accept._rejection_partial_kernel,
        dict(
            draft_tokens_ptr="i64",
            draft_probs_ptr="fp32",
            target_probs_ptr="fp32",
            cu_ptr="i32",
            lens_ptr="i64",
            uniforms_ptr="fp32",
            exps_ptr="fp32",
            accepted_ptr="i64",
            part_val_ptr="fp32",
            part_idx_ptr="i32",
            part_mass_ptr="fp32",
        ),
        dict(BLOCK_G=8, BLOCK=1024),
        div16=("vocab", "chunk"),
    )
    one(
        "rejection reduce",
        kernels.accept._rejection_reduce_kernel,
        dict(
            accepted_ptr="i64",
            lens_ptr="i64",
            part_val_ptr="fp32",
            part_idx_ptr="i32",
            part_mass_ptr="fp32",
            next_ptr="i64",
        ),
        dict(BLOCK_S=16),
    )
    one(
        "race partial",
        kernels.sampling._race_partial_kernel,
        dict(probs_ptr="fp32", exps_ptr="fp32", part_val_ptr="fp32", part_idx_ptr="i32"),
        dict(BLOCK=1024),
        div16=("vocab", "chunk"),
    )
    one(
        "race reduce",
        kernels.sampling._race_reduce_kernel,
        dict(part_val_ptr="fp32", part_idx_ptr="i32", out_ptr="i64"),
        dict(BLOCK_S=16),
    )
    one(
        "planner rank",
        kernels.planner._rank_kernel,
        dict(
            surv_ptr="fp32",
            max_lens_ptr="i64",
            xs_ptr="fp64",
            ys_ptr="fp64",
            rank_ptr="i32",
            obj_ptr="fp64",
            prev_ptr="fp64",
        ),
        dict(BLOCK_E=kernels.planner.BLOCK_E, BLOCK_F=kernels.planner.BLOCK_F, BLOCK_T=8),
    )
    one(
        "planner rank (R=1 specialised)",
        kernels.planner._rank_kernel,
        dict(
            surv_ptr="fp32",
            max_lens_ptr="i64",
            xs_ptr="fp64",
            ys_ptr="fp64",
            rank_ptr="i32",
            obj_ptr="fp64",
            prev_ptr="fp64",
        ),
        dict(BLOCK_E=kernels.planner.BLOCK_E, BLOCK_F=kernels.planner.BLOCK_F, BLOCK_T=8, num_requests=1),
    )
    one(
        "planner split",
        kernels.planner._split_kernel,
        dict(
            rank_ptr="i32",
            obj_ptr="fp64",
            prev_ptr="fp64",
            budget_ptr="i64",
            lens_ptr="i64",
            sync_ptr="i64",
            argmax_ptr="i64",
        ),
        dict(HAS_BUDGET=True, BLOCK=1024, BLOCK_R=128, BLOCK_G=8),
        num_warps=8,
    )
    one(
        "layout bounds",
        kernels.layout._window_bounds_kernel,
        dict(starts_ptr="i64", lens_ptr="i64", cu_ptr="i32", kv_lens_ptr="i32"),
        dict(BLOCK_R=256),
    )
    one(
        "layout positions/slots",
        kernels.layout._positions_slots_kernel,
        dict(starts_ptr="i64", cu_ptr="i32", page_table_ptr="i32", positions_ptr="i64", slots_ptr="i64"),
        dict(PAGE_SIZE=16, BLOCK=256),
    )
    one(
        "layout verify tokens",
        kernels.layout._verify_tokens_kernel,
        dict(anchors_ptr="i64", drafts_ptr="i64", cu_ptr="i32", tokens_ptr="i64"),
        dict(BLOCK=256),
    )
    markov_ptrs = dict(
        base_ptr="bf16",
        anchors_ptr="i64",
        in_val_ptr="fp32",
        in_idx_ptr="i32",
        tokens_ptr="i64",
        w1_ptr="bf16",
        w2_ptr="bf16",
        out_val_ptr="fp32",
        out_idx_ptr="i32",
    )
    for first in (True, False):
        one(
            f"markov step first={first}",
            kernels.markov._markov_step_kernel,
            markov_ptrs,
            dict(
                RANK=32,
                FIRST=first,
                CORR_DTYPE=tl.bfloat16,
                DOT_FP32=False,
                BLOCK_R=16,
                BLOCK_V=128,
                BLOCK_K=32,
                SUB_TILES=8,
                BLOCK_T=256,
            ),
        )
    one(
        "markov last",
        kernels.markov._markov_last_kernel,
        dict(in_val_ptr="fp32", in_idx_ptr="i32", tokens_ptr="i64"),
        dict(BLOCK_R=16, BLOCK_T=256),
    )


# Output ------------------------------------------------------------------------------------------


def markdown(report: Report) -> str:
    """The report as markdown tables."""
    lines = [f"# Kernel report: {report.device.get('name', '?')}", ""]
    for key, value in report.device.items():
        lines.append(f"- {key}: {value}")
    if report.ceilings:
        c = report.ceilings
        lines += [
            "",
            f"Ceilings (measured): copy {c['copy_GBps']:.0f} GB/s (read + write), "
            f"{c['matmul_dtype']} matmul {c['matmul_TFLOPs']:.1f} TFLOP/s at {c['matmul_size']}^3.",
            "",
        ]
    if report.parity:
        ok = sum(e["ok"] for e in report.parity)
        lines += [
            f"## Parity ({ok}/{len(report.parity)} ok)",
            "",
            "| check | result | rel. error | s |",
            "|---|---|---|---|",
        ]
        for e in report.parity:
            result = (
                "ok" if e["ok"] else "**FAIL** " + e["message"].replace("|", "/").replace("\n", " ")[:200]
            )
            err = f"{e['error']:.2e}" if e.get("error") else "exact" if e["ok"] else ""
            lines.append(f"| {e['name']} | {result} | {err} | {e['seconds']} |")
        lines.append("")
    if report.timings:
        bw = report.ceilings.get("copy_GBps", float("nan"))
        tf = report.ceilings.get("matmul_TFLOPs", float("nan"))
        lines += [
            "## Timings (median ms)",
            "",
            "| op | kernel | graph | torch | speedup | GB/s | TFLOP/s | % of roofline | torch is |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for e in report.timings:
            k = e.get("kernel_ms")
            if k is None:
                lines.append(f"| {e['name']} | **FAIL** {e.get('message', '')[:150]} | | | | | | | |")
                continue
            t = e.get("torch_ms")
            g = e.get("kernel_graph_ms")
            gbs = e["bytes"] / k / 1e6
            tfs = e["flops"] / k / 1e9
            floor = max(e["bytes"] / (bw * 1e6), e["flops"] / (tf * 1e9) if e["flops"] else 0.0)
            lines.append(
                f"| {e['name']} | {k:.4f} | {'' if g is None else f'{g:.4f}'} | "
                f"{'' if t is None else f'{t:.4f}'} | {'' if t is None else f'{t / k:.2f}x'} | {gbs:.0f} | "
                f"{tfs:.1f} | {100 * floor / k:.0f}% | {e['torch']} |"
            )
        lines.append("")
    if report.compile:
        lines += [
            "## Offline sm_90 compile",
            "",
            "| kernel | ok | regs | stack | shared | SASS | s |",
            "|---|---|---|---|---|---|---|",
        ]
        for e in report.compile:
            if e["ok"]:
                lines.append(
                    f"| {e['name']} | ok | {e['regs']} | {e['stack']} | {e['shared']} | {e['sass']} | "
                    f"{e['seconds']} |"
                )
            else:
                lines.append(f"| {e['name']} | **FAIL** {e['message'][:300]} | | | | | |")
        lines.append("")
    if report.skipped:
        lines += ["Skipped (time budget): " + ", ".join(report.skipped), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and results.md")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true", help="toy sizes on the CPU under Triton's interpreter")
    mode.add_argument("--compile-only", action="store_true", help="offline sm_90 compile report, no GPU")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop starting new items after this")
    parser.add_argument("--only", help="run only items whose name contains this")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    elif args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
    _import_root()
    import kernel_parity as parity
    import torch
    import triton

    from dspark.kernels import reference
    from dspark.kernels.runtime import load_kernels

    kernels = load_kernels(interpret=args.tiny)
    report = Report()
    report.device = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compile_only:
        report.device["name"] = "offline sm_90 compile (no GPU)"
        compile_report(report, kernels, args.only)
    else:
        if args.tiny:
            device = torch.device("cpu")
            report.device["name"] = "CPU, Triton interpreter (--tiny: numbers are not performance)"
        else:
            if not torch.cuda.is_available():
                print("no CUDA device: use --tiny or --compile-only", file=sys.stderr)
                return 2
            device = torch.device("cuda")
            props = torch.cuda.get_device_properties(device)
            report.device.update(
                name=props.name,
                sms=props.multi_processor_count,
                memory_GiB=round(props.total_memory / 2**30, 1),
            )
        shapes = TINY if args.tiny else FULL
        runner = Runner(report, args.budget_s, args.tiny, args.only)
        gen, seed = parity.generator(device)
        report.device["seed"] = seed
        measure_ceilings(report, device, args.tiny)
        for part in (run_attention, run_norm_rotary, run_activation, run_accept, run_layout, run_markov):
            try:
                part(runner, kernels, parity, reference, shapes, device, gen)
            except Exception as exc:  # noqa: BLE001 - a broken section must not lose the others' results
                report.parity.append(
                    {
                        "name": part.__name__,
                        "ok": False,
                        "seconds": 0,
                        "message": f"{type(exc).__name__}: {exc}"[:600],
                        "traceback": traceback.format_exc()[-2000:],
                    }
                )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.device["wall_s"] = round(time.monotonic() - started, 1)
    (args.out / "results.json").write_text(json.dumps(report.__dict__, indent=1, default=str) + "\n")
    text = markdown(report)
    (args.out / "results.md").write_text(text + "\n")
    print(text)
    failed = [e for e in report.parity + report.compile if not e["ok"]]
    failed += [e for e in report.timings if "message" in e]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
