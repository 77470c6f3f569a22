"""Device-side batch layout (positions, slots, cu_seqlens, kv_lens; verify tokens) ==
its torch reference twin, exactly, and AttentionBatch.build (which lays out through them) == a
per-token loop.

On a machine without CUDA the kernels run in Triton's interpreter (see test_kernels_attention.py).
"""

from __future__ import annotations

import subprocess
import sys

import kernel_parity as parity
import pytest
import torch
from kernel_setup import DEVICE, KERNELS, gpu_only

from dspark.kernels import ops, reference
from dspark.runner.attention_batch import AttentionBatch, build_page_table


@pytest.mark.parametrize("padding", [0, 5])
def test_verify_windows_across_page_boundaries(padding, gen):
    parity.check_layout(KERNELS, [15, 16, 0, 31, 100], [8, 1, 8, 2, 8], 16, padding, 7, DEVICE, gen)


def test_one_window(gen):
    parity.check_layout(KERNELS, [3], [1], 4, 0, 7, DEVICE, gen)


def test_prefill_chunks_with_an_empty_window_and_many_requests(gen):
    starts = torch.randint(0, 300, (40,), generator=gen, device=DEVICE).tolist()
    lens = torch.randint(0, 20, (40,), generator=gen, device=DEVICE).tolist()
    lens[3] = 0
    parity.check_layout(KERNELS, starts, lens, 4, 3, 7, DEVICE, gen)


@pytest.mark.parametrize("device", ["cpu", DEVICE], ids=["reference", "kernel"])
def test_attention_batch_build_lays_out_every_token_by_hand(device, gen):
    """AttentionBatch.build (through ops.build_window_layout) against a per-token loop, padded."""
    starts, lens, page_size = [0, 17, 5, 64], [12, 8, 1, 3], 8
    pages = [
        torch.randperm(50, generator=gen, device=DEVICE)[: -(-(s + n) // page_size)].tolist()
        for s, n in zip(starts, lens, strict=True)
    ]
    batch = AttentionBatch.build(pages, starts, lens, page_size, True, torch.device(device), 30, 6)
    expected_slots = [
        pages[r][p // page_size] * page_size + p % page_size
        for r, (s, n) in enumerate(zip(starts, lens, strict=True))
        for p in range(s, s + n)
    ]
    expected_slots += [-1] * (30 - len(expected_slots))
    assert batch.slots.cpu().tolist() == expected_slots
    assert batch.cu_seqlens_q.cpu().tolist() == [0, 12, 20, 21, 24, 24, 24]
    assert batch.kv_lens.cpu().tolist() == [12, 25, 6, 67, 0, 0]
    for r, row in enumerate(pages):
        assert batch.page_table[r, : len(row)].cpu().tolist() == row


def test_a_host_step_carries_its_layout_as_host_values():
    """On the CPU an unpadded layout carries `host_windows` (every layer reads it instead of the
    tensors); a padded layout or a GPU one carries none."""
    cpu = torch.device("cpu")
    windows = AttentionBatch.build([[7, 8, 9]], [20], [4], 8, True, cpu).host_windows
    assert windows is not None and (windows.num_keys, windows.num_tokens, windows.first_page) == (24, 4, 7)
    assert windows.query_rows is None  # one window: no query padding
    assert windows.mask is not None and (windows.mask == 0).sum(dim=-1).flatten().tolist() == [21, 22, 23, 24]
    scattered = AttentionBatch.build([[7, 3, 9]], [20], [1], 8, True, cpu).host_windows
    assert scattered is not None and scattered.first_page is None and scattered.mask is None
    assert scattered.key_slots.tolist() == [7 * 8 + i for i in range(8)] + [3 * 8 + i for i in range(8)] + [
        9 * 8 + i for i in range(5)
    ]
    ragged = AttentionBatch.build([[1], [2, 3]], [0, 2], [1, 9], 8, True, cpu).host_windows
    assert ragged is not None and ragged.query_rows is not None and ragged.num_windows == 2
    assert [t.tolist() for t in ragged.query_rows] == [[0] + [1] * 9, [0, *range(9)]]
    assert AttentionBatch.build([[7, 8, 9]], [20], [4], 8, True, cpu, num_tokens=6).host_windows is None
    assert AttentionBatch.build([[1], [2]], [0, 0], [1, 1], 8, True, cpu, num_requests=3).host_windows is None
    if DEVICE.type == "cuda":
        assert AttentionBatch.build([[7, 8, 9]], [20], [4], 8, True, DEVICE).host_windows is None


@pytest.mark.parametrize("num_requests", [0, 1, 5, 64])
def test_page_table_lists_each_requests_pages_and_pads_with_zeros(num_requests, gen):
    """build_page_table (the host half of every step's layout) against a row-by-row expectation, with
    empty requests and padding rows."""
    host = torch.Generator().manual_seed(gen.initial_seed())  # gen may live on the GPU
    counts = torch.randint(0, 9, (num_requests,), generator=host)
    pages = [torch.randperm(500, generator=host)[: int(n)].tolist() for n in counts]
    extra = 2
    table = build_page_table(pages, num_requests + extra)
    width = max([len(p) for p in pages] + [1])
    assert table.dtype == torch.int32 and table.shape == (num_requests + extra, width)
    for r in range(num_requests + extra):
        row = pages[r] if r < num_requests else []
        assert table[r].tolist() == row + [0] * (width - len(row))


@pytest.mark.parametrize("kernel", [False, True], ids=["ops-reference", "kernel"])
def test_build_window_layout_writes_into_static_outputs(kernel, gen):
    """The `out` form a captured step uses: the given tensors hold the layout afterwards."""
    device = DEVICE if kernel else torch.device("cpu")
    build = KERNELS.layout.build_window_layout if kernel else ops.build_window_layout
    starts = torch.tensor([9, 0, 30], device=device)
    lens = torch.tensor([3, 5, 1], device=device)
    table = torch.randint(0, 40, (3, 5), generator=gen, dtype=torch.int32, device=DEVICE).to(device)
    out = (
        torch.full((12,), 7, dtype=torch.int64, device=device),
        torch.full((12,), 7, dtype=torch.int64, device=device),
        torch.full((4,), 7, dtype=torch.int32, device=device),
        torch.full((3,), 7, dtype=torch.int32, device=device),
    )
    returned = build(starts, lens, table, 8, 12, out=out)
    expected = reference.build_window_layout(starts.cpu(), lens.cpu(), table.cpu(), 8, 12)
    for given, result, want in zip(out, returned, expected, strict=True):
        assert result is given
        assert torch.equal(given.cpu(), want)


def test_ops_on_cpu_tensors_use_the_references_without_importing_triton():
    script = (
        "import sys, torch\n"
        "from dspark.kernels import ops\n"
        "lens = torch.tensor([2, 1]); table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)\n"
        "out = ops.build_window_layout(torch.tensor([5, 0]), lens, table, 4, 3)\n"
        "ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)\n"
        "assert out[1].tolist() == [5, 6, 0], out\n"
        "assert 'triton' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_ops_dispatch_cpu_layout_to_the_reference(gen):
    starts, lens = torch.tensor([3, 9]), torch.tensor([4, 1])
    table = torch.randperm(12)[:8].view(2, 4).to(torch.int32)
    got = ops.build_window_layout(starts, lens, table, 4, 6)
    want = reference.build_window_layout(starts, lens, table, 4, 6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@gpu_only
@pytest.mark.gpu
def test_realistic_shapes(gen):
    starts = torch.randint(0, 4000, (256,), generator=gen, device=DEVICE).tolist()
    lens = torch.randint(1, 9, (256,), generator=gen, device=DEVICE).tolist()
    parity.check_layout(KERNELS, starts, lens, 16, 100, 7, DEVICE, gen)


def test_pack_verify_tokens_reference_by_hand(gen):
    """The (vectorised) reference against a per-window loop: ragged, an empty window, padding rows."""
    lens = [3, 0, 1, 5]
    anchors = torch.randint(1, 1000, (4,), generator=gen, device=DEVICE).cpu()
    drafts = torch.randint(1, 1000, (4, 4), generator=gen, device=DEVICE).cpu()
    cu = torch.tensor([0, 3, 3, 4, 9])
    packed = reference.pack_verify_tokens(anchors, drafts, cu, 12).tolist()
    expected = []
    for r, n in enumerate(lens):
        if n:
            expected += [int(anchors[r]), *drafts[r, : n - 1].tolist()]
    assert packed == expected + [0] * 3


def test_a_step_with_device_drafts_packs_them_into_its_host_tokens(gen):
    """TargetStep.with_host_tokens (what tensor-parallel ranks are sent): the verify windows' rows
    after the anchor take the drafts, the prefill chunk after them keeps its own tokens."""
    from dspark.runner.model_runner import TargetStep
    from dspark.spec.drafts import Drafts

    drafts = torch.randint(1, 1000, (2, 3), generator=gen, device=DEVICE).cpu()
    prefill = torch.randint(1, 1000, (4,), generator=gen, device=DEVICE).tolist()
    tokens = torch.tensor([11, 0, 0, 22, 0, 0, 0, *prefill])
    step = TargetStep(
        token_ids=tokens,
        positions=torch.arange(tokens.numel()),
        window_starts=[5, 9, 0],
        window_lens=[3, 4, 4],
        pages=[[0], [1], [2]],
        logit_rows=torch.arange(7),
        capture_layers=(),
        drafts=Drafts(drafts.to(DEVICE), torch.ones(2, 3, device=DEVICE), [None, None]),
    )
    host, made = step.with_host_tokens()
    assert host.drafts is None and made is None  # the drafts were made before the step
    want = [11, *drafts[0, :2].tolist(), 22, *drafts[1].tolist(), *prefill]
    assert host.token_ids.tolist() == want
    assert step.token_ids.tolist() == tokens.tolist()  # the original step is untouched
