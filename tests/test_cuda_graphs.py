"""Captured steps: padding a step to a graph's fixed size changes nothing (checked eagerly on any machine),
and on a GPU the engine with CUDA graphs (target steps and draft blocks) gives exactly the tokens of
the eager engine, spec on and off."""

from __future__ import annotations

import gc
import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import RandomLengthGate, decaying_sps_table, emulated_graphs_config

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.attention_batch import AttentionBatch
from dspark.runner.cuda_graphs import (
    CAPTURE_RESERVE_BYTES,
    CAPTURE_SAFETY,
    CudaGraphs,
    all_tiers,
    capture_budget,
    capture_bytes,
    capture_graph,
    next_pow2,
    pow2_upto,
    step_tiers,
    token_tiers,
)
from dspark.runner.model_runner import ModelRunner

PAGE = 4


def test_tiers_pad_to_powers_of_two_then_quarter_steps_and_refuse_what_does_not_fit() -> None:
    assert [next_pow2(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert step_tiers(1, 1, 256, 32) == (1, 1)
    assert step_tiers(3, 3, 256, 32) == (4, 4)
    assert step_tiers(8, 1, 256, 32) == (8, 1)  # one verify window of 8 tokens
    assert step_tiers(200, 30, 256, 32) == (224, 32)
    assert step_tiers(129, 3, 256, 32) == (160, 4)
    # 64 verify windows of 4 tokens and one new prompt of 34: a quarter step above 256, not 512.
    assert step_tiers(64 * 4 + 34, 64, 512, 64) == (320, 64)
    assert pow2_upto(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert token_tiers(512) == [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert all_tiers(4, 2) == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]
    # Every tier step_tiers returns is captured at start-up.
    for max_requests in (64, 256):
        captured = set(all_tiers(512, max_requests))
        for tokens in range(1, 513):
            for requests in (1, 3, 17, 64, 129, 256):
                if requests <= min(tokens, max_requests):
                    assert step_tiers(tokens, requests, 512, max_requests) in captured
    assert step_tiers(257, 1, 256, 32) is None
    assert step_tiers(40, 33, 256, 32) is None


def _random_step(rng: random.Random, vocab: int, num_requests: int) -> tuple:
    """Windows of 1..6 tokens after 0..9 cached positions, each request on its own shuffled pages."""
    free = list(range(64))
    rng.shuffle(free)
    pages, starts, lens = [], [], []
    for _ in range(num_requests):
        start, length = rng.randrange(0, 10), rng.randrange(1, 7)
        needed = -(-(start + length) // PAGE)
        pages.append([free.pop() for _ in range(needed)])
        starts.append(start)
        lens.append(length)
    tokens = torch.tensor([rng.randrange(vocab) for _ in range(sum(lens))])
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    return tokens, positions, pages, starts, lens


@pytest.mark.parametrize("num_requests", [1, 3, 5])
def test_a_padded_step_gives_the_same_logits_and_cache(tiny_target_dir, num_requests) -> None:
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = EngineConfig(model=str(tiny_target_dir), spec_mode="off", num_kv_pages=64, kv_page_size=PAGE)
    runner = ModelRunner.create(config, torch.device("cpu"), torch.float32)
    cache, vocab = runner.cache, runner.model_config.vocab_size
    cache.k.normal_()
    cache.v.normal_()
    before = (cache.k.clone(), cache.v.clone())
    tokens, positions, pages, starts, lens = _random_step(rng, vocab, num_requests)

    def forward(num_tokens: int, num_windows: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        batch = AttentionBatch.build(
            pages, starts, lens, PAGE, True, torch.device("cpu"), num_tokens, num_windows
        )
        extra = batch.slots.shape[0] - len(tokens)
        ids = torch.cat([tokens, torch.randint(0, vocab, (extra,))])
        pos = torch.cat([positions, torch.randint(0, 16, (extra,))])
        with torch.inference_mode():
            hidden, features = runner.model(ids, pos, batch, cache, (0,))
        logits = runner.model.compute_logits(hidden[: len(tokens)])
        return logits, features[: len(tokens)], (cache.k.clone(), cache.v.clone())

    exact = forward(0, 0)
    # Padding rows (random ids and positions) and empty windows, as a captured step has them.
    padded = forward(next_pow2(len(tokens) + 1), num_requests + 2)
    # Agreement to fp32 rounding, not bit for bit: BLAS may block a matmul differently for more rows, and
    # a random seed now and then lands an element just past assert_close's default 1e-5 (1.1e-5 seen).
    torch.testing.assert_close(padded[0], exact[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(padded[1], exact[1], atol=1e-4, rtol=1e-4)
    # The step's own keys agree to rounding too; every
    # other cache slot is untouched, bit for bit: padding stored nothing.
    written = torch.zeros(cache.k.shape[1] * PAGE, dtype=torch.bool)
    written[AttentionBatch.build(pages, starts, lens, PAGE, True, torch.device("cpu")).slots] = True
    for after_padded, after_exact, untouched in zip(padded[2], exact[2], before, strict=True):
        flat_padded = after_padded.flatten(1, 2)
        torch.testing.assert_close(
            flat_padded[:, written], after_exact.flatten(1, 2)[:, written], atol=1e-4, rtol=1e-4
        )
        assert torch.equal(flat_padded[:, ~written], untouched.flatten(1, 2)[:, ~written]), "padding wrote"


def test_padded_layout_marks_padding_tokens_and_windows() -> None:
    batch = AttentionBatch.build([[3, 1], [0]], [5, 0], [2, 1], PAGE, True, torch.device("cpu"), 8, 4)
    assert batch.cu_seqlens_q.tolist() == [0, 2, 3, 3, 3]
    assert batch.kv_lens.tolist() == [7, 1, 0, 0]
    assert batch.slots.tolist() == [1 * PAGE + 1, 1 * PAGE + 2, 0, -1, -1, -1, -1, -1]
    assert batch.page_table.shape == (4, 2)


@pytest.mark.parametrize(
    ("spec_mode", "planned"), [("off", False), ("static", False), ("compact", False), ("compact", True)]
)
def test_engine_through_emulated_graphs_gives_the_eager_tokens(
    tiny_target_dir, tiny_drafter_dir, spec_mode, planned, tmp_path
) -> None:
    # Emulated graphs run the forward eagerly from the static buffers: the copying, padding and tier
    # logic of a replay is exercised on any machine, with every kind of step (prefill chunks, mixed).
    # `compact` with the flat table (the default) drafts inside the target step as `static` does; with a
    # table under which verifying costs (`planned`) it drafts apart and plans from the confidences.
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 30))] for _ in range(7)]
    table = decaying_sps_table(tmp_path) if planned else ""
    # No prompt lookup: blocks drafted inside the target step never copy, eager ones would, and the
    # accepted counts below compare the drafter's own drafts.
    config = emulated_graphs_config(
        tiny_target_dir, tiny_drafter_dir, spec_mode=spec_mode, sps_table=table, prompt_lookup=False
    )
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    eager = LLM(config).generate(params=params, prompt_token_ids=prompts)
    for draft_graphs in (False, True):
        llm = LLM(config)
        runner = llm.engine.runner
        runner.use_graphs(CudaGraphs(runner.model, runner.cache, runner.device, 32, 4, emulate=True))
        if draft_graphs and spec_mode != "off":
            # Blocks replayed too; `static` ones draft inside the target step, from its layout.
            llm.engine.proposer.use_graphs(config.max_num_seqs, max_pages=64, emulate=True)
        replayed = llm.generate(params=params, prompt_token_ids=prompts)
        assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]
        # The same drafts, not only the same output (which any drafts would give): the same ones
        # accepted, and some are.
        accepted = [o.spec_stats.accepted_tokens for o in replayed]
        assert accepted == [o.spec_stats.accepted_tokens for o in eager]
        assert spec_mode == "off" or sum(accepted) > 0
        tiers = set(runner.graphs.captured)
        assert len(tiers) > 2, tiers
        assert llm.engine.allocator.num_used == 0
        if draft_graphs and spec_mode != "off":
            graphs = llm.engine.proposer.graphs
            assert bool(graphs.captured_in_step) == (not planned), graphs.captured_in_step
            assert bool(graphs.captured) == planned, graphs.captured


def test_graphs_captured_at_start_up_serve_every_step(tiny_target_dir, tiny_drafter_dir) -> None:
    # Start-up capture covers every tier a step or a draft block can take: generation captures nothing.
    config = emulated_graphs_config(tiny_target_dir, tiny_drafter_dir)
    llm = LLM(config)
    engine = llm.engine
    runner = engine.runner
    runner.use_graphs(CudaGraphs(runner.model, runner.cache, runner.device, 32, 4, emulate=True))
    engine.proposer.use_graphs(config.max_num_seqs, max_pages=64, emulate=True)
    engine._capture_graphs()
    graphs = engine.proposer.graphs
    target_tiers, draft_tiers = set(runner.graphs.captured), set(graphs.captured)
    assert {key[:2] for key in target_tiers} == set(all_tiers(32, 4))
    assert draft_tiers == {1, 2, 4}
    assert set(graphs.captured_in_step) == {1, 2, 4}  # `static` (the default) drafts in the step
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 30))] for _ in range(6)]
    llm.generate(params=SamplingParams(max_tokens=12, ignore_eos=True), prompt_token_ids=prompts)
    assert set(runner.graphs.captured) == target_tiers
    assert set(graphs.captured) == draft_tiers
    assert set(graphs.captured_in_step) == {1, 2, 4}


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_a_collection_during_a_capture_cannot_free_a_dropped_graph() -> None:
    """A dropped engine's graphs in a reference cycle are freed by the cyclic collector whenever an
    allocation triggers it; inside another capture, destroying a graph invalidates that capture and
    leaves the CUDA generator in capture mode (every later random op of the process failed, as
    tests/test_draft_context.py did after test_draft_length on the H200). Here the captured call itself
    drops a graph into a cycle and allocates with the collector set to run on nearly every allocation:
    the capture must hold collections off."""
    device = torch.device("cuda")
    x = torch.ones(4, device=device)
    dropped = [capture_graph(lambda: (x + 1,), device, None)[0]]
    threshold = gc.get_threshold()

    def call() -> tuple[torch.Tensor]:
        if torch.cuda.is_current_stream_capturing() and dropped:
            cycle: list[object] = [dropped.pop()]
            cycle.append(cycle)  # only the cyclic collector frees it
            del cycle
            gc.set_threshold(1, 1, 1)
            _ = [[object() for _ in range(50)] for _ in range(50)]  # allocations that trigger it
            gc.set_threshold(*threshold)
        return (x * 2,)

    try:
        graph, (out,) = capture_graph(call, device, None)
    finally:
        gc.set_threshold(*threshold)
    assert not dropped, "the graph was dropped inside the capture"
    gc.collect()  # frees it now, outside any capture
    x.fill_(3.0)
    graph.replay()
    torch.testing.assert_close(out, torch.full_like(x, 6.0))
    torch.randn(4, device=device)  # the generator is not left in capture mode


@pytest.mark.gpu
@gpu
def test_graphs_dropped_while_a_step_output_is_held_capture_again(tiny_target_dir) -> None:
    """Dropping every graph (release, a new feature sink) while a replayed step's output is still held
    keeps a block of their pool allocated; the next capture must not go into that dead pool (PyTorch
    asserts `use_count > 0` there), and it gives the same hidden states."""
    config = EngineConfig(model=str(tiny_target_dir), spec_mode="off", num_kv_pages=64, kv_page_size=PAGE)
    runner = ModelRunner.create(config, torch.device("cuda"), torch.float32)
    graphs = CudaGraphs(runner.model, runner.cache, runner.device, 8, 2)
    step = (torch.tensor([1, 2, 3]), [[0]], [0], [3], ())
    held = []  # views of each capture's output, alive across the drops
    with torch.inference_mode():
        for drop in (graphs.release, lambda: graphs.set_feature_sink(None), None):
            out = graphs.run(*step)
            assert out is not None
            held.append(out.hidden)
            if drop is not None:
                drop()
                assert not graphs.captured
    torch.testing.assert_close(held[1], held[0])
    torch.testing.assert_close(held[2], held[0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("spec_mode", "planned"), [("off", False), ("static", False), ("compact", False), ("compact", True)]
)
def test_graphs_give_the_eager_engines_tokens(
    smollm2_dir, smollm2_drafter_dir, spec_mode, planned, tmp_path
) -> None:
    # `planned`: a table under which verifying costs, so `compact` drafts apart and plans its windows.
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    base = EngineConfig(
        model=str(smollm2_dir),
        draft_model=str(smollm2_drafter_dir),
        spec_mode=spec_mode,
        sps_table=decaying_sps_table(tmp_path) if planned else "",
        device="cuda",
        adaptive_speculation=False,
        num_kv_pages=512,  # a set cache: the xdist workers share the GPU
    )
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    outputs = {}
    for graphs in (0, 256):
        llm = LLM(base.replace(cuda_graph_max_tokens=graphs))
        assert (llm.engine.runner.graphs is not None) == bool(graphs)
        # One by one (batch 1, verify windows alone) and all together (mixed steps).
        alone = [llm.generate(params=params, prompt_token_ids=[p])[0] for p in prompts]
        together = llm.generate(params=params, prompt_token_ids=prompts)
        # Drafts may round differently (a padded block batch splits attention differently in bf16), so
        # acceptance may differ; tokens may not. tests/test_draft_context.py checks the drafts in fp32.
        outputs[graphs] = [o.token_ids for o in [*alone, *together]]
        if graphs:
            assert llm.engine.runner.graphs.captured, "no step replayed a graph"
            if spec_mode != "off":
                assert llm.engine.proposer.graphs.captured, "no block replayed a draft graph"
        llm.engine.close()
    assert outputs[256] == outputs[0]


def _smollm2_prompts(seed: int, count: int, longest: int) -> list[list[int]]:
    """`count` prompts of 3 to `longest` random SmolLM2 token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, longest))] for _ in range(count)]


def _smollm2_fp32_gpu(smollm2_dir, smollm2_drafter_dir, **changes) -> EngineConfig:
    """SmolLM2 and its drafter in fp32 on the GPU (exact greedy comparisons), with a set cache: the
    xdist workers share the GPU."""
    config = EngineConfig(
        model=str(smollm2_dir),
        draft_model=str(smollm2_drafter_dir),
        device="cuda",
        dtype="float32",
        num_kv_pages=512,
    )
    return config.replace(**changes)


@pytest.mark.gpu
@gpu
def test_sampling_with_speculation_on_the_gpu(smollm2_dir, smollm2_drafter_dir) -> None:
    """Sampling requests on the GPU path: drafts sampled on the device, windows judged by the rejection
    kernel, first tokens drawn by the exponential-race kernel. Seeded streams replay, greedy requests
    in the same batch keep plain decoding's tokens, and sampled drafts do get accepted."""
    prompts = _smollm2_prompts(1, 6, 30)
    sampled = [SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=10 + i) for i in range(3)]
    greedy = [SamplingParams(max_tokens=32, ignore_eos=True) for _ in range(3)]
    base = _smollm2_fp32_gpu(smollm2_dir, smollm2_drafter_dir, adaptive_speculation=False)
    llm = LLM(base.replace(spec_mode="static"))
    first = llm.generate(params=[*sampled, *greedy], prompt_token_ids=prompts)
    again = llm.generate(params=[*sampled, *greedy], prompt_token_ids=prompts)
    llm.engine.close()
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert sum(o.spec_stats.accepted_tokens for o in first[:3]) > 0, "no sampled draft was accepted"
    plain = LLM(base.replace(spec_mode="off"))
    expected = plain.generate(params=greedy, prompt_token_ids=prompts[3:])
    plain.engine.close()
    assert [o.token_ids for o in first[3:]] == [o.token_ids for o in expected]


@pytest.mark.gpu
@gpu
def test_static_steps_draft_inside_the_target_step_on_the_gpu(smollm2_dir, smollm2_drafter_dir) -> None:
    """fp32 on the GPU: `static` steps draft from the target graphs' layout (the in-step block is
    replayed), and greedy tokens equal plain decoding's, alone and in mixed batches with prompt chunks;
    the drafts are real ones (some are accepted)."""
    prompts = _smollm2_prompts(2, 9, 60)
    base = _smollm2_fp32_gpu(
        smollm2_dir,
        smollm2_drafter_dir,
        adaptive_speculation=False,
        max_num_batched_tokens=64,  # prompt chunks share steps with verify windows
    )
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(base.replace(spec_mode="off"))
    expected = [o.token_ids for o in plain.generate(params=params, prompt_token_ids=prompts)]
    plain.engine.close()
    llm = LLM(base.replace(spec_mode="static"))
    graphs = llm.engine.proposer.graphs
    in_step_counts: list[int] = []
    run_in_step = graphs.run_in_step
    graphs.run_in_step = lambda count: in_step_counts.append(count) or run_in_step(count)
    outputs = llm.generate(params=params, prompt_token_ids=prompts)
    llm.engine.close()
    assert [o.token_ids for o in outputs] == expected
    assert in_step_counts and max(in_step_counts) > 1, "no step drafted inside the target step"
    assert sum(o.spec_stats.accepted_tokens for o in outputs) > 0


def test_capture_budget_keeps_the_tiers_whose_estimated_graph_memory_fits(
    tiny_target_dir, monkeypatch
) -> None:
    """On a GPU a rank captures the smallest tiers first, while their estimated graph memory fits what
    is free (the device's free memory plus the allocator's unused cache); emulated, every tier."""
    config = EngineConfig(model=str(tiny_target_dir), spec_mode="off", num_kv_pages=64, kv_page_size=PAGE)
    runner = ModelRunner.create(config, torch.device("cpu"), torch.float32)
    tiers = [1, 2, 4, 8, 16, 32, 60, 96, 112]
    graphs = SimpleNamespace(
        token_tiers=tiers,
        max_requests=4,
        emulate=False,
        device=torch.device("cuda", 0),
        model=runner.model,
        cache=runner.cache,
    )

    def needed(count: int, layers: tuple[int, ...]) -> int:
        plan = all_tiers(tiers[:count], 4)
        return CAPTURE_SAFETY * capture_bytes(graphs, plan, layers) + CAPTURE_RESERVE_BYTES

    cached = 3 << 20  # reserved by the allocator, unused: free for a capture
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * cached)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 9 * cached)
    for free, layers, expected in [
        (needed(7, ()), (), tiers[:7]),
        (needed(7, ()) - 1, (), tiers[:6]),
        (needed(7, ()), (0, 1), tiers[:6]),  # captured features are graph outputs too
        (needed(len(tiers), ()), (), tiers),
        (CAPTURE_RESERVE_BYTES, (), []),
    ]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free - cached, 1 << 40))
        assert capture_budget(graphs, layers) == expected, (free, layers)
    # The estimate: every graph's outputs, plus one forward's activations at the largest tier.
    assert needed(7, (0, 1)) > needed(7, ()) > needed(6, ())
    graphs.emulate = True
    assert capture_budget(graphs, ()) == tiers


@pytest.mark.gpu
@gpu
def test_switching_draft_lengths_launched_ahead_keep_plain_greedy_tokens_on_the_gpu(
    smollm2_dir, smollm2_drafter_dir
) -> None:
    """fp32 on the GPU at batch 64: a gate that changes the draft length at random every step (plain
    steps and drafting ones of every length, each launched ahead of the one before through the captured
    graphs) gives plain decoding's greedy tokens, and so does the real gate timing real steps."""
    prompts = _smollm2_prompts(3, 64, 40)
    base = _smollm2_fp32_gpu(smollm2_dir, smollm2_drafter_dir, num_kv_pages=1024, max_num_seqs=64)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = LLM(base.replace(spec_mode="off"))
    expected = [o.token_ids for o in plain.generate(params=params, prompt_token_ids=prompts)]
    plain.engine.close()
    llm = LLM(base)
    gated = [o.token_ids for o in llm.generate(params=params, prompt_token_ids=prompts)]
    engine = llm.engine
    engine.gate = RandomLengthGate(engine.limits.block_size, random.Random(4))
    before = engine.load().loop
    switching = [o.token_ids for o in llm.generate(params=params, prompt_token_ids=prompts)]
    after = engine.load().loop
    engine.close()
    assert after.ahead_steps - before.ahead_steps > 32, "steps did not go ahead of each other"
    assert after.graph_steps - before.graph_steps > 32, "steps did not replay graphs"
    assert switching == expected
    assert gated == expected
