"""The draft block's greedy Markov decode kernel == its torch reference twin, exactly, and the twin ==
the proposer's position-by-position decode (the drafter's own modules).

On a machine without CUDA the kernels run in Triton's interpreter (see test_kernels_attention.py).
"""

from __future__ import annotations

import kernel_parity as parity
import pytest
import torch
from kernel_setup import DEVICE, KERNELS, gpu_only

from dspark.kernels import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_requests", "block_size", "vocab"),
    [(1, 1, 300), (1, 7, 1000), (5, 4, 513), (37, 3, 256)],
    ids=["one-request-one-position", "one-request", "ragged-vocab-tile", "several-request-tiles"],
)
def test_markov_decode_matches_its_twin(num_requests, block_size, vocab, dtype, gen):
    parity.check_markov_decode(KERNELS, num_requests, block_size, vocab, 32, dtype, DEVICE, gen)


def test_markov_decode_reads_strided_base_logits_and_a_small_rank(gen):
    parity.check_markov_decode(KERNELS, 6, 5, 700, 4, torch.float32, DEVICE, gen, strided=True)


@gpu_only
def test_markov_decode_at_smollm2_and_qwen3_8b_sizes(gen):
    parity.check_markov_decode(KERNELS, 64, 7, 49152, 32, torch.bfloat16, DEVICE, gen)
    parity.check_markov_decode(KERNELS, 8, 7, 151936, 32, torch.bfloat16, DEVICE, gen)


def test_twin_equals_the_drafters_own_position_by_position_decode(gen):
    """reference.markov_decode == W1 gather, W2 linear, add, argmax per position (what the proposer's
    CPU loop runs through the drafter's modules), in fp32."""
    vocab, rank, block_size = 400, 16, 6
    w1 = torch.nn.Embedding(vocab, rank)
    w2 = torch.nn.Linear(rank, vocab, bias=False)
    with torch.no_grad():
        w1.weight.copy_(torch.randn(vocab, rank, generator=gen, device=DEVICE).cpu())
        w2.weight.copy_(torch.randn(vocab, rank, generator=gen, device=DEVICE).cpu())
    base = torch.randn(9, block_size, vocab, generator=gen, device=DEVICE).cpu()
    anchors = torch.randint(0, vocab, (9,), generator=gen, device=DEVICE).cpu()
    previous, drafts = anchors, []
    with torch.no_grad():
        for k in range(block_size):
            previous = (base[:, k] + w2(w1(previous))).argmax(dim=-1)
            drafts.append(previous)
    got = reference.markov_decode(base, anchors, w1.weight.detach(), w2.weight.detach())
    assert torch.equal(got, torch.stack(drafts, dim=1))
