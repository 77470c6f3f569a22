"""Paged ragged attention kernel == its torch reference: decode, verify windows, prefill chunks and the
drafter's non-causal block, over shuffled pages, with GQA ratios 1, 3 and 4 and key-range splits.

On a machine without CUDA the kernels run in Triton's interpreter (load_kernels sets TRITON_INTERPRET
before Triton is imported); the realistic shapes run only on a GPU.
"""

from __future__ import annotations

import kernel_parity as parity
import pytest
import torch
from kernel_setup import DEVICE, KERNELS, gpu_only

from dspark.kernels import ops, reference


def case(q_lens, prefixes, heads=(8, 2), head_dim=16, page_size=16, causal=True, dtype=torch.float32, *, gen):
    return parity.make_attention_case(
        q_lens, prefixes, heads[0], heads[1], head_dim, page_size, causal, dtype, DEVICE, gen
    )


@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_single_tokens_match_reference(num_splits, gen):
    parity.check_attention(KERNELS, case([1, 1, 1, 1], [7, 16, 33, 250], gen=gen), num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_ragged_verify_windows_with_gqa_3_match_reference(num_splits, gen):
    c = case([1, 8, 3, 8], [0, 15, 16, 300], heads=(6, 2), gen=gen)
    parity.check_attention(KERNELS, c, num_splits)


def test_prefill_chunks_without_gqa_match_reference(gen):
    c = case([70, 33], [0, 50], heads=(4, 4), page_size=8, gen=gen)
    parity.check_attention(KERNELS, c, num_splits=1)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_draft_block_is_non_causal_over_context_and_block(num_splits, gen):
    c = case([7, 7, 7, 7], [0, 9, 16, 121], causal=False, gen=gen)
    parity.check_attention(KERNELS, c, num_splits)


def test_many_requests_with_small_pages_and_an_empty_window(gen):
    lens = torch.randint(1, 9, (24,), generator=gen, device=DEVICE).tolist()
    lens[5] = 0
    prefixes = torch.randint(0, 100, (24,), generator=gen, device=DEVICE).tolist()
    parity.check_attention(KERNELS, case(lens, prefixes, page_size=4, gen=gen), num_splits=1)


def test_long_prefixes_with_head_dim_64_and_gqa_4(gen):
    c = case([1, 8, 8], [511, 300, 480], heads=(16, 4), head_dim=64, gen=gen)
    parity.check_attention(KERNELS, c, num_splits=4)


def test_one_request_window_one_on_a_page_boundary(gen):
    parity.check_attention(KERNELS, case([1], [32], heads=(4, 1), gen=gen), num_splits=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_verify_windows(dtype, gen):
    parity.check_attention(KERNELS, case([8, 2, 5], [40, 0, 17], dtype=dtype, gen=gen), num_splits=2)


def test_head_dim_that_is_not_a_power_of_two(gen):
    parity.check_attention(KERNELS, case([3, 8], [20, 5], heads=(4, 2), head_dim=24, gen=gen), num_splits=1)


def test_many_splits_most_of_them_empty_for_short_prefixes(gen):
    parity.check_attention(KERNELS, case([1, 4, 1, 2], [3, 200, 0, 41], heads=(6, 2), gen=gen), num_splits=16)


def test_ops_sends_cpu_tensors_to_the_reference(gen):
    c = case([2, 1], [3, 4], gen=gen)
    c = parity.AttentionCase(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in c.__dict__.values()))
    torch.testing.assert_close(ops.paged_attention(*c.args()), reference.paged_attention(*c.args()))


@gpu_only
@pytest.mark.gpu
# Batch 256: the padded fp32 reference alone holds tens of GiB.
@pytest.mark.parametrize("batch", [1, 64, pytest.param(256, marks=pytest.mark.big_gpu_memory)])
def test_realistic_verify_and_decode_shapes(batch, gen):
    for window in (1, 8):
        prefixes = torch.randint(1, 4096, (batch,), generator=gen, device=DEVICE).tolist()
        c = case([window] * batch, prefixes, heads=(32, 8), head_dim=128, dtype=torch.bfloat16, gen=gen)
        parity.check_attention(KERNELS, c)


@gpu_only
@pytest.mark.gpu
def test_realistic_prefill_chunk(gen):
    c = case([2048, 512], [0, 1500], heads=(32, 8), head_dim=128, dtype=torch.bfloat16, gen=gen)
    parity.check_attention(KERNELS, c)


@gpu_only
@pytest.mark.gpu
def test_ops_sends_cuda_tensors_to_the_kernel(gen):
    c = case([8, 3], [100, 7], heads=(32, 8), head_dim=128, dtype=torch.bfloat16, gen=gen)
    err = parity.rel_err(ops.paged_attention(*c.args()), reference.paged_attention(*c.args()))
    assert err < parity.tolerance(torch.bfloat16)


@gpu_only
@pytest.mark.gpu
def test_a_kind_is_tuned_on_windows_with_keys_when_its_first_call_is_all_padding(monkeypatch):
    # A head layout no other test uses (group 5, head_dim 32): its tile is chosen here. The first call
    # is all padding, as a CUDA graph capture's warm-up is: timed on it, the tile would be noise.
    attention = KERNELS.attention
    tuner = attention._paged_attention_kernel
    timed_keys = []
    bench = tuner._bench

    def spy(*args, config, **meta):  # noqa: ANN202 - the autotuner's timing of one tile
        timed_keys.append(int(args[8].max()))  # kv_lens of the call being timed
        return bench(*args, config=config, **meta)

    monkeypatch.setattr(tuner, "_bench", spy)
    heads, kv_heads, head_dim = 10, 2, 32
    q = torch.zeros(8, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(4, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    no_keys = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    cu = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    attention.paged_attention(q, cache, cache, table, cu, no_keys, head_dim**-0.5, True)
    assert timed_keys, "the kind was not tuned"
    assert min(timed_keys) > 0  # every tile timed on windows with keys


def test_the_tile_kept_is_the_first_in_order_within_the_tolerance_of_the_fastest():
    """`reproducible_tile`: tiles a few percent apart are chosen by their order, not by which the timing
    noise made faster (another tile sums in another order: bf16 greedy output would change between
    starts); a tile beyond the tolerance loses its place."""
    choose = KERNELS.attention.reproducible_tile
    tolerance = KERNELS.attention.TILE_TOLERANCE
    order = ["a", "b", "c", "d"]
    near = 1 + tolerance / 2
    for noise in ({"b": near, "c": 1.0, "d": 1.0}, {"b": 1.0, "c": near, "d": 1.0}):
        assert choose(noise, order) == "b"  # "a" was pruned (not timed): the first timed one that is fast
    assert choose({"b": 1 + 2 * tolerance, "c": [1.0, 0.9, 1.1], "d": [near, 0.9, 1.2]}, order) == "c"
    assert choose({"d": 3.0}, order) == "d"
    assert choose({"x": 2.0, "y": 1.0}, order) == "y"  # none of the order timed: the fastest


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "first_tile_ms", "kept_first"), [(12, 1.05, True), (14, 1.25, False)])
def test_tune_keeps_the_first_fast_tile_not_the_fastest(monkeypatch, heads, first_tile_ms, kept_first):
    """Head layouts no other test uses (groups 6 and 7, head_dim 32): the decode tiles (16 x 64, then
    16 x 128) timed by a spy at `first_tile_ms` and 1.0 ms; the first is kept within the tolerance."""
    attention = KERNELS.attention
    tuner = attention._paged_attention_kernel

    def fake(*args, config, **meta):  # noqa: ANN202 - the autotuner's timing of one tile
        first = config.kwargs["BLOCK_N"] == 64
        ms = first_tile_ms if first else 1.0
        return [ms, ms, ms]

    monkeypatch.setattr(tuner, "_bench", fake)
    kv_heads, head_dim = 2, 32
    q = torch.zeros(8, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(4, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.ones(8, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(8, 4, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(9, dtype=torch.int32, device=DEVICE)
    attention.paged_attention(q, cache, cache, table, cu, lens, head_dim**-0.5, True, num_splits=1)
    kind = (heads // kv_heads, head_dim, 0, False)
    kept = [config for key, config in tuner.cache.items() if key[:4] == kind]
    assert len(kept) == 1
    assert (kept[0].kwargs["BLOCK_N"] == 64) is kept_first


@pytest.mark.parametrize("pages_in_a_run", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_one_window_laid_out_on_the_host_matches_the_paged_reference(pages_in_a_run, causal, cpu_gen):
    """A CPU step of one window reads its layout from host values (`reference.host_windows`: its pages
    in place where they are one run, gathered otherwise): the paged reference's result, for windows of
    one token, a verify window, a drafter's block and a prefill chunk, at random prefixes."""
    page_size, num_pages = 8, 64
    for q_len in (1, 4, 7, int(torch.randint(9, 40, (1,), generator=cpu_gen))):
        prefix = int(torch.randint(0, 200, (1,), generator=cpu_gen))
        needed = -(-(prefix + q_len) // page_size)
        if pages_in_a_run:
            first = int(torch.randint(0, num_pages - needed + 1, (1,), generator=cpu_gen))
            pages = list(range(first, first + needed))
        else:
            pages = torch.randperm(num_pages, generator=cpu_gen)[:needed].tolist()
        run = pages == list(range(pages[0], pages[0] + needed))
        pages += [0, 5]  # a page table row is wider than the pages the window reads
        windows = reference.host_windows([pages], [prefix], [q_len], page_size, causal, torch.device("cpu"))
        assert (windows.first_page is not None) == run
        _check_host_windows([pages], [prefix], [q_len], page_size, num_pages, causal, cpu_gen)


@pytest.mark.parametrize("causal", [True, False])
def test_many_windows_laid_out_on_the_host_match_the_paged_reference(causal, cpu_gen):
    """Several windows laid out on the host (`reference.host_windows`): decode steps (windows of one
    token), verify windows all of one length (no query padding) and ragged ones (prefill chunks beside
    decode windows), over shuffled pages, against the paged reference."""
    page_size, num_pages = 4, 400
    ragged = [int(n) for n in torch.randint(1, 9, (7,), generator=cpu_gen)]
    for lens in ([1] * 5, [4] * 3, [1, 4, 13, 2], ragged):
        prefixes = torch.randint(0, 60, (len(lens),), generator=cpu_gen).tolist()
        order = torch.randperm(num_pages, generator=cpu_gen).tolist()
        pages, used = [], 0
        for prefix, n in zip(prefixes, lens, strict=True):
            needed = -(-(prefix + n) // page_size) + 1  # a page reserved past the window
            pages.append(order[used : used + needed])
            used += needed
        _check_host_windows(pages, prefixes, lens, page_size, num_pages, causal, cpu_gen)


def _check_host_windows(pages, prefixes, lens, page_size, num_pages, causal, cpu_gen):
    """host_windows_attention (through ops) == reference.paged_attention over the same pages."""
    q = torch.randn(sum(lens), 6, 16, generator=cpu_gen)
    k_cache = torch.randn(num_pages, page_size, 2, 16, generator=cpu_gen)
    v_cache = torch.randn(num_pages, page_size, 2, 16, generator=cpu_gen)
    windows = reference.host_windows(pages, prefixes, lens, page_size, causal, torch.device("cpu"))
    width = max(map(len, pages))
    table = torch.tensor([row + [0] * (width - len(row)) for row in pages], dtype=torch.int32)
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    kv_lens = torch.tensor([p + n for p, n in zip(prefixes, lens, strict=True)], dtype=torch.int32)
    expected = reference.paged_attention(q, k_cache, v_cache, table, cu, kv_lens, 0.25, causal)
    got = ops.paged_attention(q, k_cache, v_cache, table, cu, kv_lens, 0.25, causal, windows)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
