"""Decode bursts: several plain greedy steps launched from one schedule (`EngineConfig.decode_burst`).

A small target's decode step is shorter on the device than the host's work around it (scheduling,
layout, acceptance, commit, emit: SmolLM2 at batch 64 on an H200 keeps its GPU busy ~40% of the time).
When a step is plain decoding and every request decides its tokens on the device by the argmax, the
next step's windows are known in advance but for their anchors: each window starts one position later
and its anchor is the argmax of the step before. A burst therefore schedules once, reserves pages for
`length` positions per request, and launches `length` steps back to back, each taking its anchors from
the argmax of the step before on the device: replayed from CUDA graphs, the static layout moves on by
itself (every start + 1, the anchors copied in: `ModelRunner.run_following`); run eagerly, step j is
packed from the same schedule (starts + j) with those anchors as deferred inputs (as a step launched
ahead takes them). The host neither waits nor schedules in between.
Each step's argmax is copied to the host behind an event; the engine commits the burst's tokens per
request in one go (a request that ends inside a burst keeps its tokens up to its end; the steps after
it computed rows that are dropped). The output is that of the same plain steps one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.scheduler import InFlight, StepSchedule
from dspark.engine.step import pack_step
from dspark.runner.model_runner import ModelRunner
from dspark.spec.accept import QueuedGreedyAcceptance, queue_greedy_accept
from dspark.spec.verify_policy import VerifyPlan


@dataclass(frozen=True)
class LaunchedBurst:
    """A burst whose steps are queued on the device: the schedule they share and every step's argmax
    per decode window ([steps, windows], its copy to the host under way)."""

    schedule: StepSchedule
    length: int  # steps in the burst (tokens it commits per request, at most)
    copy: QueuedGreedyAcceptance
    graph: bool  # whether its steps replay captured graphs

    def tokens(self) -> list[list[int]]:
        """Per decode window, its tokens in step order (waits for the copy)."""
        flat = self.copy.result().bonus
        num = len(self.schedule.decode)
        return [flat[r::num] for r in range(num)]


def launch_burst(
    runner: ModelRunner, schedule: StepSchedule, capture_layers: tuple[int, ...], length: int
) -> LaunchedBurst:
    """Launch `length` plain greedy steps of `schedule`'s decode windows (no prefill), the pages of
    every request reserved for them; nothing waits for the device here."""
    assert not schedule.prefill and length >= 1
    decode = schedule.decode
    num = len(decode)
    plan = VerifyPlan.plain(num)
    first = pack_step(schedule, plan, capture_layers, fp32_logits=False).step
    graph = runner.replays(first)
    result = runner.run(first)
    assert result.argmax is not None
    tokens = torch.empty(length, num, dtype=torch.long, device=result.argmax.device)
    tokens[0].copy_(result.argmax[:num])
    follows = {seq: r for r, seq in enumerate(decode)}
    for j in range(1, length):
        # Replayed: the static layout moves on by itself (no packing, no copy from the host).
        if graph and runner.run_following(first, tokens[j - 1], tokens[j]):
            continue
        # Eager: step j packed from the schedule, its anchors step j - 1's, deferred to the device.
        earlier = queue_greedy_accept(plan.verify_lens, plan.commit_caps, None, tokens[j - 1])
        in_flight = InFlight({seq: j for seq in decode}, {}, frozenset(), follows)
        packed = pack_step(schedule, plan, capture_layers, in_flight, earlier, fp32_logits=False)
        argmax = runner.run(packed.step).argmax
        assert argmax is not None
        tokens[j].copy_(argmax[:num])
    flat = tokens.flatten()
    zeros = (0,) * flat.shape[0]
    return LaunchedBurst(schedule, length, queue_greedy_accept(zeros, zeros, None, flat), graph)
