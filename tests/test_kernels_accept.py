"""Acceptance, sampling and planning kernels == their torch reference twins, exactly; the twins ==
the engine's own per-request planner code (spec.planner); the engine's batched sampling acceptance
(spec.accept, which calls them) does not depend on the batch.

On a machine without CUDA the kernels run in Triton's interpreter (see test_kernels_attention.py).
"""

from __future__ import annotations

import kernel_parity as parity
import pytest
import torch
from kernel_setup import DEVICE, KERNELS, gpu_only

from dspark.kernels import reference
from dspark.sampling.sampler import filtered_probs, filtered_probs_of_requests
from dspark.sampling_params import SamplingParams
from dspark.spec.accept import rejection_accept_all
from dspark.spec.planner import global_argmax_budget, split_budget, sync_budget
from dspark.spec.sps_table import SpsTable

CPU = torch.device("cpu")
FALLING = [(1, 100.0), (8, 96.0), (24, 70.0), (64, 30.0)]
BUMPY = [(2, 50.0), (5, 58.0), (9, 40.0), (16, 45.0), (30, 20.0)]


@pytest.mark.parametrize("caps", [False, True])
def test_greedy_accept_over_ragged_windows(caps, gen):
    parity.check_greedy_accept(KERNELS, [0, 7, 3, 1, 7, 5, 0, 2], 7, 4, caps, DEVICE, gen)


def test_greedy_accept_of_many_requests(gen):
    lens = torch.randint(0, 8, (70,), generator=gen, device=DEVICE).tolist()
    parity.check_greedy_accept(KERNELS, lens, 7, 3, True, DEVICE, gen)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_rejection_accept_matches_its_twin_with_the_same_random_numbers(num_splits, gen):
    parity.check_rejection_accept(KERNELS, [7, 0, 3, 7, 1], 7, 300, DEVICE, gen, num_splits)


@pytest.mark.parametrize(
    "device", [CPU, pytest.param(DEVICE, marks=[pytest.mark.gpu, gpu_only])], ids=["cpu", "gpu"]
)
def test_batched_sampling_acceptance_does_not_depend_on_the_batch(cpu_gen, device):
    """The engine judges every sampling request of a step in one call (spec.accept): each request's
    result, and what it draws from its generator, are the same as if it were judged alone. On a GPU
    the generators live there, as the engine's do, and draw there."""
    vocab, block_size = 50, 5
    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_p=0.7),
        SamplingParams(temperature=1.3, top_k=7),
        # Requests with the same parameters are filtered in one call (sampling.filtered_probs_of_requests).
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
    ]
    outcomes = set()
    for _ in range(10):
        requests = []
        for p in params:
            verified = int(torch.randint(0, block_size + 1, (1,), generator=cpu_gen))
            draft_logits = torch.randn(block_size, vocab, generator=cpu_gen) * 2
            draft_probs = filtered_probs(draft_logits, p)
            drafts = torch.multinomial(draft_probs, 1, generator=cpu_gen)[:, 0]
            # The target is near the drafter, so that acceptances, rejections and bonus draws happen.
            noise = torch.randn(verified + 1, vocab, generator=cpu_gen)
            target_logits = torch.cat([draft_logits, draft_logits[-1:]])[: verified + 1] + noise
            seed = int(torch.randint(0, 2**31, (1,), generator=cpu_gen))
            requests.append(
                (drafts[:verified].tolist(), draft_probs.to(device), target_logits.to(device), p, seed)
            )

        def judge(batch):
            generators = [torch.Generator(device=device).manual_seed(r[4]) for r in batch]
            result = rejection_accept_all(
                [r[0] for r in batch],
                [r[1] for r in batch],
                [r[2] for r in batch],
                [r[3] for r in batch],
                generators,
                block_size,
            )
            return list(zip(*result, strict=True)), [g.get_state() for g in generators]

        together, states = judge(requests)
        for i, request in enumerate(requests):
            alone, (state,) = judge([request])
            assert alone == [together[i]]
            assert torch.equal(state, states[i])
            outcomes.add("rejected" if together[i][0] < len(request[0]) else "bonus")
        # A fixed amount a step: block_size uniforms, then one exponential per vocabulary entry.
        expected = torch.Generator(device=device).manual_seed(requests[0][4])
        torch.rand(block_size, generator=expected, device=device)
        torch.empty(vocab, device=device).exponential_(generator=expected)
        assert torch.equal(expected.get_state(), states[0])
    assert outcomes == {"rejected", "bonus"}


@pytest.mark.parametrize(
    "device", [CPU, pytest.param(DEVICE, marks=[pytest.mark.gpu, gpu_only])], ids=["cpu", "gpu"]
)
def test_requests_filtered_together_get_what_each_gets_alone(cpu_gen, device):
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.2, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=5),
    ]
    logits = [torch.randn(n, 300, generator=cpu_gen).to(device) * 3 for n in (1, 4, 2, 3, 1)]
    together = filtered_probs_of_requests(logits, params)
    alone = torch.cat([filtered_probs(rows, p) for rows, p in zip(logits, params, strict=True)])
    assert torch.equal(together, alone)
    assert torch.equal(filtered_probs_of_requests(logits[:1] * 3, params[:1] * 3), alone[:1].repeat(3, 1))


@pytest.mark.parametrize("num_splits", [None, 4])
def test_exponential_race_matches_reference(num_splits, gen):
    parity.check_exponential_race(KERNELS, 5, 3000, DEVICE, gen, num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_exponential_race_breaks_ties_to_the_lowest_index(num_splits, gen):
    parity.check_exponential_race(KERNELS, 3, 2500, DEVICE, gen, num_splits, ties=True)


@pytest.mark.parametrize("points", [FALLING, BUMPY, [(4, 10.0)]])
@pytest.mark.parametrize("ties", [False, True])
def test_device_planner_matches_its_twin(points, ties, gen):
    parity.check_plan_verify_lens(KERNELS, 9, 7, points, DEVICE, gen, ties=ties)


@pytest.mark.parametrize("budget", [-1, 0, 5, 1000])
def test_device_planner_splits_a_given_budget(budget, gen):
    parity.check_plan_verify_lens(KERNELS, 6, 7, BUMPY, DEVICE, gen, budget=budget)


def test_device_planner_with_one_request_and_many_requests(gen):
    parity.check_plan_verify_lens(KERNELS, 1, 7, FALLING, DEVICE, gen)
    parity.check_plan_verify_lens(KERNELS, 40, 4, BUMPY, DEVICE, gen, ties=True)


@pytest.mark.parametrize("points", [FALLING, BUMPY])
@pytest.mark.parametrize("ties", [False, True])
def test_planner_twin_matches_the_engine_planner(points, ties, cpu_gen):
    table = SpsTable(points)
    xs, ys = (torch.tensor(column, dtype=torch.float64) for column in zip(*points, strict=True))
    for _ in range(10):
        survivals = parity.make_survivals(12, 7, CPU, cpu_gen, ties)
        max_lens = torch.randint(0, 8, (12,), generator=cpu_gen)
        lens, sync, argmax = reference.plan_verify_lens(survivals, max_lens, xs, ys)
        assert int(sync) == sync_budget(survivals, max_lens, table)
        assert int(argmax) == global_argmax_budget(survivals, max_lens, table)
        assert torch.equal(lens, split_budget(survivals, max_lens, int(sync)))
        budget = torch.tensor([int(argmax)])
        lagged, _, _ = reference.plan_verify_lens(survivals, max_lens, xs, ys, budget)
        assert torch.equal(lagged, split_budget(survivals, max_lens, int(argmax)))


@gpu_only
@pytest.mark.gpu
def test_realistic_shapes(gen):
    vocab = 151_936
    lens = torch.randint(0, 8, (256,), generator=gen, device=DEVICE).tolist()
    parity.check_greedy_accept(KERNELS, lens, 7, 4, True, DEVICE, gen)
    parity.check_rejection_accept(KERNELS, lens[:32], 7, vocab, DEVICE, gen)
    parity.check_exponential_race(KERNELS, 1, vocab, DEVICE, gen)
    parity.check_exponential_race(KERNELS, 256, vocab, DEVICE, gen)
    parity.check_plan_verify_lens(KERNELS, 256, 7, FALLING, DEVICE, gen, ties=True)


@pytest.mark.parametrize("with_drafts", [False, True])
def test_plain_windows_commit_their_argmax_without_judging(with_drafts, gen):
    # Windows of one row each (no drafts verified) skip the accept kernel: each commits its row's
    # argmax, as the kernel over those windows does; the rows after them (prefill chunks) come back too.
    from dspark.spec.accept import greedy_accept_all

    windows, rest = 5, 3
    argmax = torch.randint(0, 1000, (windows + rest,), generator=gen, device=DEVICE)
    drafts = torch.randint(0, 1000, (windows, 4), generator=gen, device=DEVICE) if with_drafts else None
    result = greedy_accept_all([0] * windows, [0] * windows, drafts, argmax)
    cu = torch.arange(windows + 1, dtype=torch.long, device=DEVICE)
    zeros = torch.zeros(windows, dtype=torch.long, device=DEVICE)
    accepted, bonus = reference.greedy_accept(zeros[:, None], argmax[:windows], cu, zeros)
    assert result.accepted == accepted.tolist() == [0] * windows
    assert result.bonus == bonus.tolist() == argmax[:windows].tolist()
    assert result.drafts == [[]] * windows
    assert result.rest == argmax[windows:].tolist()


def test_steps_copied_together_read_what_each_step_copied_alone_reads(gen):
    # A burst's steps share one plan (one `window_bounds`) and one copy to the host (`copy_together`):
    # each step's acceptance reads its own slice, as the step's own copy reads, plain steps among them.
    from dspark.spec.accept import copy_together, greedy_accept_all, queue_greedy_accept, window_bounds

    lens = [int(n) for n in torch.randint(0, 4, (6,), generator=gen, device=DEVICE)]
    lens[0] = 3  # at least one window verifies drafts
    drawn = torch.randint(0, 4, (6,), generator=gen, device=DEVICE)
    caps = [min(n, int(c)) for n, c in zip(lens, drawn, strict=True)]
    bounds = window_bounds(lens, caps, DEVICE)
    steps, alone = [], []
    for step in range(4):
        plain = step == 2
        step_lens, step_caps = ([0] * 6, [0] * 6) if plain else (lens, caps)
        # The windows' rows, then two more (prefill chunks' last rows).
        argmax = torch.randint(0, 5, (sum(step_lens) + 6 + 2,), generator=gen, device=DEVICE)
        drafts = None if plain else torch.randint(0, 5, (6, 4), generator=gen, device=DEVICE)
        shared = None if plain else bounds
        steps.append(queue_greedy_accept(step_lens, step_caps, drafts, argmax, shared, copy=False))
        alone.append(greedy_accept_all(step_lens, step_caps, drafts, argmax))
    together = copy_together(steps)
    assert [q.result() for q in together] == alone
    assert copy_together([]) == []
