"""Decode bursts: several greedy steps launched from one schedule (`EngineConfig.decode_burst`).

A small target's decode step is shorter on the device than the host's work around it (scheduling,
layout, acceptance, commit, emit: SmolLM2 at batch 64 on an H200 keeps its GPU busy 30-45% of the
time). When every request decides its tokens on the device by the argmax and the drafts (if any) are
made inside the target step, the next step's windows are known in advance but for what the device
decides: each window starts where the step before left it and its anchor is that step's last token.
A burst therefore schedules and plans once, reserves pages for every position its steps may reach, and
launches its steps back to back, the host neither waiting nor scheduling in between:

- plain steps (no drafts): replayed from CUDA graphs, the static layout moves on by itself (every
  start + 1, the anchors copied in from the previous argmax: `ModelRunner.run_following`); run
  eagerly, step j is packed from the same schedule (starts + j) with those anchors as deferred inputs
  (`StepOutputs`). Every step's argmax goes into one [steps, windows] tensor, copied to the host once;
- speculative steps (drafts made inside the step, `static` or `compact` under a flat table): replayed
  from CUDA graphs, the static layout moves on by itself (every start on by the drafts the step before
  accepted and its anchor, the anchors written: `ModelRunner.run_following`), the in-step draft block
  drafts into it again and the graph replays; run eagerly, step j is packed from the schedule (starts +
  j) and completed on the device from the steps before (`DeferredInputs` of `StepOutputs`: the drafts
  they accepted in all, and the last token committed), as a step launched ahead is. Each step's greedy
  acceptance is queued (kernel and copy to the host) before the next is launched.

With overlap scheduling a burst replayed from graphs is launched behind the step or burst still on the
device, as a step launched ahead is (`LLMEngine._launch_ahead`): its first step's windows are completed
on the device from that one's outputs (`LaunchedBurst.outputs`: the drafts accepted over its steps and
its last tokens), and its later steps move the static layout on from there; the device then never
waits for the host between bursts. Eager bursts wait for the step before (their later steps are packed
from the schedule, which would leave the one in flight out).

The engine commits the burst's tokens per request in one go (a request that ends inside a burst keeps
its tokens up to its end; the steps after it computed rows that are dropped). The output is that of the
same steps one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.scheduler import InFlight, StepSchedule
from dspark.engine.step import LaunchedStep, PackedStep, pack_step, queue_greedy
from dspark.runner.host_to_device import to_device
from dspark.runner.model_runner import ModelRunner, TargetStep
from dspark.spec.accept import QueuedGreedyAcceptance, copy_together, queue_greedy_accept, window_bounds
from dspark.spec.verify_policy import VerifyPlan


@dataclass(frozen=True)
class StepOutputs:
    """What a burst's next step, packed from the schedule, takes from the steps before it
    (`DeferredInputs`): per window, the drafts they accepted in all (None: none verified) and the
    token committed last, on the device."""

    accepted: torch.Tensor | None
    bonus: torch.Tensor

    def per_output(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(drafts accepted, last token) per window, as `QueuedGreedyAcceptance.per_output`."""
        return self.accepted, self.bonus


@dataclass(frozen=True)
class LaunchedBurst:
    """A burst whose steps are queued on the device: the schedule and plan they share, how many, what
    accepting them reads: for plain steps every step's argmax per decode window ([steps, windows],
    `copy`, its copy to the host under way); for speculative ones each step and its queued acceptance
    (`steps`); and what a step launched behind the burst takes from it (`outputs`: per window the
    drafts accepted over all its steps and its last token, on the device)."""

    schedule: StepSchedule
    plan: VerifyPlan
    length: int  # steps in the burst
    graph: bool  # whether its steps replay captured graphs
    outputs: StepOutputs
    copy: QueuedGreedyAcceptance | None = None
    steps: tuple[tuple[LaunchedStep, QueuedGreedyAcceptance], ...] = ()

    def plain_tokens(self) -> list[list[int]]:
        """A plain burst's tokens per decode window, in step order (waits for the copy)."""
        assert self.copy is not None
        flat = self.copy.result().bonus
        num = len(self.schedule.decode)
        return [flat[r::num] for r in range(num)]


def launch_burst(
    runner: ModelRunner,
    schedule: StepSchedule,
    plan: VerifyPlan,
    first: PackedStep,
    capture_layers: tuple[int, ...],
    length: int,
) -> LaunchedBurst:
    """Launch `length` greedy steps of `schedule`'s decode windows (no prefill) under `plan`, the first
    packed already (`first`), the pages of every request reserved for all of them; nothing waits for
    the device here. A first step packed behind a step still in flight (its windows completed on the
    device from that step: `first.step.deferred`) must replay a graph: the later steps then move the
    static layout on from wherever the first one's windows started, where packing them from the
    schedule would leave the step in flight out."""
    assert not schedule.prefill and length >= 1
    graph = runner.replays(first.step)
    assert graph or first.step.deferred is None, "a burst behind a step in flight replays graphs"
    if plan.drafts is None:
        return _launch_plain(runner, schedule, plan, first.step, capture_layers, length)
    decode = schedule.decode
    follows = {seq: r for r, seq in enumerate(decode)}
    steps: list[tuple[LaunchedStep, QueuedGreedyAcceptance]] = []
    packed = first
    result = runner.run(first.step)
    # Each window's anchor row among the packed tokens (the windows lie back to back), on the device
    # once a burst: where a replayed step writes the anchors.
    anchor_rows = to_device(torch.tensor(first.logit_offsets[: len(decode)], dtype=torch.long), runner.device)
    accepted: torch.Tensor | None = None
    # The steps share the plan, and so the accept kernel's window bounds; their acceptances come to the
    # host in one copy, queued after the last step (`copy_together`).
    lens, caps = plan.verify_lens, plan.commit_caps
    bounds = window_bounds(lens, caps, runner.device) if any(lens) else None
    for j in range(length):
        launched = LaunchedStep(schedule, plan, packed, result)
        queued = queue_greedy(plan, launched.drafts, result, bounds, copy=False)
        steps.append((launched, queued))
        if queued.accepted is not None:
            accepted = queued.accepted if accepted is None else accepted + queued.accepted
        if j == length - 1:
            break
        # Replayed: the static layout moves on by itself (no packing, no copy from the host).
        following = None
        if graph:
            following = runner.run_following(first.step, queued.bonus, queued.accepted, anchor_rows)
        if following is None:  # eager: packed from the schedule, completed from the steps before
            assert first.step.deferred is None, "packing from the schedule leaves the step in flight out"
            in_flight = InFlight({seq: j + 1 for seq in decode}, {}, frozenset(), follows)
            earlier = StepOutputs(accepted, queued.bonus)
            packed = pack_step(schedule, plan, capture_layers, in_flight, earlier, fp32_logits=False)
            following = runner.run(packed.step)
        result = following
    outputs = StepOutputs(accepted, steps[-1][1].bonus)
    copied = copy_together([queued for _, queued in steps])
    together = tuple((launched, queued) for (launched, _), queued in zip(steps, copied, strict=True))
    return LaunchedBurst(schedule, plan, length, graph, outputs, steps=together)


def _launch_plain(
    runner: ModelRunner,
    schedule: StepSchedule,
    plan: VerifyPlan,
    first: TargetStep,
    capture_layers: tuple[int, ...],
    length: int,
) -> LaunchedBurst:
    """`launch_burst` of plain steps."""
    decode = schedule.decode
    num = len(decode)
    graph = runner.replays(first)
    argmax = runner.run(first).argmax
    assert argmax is not None
    tokens = torch.empty(length, num, dtype=torch.long, device=argmax.device)
    tokens[0].copy_(argmax[:num])
    follows = {seq: r for r, seq in enumerate(decode)}
    for j in range(1, length):
        # Replayed: the static layout moves on by itself (no packing, no copy from the host).
        result = runner.run_following(first, tokens[j - 1]) if graph else None
        if result is None:  # eager: step j packed from the schedule, its anchors step j - 1's, deferred
            assert first.deferred is None, "packing from the schedule leaves the step in flight out"
            in_flight = InFlight({seq: j for seq in decode}, {}, frozenset(), follows)
            earlier = StepOutputs(None, tokens[j - 1])
            packed = pack_step(schedule, plan, capture_layers, in_flight, earlier, fp32_logits=False)
            result = runner.run(packed.step)
        assert result.argmax is not None
        tokens[j].copy_(result.argmax[:num])
    flat = tokens.flatten()
    zeros = (0,) * flat.shape[0]
    copy = queue_greedy_accept(zeros, zeros, None, flat)
    return LaunchedBurst(schedule, plan, length, graph, StepOutputs(None, tokens[-1]), copy=copy)
