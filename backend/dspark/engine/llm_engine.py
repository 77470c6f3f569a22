"""LLMEngine: continuous batching with DSpark speculative decoding, one step at a time.

A step is a sequence of values (`dspark.engine.step`; docs/step_pipeline.md): the scheduler's StepSchedule
-> the Drafts of every decoding request (one drafter pass) -> the VerifyPlan of the configured
VerifyPolicy -> one target forward over the packed verify windows and prefill chunks (TargetResult;
its captured features go straight into the draft cache, the runner's feature sink) -> Acceptance ->
the committed tokens, emitted as deltas.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from dspark.config import GPU_DECODE_BURST, SPS_PROFILE, EngineConfig
from dspark.engine.burst import LaunchedBurst, launch_burst
from dspark.engine.kv_budget import resolve_kv_pages
from dspark.engine.output_processor import OutputProcessor, PendingDelta
from dspark.engine.page_allocator import PageAllocator
from dspark.engine.scheduler import InFlight, Scheduler, StepSchedule
from dspark.engine.step import (
    Acceptance,
    Committed,
    EarlierOutputs,
    LaunchedStep,
    PackedStep,
    WindowAcceptance,
    accept,
    pack_step,
    queue_greedy,
    verified_drafts,
)
from dspark.engine.step_timer import LoopCounters, StepTimer
from dspark.outputs import EngineLoad, RequestDelta, SpecStats, TokenLogprobs
from dspark.prompts import check_prompt
from dspark.runner.cuda_graphs import max_pages_per_request
from dspark.runner.host_to_device import to_device
from dspark.runner.model_runner import ModelRunner, create_runner
from dspark.runner.models.loader import resolve_device, resolve_dtype
from dspark.sampling.logprobs import LogprobsFormatter, gather_logprobs
from dspark.sampling.penalties import PenaltyState, PenaltyWindow, apply_penalties, window_needs_adjusting
from dspark.sampling.sampler import NON_FINITE_TOKEN
from dspark.sampling_params import SamplingParams
from dspark.sequence import Sequence, SequenceStatus
from dspark.spec.accept import QueuedGreedyAcceptance
from dspark.spec.draft_checkpoint import load_drafter
from dspark.spec.draft_vocab import load_draft_vocab
from dspark.spec.drafter import Drafter
from dspark.spec.drafts import Drafts
from dspark.spec.gate import RequestProgress, SpeculationGate
from dspark.spec.lookup import PromptLookup
from dspark.spec.planner import VerifyPlanner
from dspark.spec.proposer import DSparkProposer, Proposer
from dspark.spec.sps_table import SpsTable
from dspark.spec.step_draft import InStepDrafts
from dspark.spec.verify_policy import VerifyPlan, verify_policy
from dspark.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
MEMORY_READ_INTERVAL_S = 0.5  # how stale the load's GPU memory figures may be
GATE_VIEW_INTERVAL_S = 0.5  # how stale the load's view of the gate may be (remade at most this often)
# Requests that came within this many launched steps of each other are one wave: a batch of them, with
# none waiting, runs to its end (`LLMEngine._draining`).
WAVE_STEPS = 4
# A burst may run past the ends of some requests while their dropped rows stay below this share of its
# rows (`_past_some_ends`).
BURST_ENDED_ROWS = 0.25


def device_runs_ahead(device: torch.device) -> bool:
    """Whether a step launched on this device runs while the host goes on (a GPU's queue): where
    `overlap_scheduling` overlaps anything. A CPU runs a step inside its launch, so there overlap would
    only hold each step's tokens back a step (through the server at one stream on a 2-core CPU: TTFT
    p50 51 against 35 ms, the same tokens/s)."""
    return device.type == "cuda"


@dataclass(frozen=True)
class ResolvedLimits:
    """Values derived from the config and the checkpoints (the config keeps what the user wrote)."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    decode_burst: int  # steps a burst runs at most (`decode_burst`, auto resolved; 1: no bursts)


class LLMEngine:
    """The synchronous engine: add requests, call `step()` until none is left."""

    def __init__(self, config: EngineConfig, proposer: Proposer | None = None) -> None:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        # The engine's config has its cache sized (num_kv_pages 0 -> pages): every part reads that.
        loads_drafter = config.speculative and proposer is None
        config = resolve_kv_pages(config, device, dtype, loads_drafter)
        self.config = config
        self.runner = create_runner(config, device, dtype)
        try:
            self._set_up(config, device, dtype, proposer)
        except BaseException:
            self.runner.close()  # no TP worker may outlive a failed start
            raise

    def _set_up(
        self, config: EngineConfig, device: torch.device, dtype: torch.dtype, proposer: Proposer | None
    ) -> None:
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        cfg = self.runner.model_config
        self.model_config = cfg
        page_size = config.kv_page_size
        drafter = None
        if not config.speculative:
            proposer = None
        elif proposer is None:
            drafter = load_drafter(config.draft_model_path, dtype=dtype, device=device)
            if drafter.config.vocab_size != cfg.vocab_size:
                raise ValueError("draft_model: vocabulary size differs from the target's")
        # The block size: the configured one, at most what the drafter drafts (0 takes all of it).
        block_size = 0
        if proposer is not None or drafter is not None:
            most = proposer.block_size if proposer is not None else drafter.config.block_size
            if config.block_size > most:
                raise ValueError(f"block_size: the drafter drafts at most {most}")
            block_size = config.block_size or most
        # The planner's table, unless it is measured at start-up (`profile`, below): a flat one lets
        # `compact` draft inside the target step.
        given_table = None if config.sps_table == SPS_PROFILE else _given_sps_table(config.sps_table)
        # How steps verify (one policy per spec_mode, chosen once; the engine asks it, never the mode).
        flat_table = given_table is not None and given_table.is_flat
        self.policy = verify_policy(config, block_size, flat_table)
        if drafter is not None:
            proposer = self._dspark_proposer(config, drafter, block_size, device)
        self.proposer = proposer
        if self.proposer is not None:
            # Every window row is injected, rejected drafts' rows too: a position's draft KV is read only
            # once the position is committed, and the step that commits it injects its true features.
            # A step that verifies no draft keeps its features for the drafter's next block instead
            # (`TargetStep.keep_features`).
            keeps = isinstance(self.proposer, DSparkProposer)
            self.runner.set_feature_consumer(self.proposer, keeps)
        # How many drafts each step verifies, from the measured speed of earlier steps (None: the block).
        self.gate = (
            SpeculationGate(block_size) if self.proposer is not None and config.adaptive_speculation else None
        )
        # What the step just completed tells the gate (per step, the tokens each request committed and
        # the drafts it verified), told at the end of the call, once its tokens are emitted.
        self._gate_report: tuple[list[list[int]], list[list[int]] | None] | None = None
        # Target layers whose outputs the drafter takes (none without speculation).
        self._capture_layers = tuple(self.proposer.target_layer_ids) if self.proposer is not None else ()
        # Positions a decoding request may touch past its cache: its verify window, and the proposer's
        # block (a proposer given from outside may draft more positions than the engine verifies).
        window_positions = max(block_size + 1, self.proposer.block_size if self.proposer is not None else 0)
        capacity = config.num_kv_pages * page_size - window_positions
        limit = min(
            config.max_model_len or cfg.max_position_embeddings,
            cfg.max_position_embeddings - window_positions,
        )
        if capacity < 2:
            raise ValueError("num_kv_pages: the KV cache cannot hold even one request")
        burst = config.decode_burst or (GPU_DECODE_BURST if device_runs_ahead(device) else 1)
        self.limits = ResolvedLimits(device, dtype, block_size, min(limit, capacity), burst)
        self.loop_counters = LoopCounters()
        # Per-phase step timing: the host's time into the loop counters always, the device-synchronised
        # split only when a benchmark or profiler turns it on.
        self.timer = StepTimer(device, self.loop_counters)
        # True: the text of a request whose token ids decide its finish (no stop strings) is left to
        # the deltas' receiver (`RequestDelta.text_pending`): the engine process leaves it to the
        # adapter's process, off the step loop's thread; `LLM.generate` makes it when a request ends.
        self.defer_text = False
        self._memory = (0, 0)  # GPU memory allocated and reserved, bytes, as last read (see `load`)
        self._memory_read_at = -MEMORY_READ_INTERVAL_S
        self.allocator = PageAllocator(config.num_kv_pages, page_size)
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            window_positions,
            self.limits.max_model_len,
        )
        self._capture_graphs()
        sps = given_table if given_table is not None else self._profiled_sps_table(config, block_size)
        self.planner = VerifyPlanner(config.planner_policy, sps, config.planner_lag)
        self.total_spec_stats = SpecStats()
        self._spec_snapshot: SpecStats | None = None  # a copy of the totals for `load`, made on change
        self._gate_view: tuple[float, ...] = ()  # the gate's view for `load`, and when it was made
        self._gate_view_at = float("-inf")
        self._gate_view_stale = False  # the gate was told of a step after the view was made
        self._seqs: dict[str, Sequence] = {}
        self._outputs: dict[str, OutputProcessor] = {}
        # History counts of the requests with penalties (on the device), by request id.
        self._penalty_states: dict[str, PenaltyState] = {}
        # The unfinished requests whose tokens the host decides (`_decides_on_the_device`): a step goes
        # ahead of the one before only while none of them runs.
        self._host_decides: set[Sequence] = set()
        self._logprobs_formatter = LogprobsFormatter(self.tokenizer)
        self._pending: list[RequestDelta] = []  # failed before they ran
        self._aborts: list[str] = []
        # overlap_scheduling, where the device runs a step while the host goes on (not a CPU's).
        self.overlaps = config.overlap_scheduling and device_runs_ahead(device)
        # With it: launched, not yet accepted (a step, or a burst of steps)
        self._in_flight: LaunchedStep | LaunchedBurst | None = None
        # The last step launched took prompts in: with bursts, the next one leaves newer prompts waiting
        # (one burst at most) so that it may burst (`_defers_prompts`).
        self._took_prompts = False
        self._arrivals = itertools.count()
        self._latest_arrival_step = 0  # the `arrival_step` of the request that came last
        self._seed_rng = random.Random(config.seed)

    def _dspark_proposer(
        self, config: EngineConfig, drafter: Drafter, block_size: int, device: torch.device
    ) -> DSparkProposer:
        """The DSpark drafter as this engine drafts with it: the target's vocabulary weights, the
        policy's early stop, prompt lookup (`prompt_lookup`), and on CUDA its greedy blocks in graphs."""
        embedding, lm_head = self.runner.vocab_weights()
        page_size = config.kv_page_size
        stop = self.policy.draft_stop_survival
        draft_vocab = load_draft_vocab(config.draft_model_path, config.draft_vocab_size, lm_head.shape[0])
        lookup = PromptLookup() if config.prompt_lookup else None
        proposer = DSparkProposer(
            drafter, embedding, lm_head, config.num_kv_pages, page_size, stop, block_size, draft_vocab, lookup
        )
        if device.type == "cuda" and config.cuda_graph_max_tokens > 0:
            max_positions = self.model_config.max_position_embeddings
            proposer.use_graphs(
                config.max_num_seqs, max_pages_per_request(max_positions, page_size, config.num_kv_pages)
            )
        return proposer

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture the CUDA graphs of every step and draft size now: a capture on first use would stall
        that step by far more than the step itself."""
        self.runner.capture_graphs(self._capture_layers)
        if isinstance(self.proposer, DSparkProposer):
            self._drafts_in_step()  # follows the target graphs' layout: its blocks are captured too
            self.proposer.capture_graphs()

    def _drafts_apart(self) -> bool:
        """Whether a step's drafts are made apart from the target step, from the host's state of its
        requests (a drafter that does not draft inside the step): nothing goes ahead of such a step
        or into a burst's defers."""
        return self.proposer is not None and not self._drafts_in_step()

    def _drafts_in_step(self) -> bool:
        """Whether a step's greedy drafts can be made inside the target step, from the target graphs'
        layout (`InStepDrafts`): a policy whose verify lengths do not depend on the drafts, a
        single-process runner with graphs and a drafter with them."""
        runner, proposer = self.runner, self.proposer
        return (
            self.policy.drafts_in_step
            and isinstance(runner, ModelRunner)
            and runner.graphs is not None
            and isinstance(proposer, DSparkProposer)
            and proposer.follow_target_layout(runner.graphs.layout)
        )

    def _profiled_sps_table(self, config: EngineConfig, block_size: int) -> SpsTable:
        """The planner's steps/s table measured now on this runner (`sps_table` profile)."""
        if not self.policy.uses_planner:
            return SpsTable.flat()  # no planner reads it
        from dspark.spec.profile import profile_runner, startup_max_tokens

        limits = self.limits
        table = profile_runner(
            self.runner,
            config,
            startup_max_tokens(config, block_size),
            repeats=3,
            device=str(limits.device),
            dtype=str(limits.dtype).split(".")[-1],
            capture_layers=self._capture_layers,
        )
        logger.info(
            "profiled SPS table: %s", [(p.tokens, round(p.steps_per_second, 1)) for p in table.points]
        )
        return table

    # Requests ---------------------------------------------------------------------------------

    def prepare_prompt(
        self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> list[int]:
        """Validate a request's prompt and return its token ids (InvalidParameterError names the field)."""
        return check_prompt(
            prompt,
            prompt_token_ids,
            params,
            self.tokenizer,
            self.model_config.vocab_size,
            self.limits.max_model_len,
        )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a validated request (see `prepare_prompt`)."""
        if request_id in self._seqs:
            self._pending.append(
                RequestDelta.failed(request_id, f"request_id: {request_id!r} is already running")
            )
            return
        seed = params.seed if params.seed is not None else self._seed_rng.randrange(2**63)
        seq = Sequence(
            request_id=request_id,
            arrival=next(self._arrivals),
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            # On the engine's device: a GPU draws the request's random numbers itself.
            generator=torch.Generator(device=self.limits.device).manual_seed(seed),
            arrival_step=self.loop_counters.steps,
        )
        self._latest_arrival_step = seq.arrival_step
        self._seqs[request_id] = seq
        self._outputs[request_id] = OutputProcessor(
            seq, self.tokenizer, self.eos_token_ids, self.limits.max_model_len
        )
        if params.penalized:
            self._penalty_states[request_id] = PenaltyState(
                seq.prompt_token_ids, [], self.model_config.vocab_size, self.limits.device
            )
        if not _decides_on_the_device(seq):
            self._host_decides.add(seq)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Abort at the next step: pages are freed and a final delta with reason 'abort' is emitted."""
        self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has an undelivered delta, or a step is launched."""
        return bool(self._seqs or self._pending or self._aborts or self._in_flight is not None)

    def load(self) -> EngineLoad:
        """Occupancy snapshot (the device memory figures read the allocator's counters, no sync, at most
        every MEMORY_READ_INTERVAL_S)."""
        device = self.limits.device
        now = time.monotonic()
        if device.type == "cuda" and now - self._memory_read_at >= MEMORY_READ_INTERVAL_S:
            # torch builds its allocator's whole statistics dict in Python for each figure: ~0.1 ms
            # of the GIL, too much for every step (the engine process reports its load with each).
            self._memory = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
            self._memory_read_at = now
        # Remade at most every GATE_VIEW_INTERVAL_S while requests run, and once more when none does: a
        # load shorter than the interval (48 tokens on a GPU) would otherwise leave its first steps' view.
        if self._gate_view_stale and (
            now - self._gate_view_at >= GATE_VIEW_INTERVAL_S or not self.scheduler.running
        ):
            self._gate_view, self._gate_view_at = self.gate.view(), now
            self._gate_view_stale = False
        return EngineLoad(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_used=self.allocator.num_used,
            kv_pages_total=self.allocator.num_pages,
            gpu_memory_allocated_bytes=self._memory[0],
            gpu_memory_reserved_bytes=self._memory[1],
            loop=self.loop_counters.totals(),
            spec=self._spec_totals(),
            gate=self._gate_view,
        )

    def _spec_totals(self) -> SpecStats:
        """A copy of `total_spec_stats`, remade only after a request finished (`load` is read with every
        batch of deltas the engine process sends)."""
        if self._spec_snapshot is None:
            snapshot = SpecStats()
            snapshot.merge(self.total_spec_stats)
            self._spec_snapshot = snapshot
        return self._spec_snapshot

    def close(self) -> None:
        """Release what the engine holds (TP worker processes, when there are any)."""
        self.runner.close()

    # The step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """Run one step and return the deltas it completes: schedule -> drafts -> verify plan -> target
        step -> acceptance -> commit, each stage a new value (`dspark.engine.step`).

        With `overlap_scheduling` (on a GPU) a call accepts and commits the step the previous call launched,
        launches the next one, and makes the committed tokens' text and deltas while the device runs
        it: the call returns with the device busy, and whatever its caller does with the deltas overlaps
        the step too. Without it a call launches a step and waits for it. The scheduling of a step
        follows the acceptance of the one before either way, so both run the same steps."""
        timer = self.timer
        started = timer.start()
        failed, self._pending = self._pending, []
        completed: LaunchedStep | LaunchedBurst | None = None  # what this call accepts and commits
        if self.overlaps:
            earlier, launched, done = self._in_flight, None, []
            completed = earlier
            if earlier is not None:
                launched, queued = self._launch_ahead(earlier)
                done = self._complete(earlier, queued)
            # After the completion: an aborted request's last committed tokens come before its end.
            done += self._apply_aborts()
            if launched is None:
                # Nothing went ahead: the step is done before the next one is prepared.
                self._tell_gate()
                launched = self._launch()
            self._in_flight = launched
        else:
            done = self._apply_aborts()
            launched = completed = self._launch()
            if launched is not None:
                done += self._complete(launched)
        deltas = failed + [pending.make(self.defer_text) for pending in done]
        self._tell_gate()
        if launched is not None or done:
            # A burst's steps count one by one, as the loop's totals count them.
            timer.finish("emit", completed.length if isinstance(completed, LaunchedBurst) else 1)
            prefill = launched is not None and bool(launched.schedule.prefill)
            self.loop_counters.add_call(time.perf_counter() - started, prefill)
        return deltas

    def _tell_gate(self) -> None:
        """Tell the gate the step just completed has finished (`_gate_report`), if not told yet: at the
        end of the call, its tokens emitted (its emitting is its cost, as its preparation is), or before
        a step launched behind its completion rather than ahead of it."""
        if self._gate_report is not None:
            report, self._gate_report = self._gate_report, None
            self.gate.finish_burst(*report)
            self._gate_view_stale = True

    def _launch(
        self, in_flight: InFlight | None = None, earlier: EarlierOutputs | None = None
    ) -> LaunchedStep | LaunchedBurst | None:
        """Schedule a step, draft, plan and queue its target work on the device (None: nothing to run);
        a burst of such steps instead when the step allows one (`_burst_length`).

        in_flight, earlier: the step on the device, not yet accepted, and its queued greedy acceptance
        (`_launch_ahead`); None also when this step cannot go ahead of it after all."""
        timer = self.timer
        began = self.gate.clock() if self.gate is not None else 0.0
        # The gate chooses the step's draft length as the scheduler sizes the windows: a plain step's
        # windows leave their budget to prompts.
        window_of = self._window_of if self.gate is not None else None
        defers = self._defers_prompts()
        schedule = self.scheduler.schedule(in_flight, window_of, admit=not defers)
        if schedule is None or schedule.empty:
            return None
        self._took_prompts = bool(schedule.prefill)
        timer.lap("schedule")
        length = min(self.limits.block_size, schedule.window - 1)
        caps = self._max_verifies(schedule.decode, in_flight, length)
        if self.gate is not None and length > 0 and not any(caps):
            self.gate.withdraw()  # a drafting length chosen, and no request may verify a draft
        drafts = self._draft(schedule.decode, caps)
        timer.lap("draft")
        plan = VerifyPlan.plain(len(caps)) if drafts is None else self.policy.plan(drafts, caps, self.planner)
        timer.lap("plan")
        # Sampling, penalties and logprobs read the logits themselves, in fp32; greedy argmax does not.
        fp32_logits = bool(self._host_decides)
        packed = pack_step(schedule, plan, self._capture_layers, in_flight, earlier, fp32_logits)
        timer.lap("layout")
        if in_flight is not None and plan.drafts is not None and not self.runner.replays(packed.step):
            # In-step drafts of a step that runs eagerly are drafted apart, from the host's state of
            # the requests, which the step in flight has not reached yet.
            return None
        burst = self._burst_length(schedule, plan, packed, in_flight, defers)
        gated = length if drafts is not None else 0
        if burst > 1:
            launched_burst = self._launch_burst(schedule, plan, packed, burst, ahead=in_flight is not None)
            if self.gate is not None:  # its preparation ends with the launch (the gate charges it)
                self.gate.start_step(gated, began, False)
            return launched_burst
        self.loop_counters.add_step(
            len(schedule.decode) + len(schedule.prefill),
            graph=self.runner.replays(packed.step),
            ahead=in_flight is not None,
            prefill=bool(schedule.prefill),
            verify_tokens=sum(plan.verify_lens),
        )
        result = self.runner.run(packed.step)
        timer.lap("target")
        if self.gate is not None:
            self.gate.start_step(gated, began, bool(schedule.prefill))
        return LaunchedStep(schedule, plan, packed, result)

    def _bursts(self) -> bool:
        """Whether the next step may be a burst (`_burst_length` decides once it is planned): bursts can
        run (`_burst_capable`) and no prompt waits, or those that wait are left waiting this step
        (`_defers_prompts`)."""
        return self._burst_capable() and (not self.scheduler.waiting or self._took_prompts)

    def _defers_prompts(self) -> bool:
        """Whether the next step leaves waiting prompts waiting (`Scheduler.schedule`'s `admit`), so
        that it may be a burst: bursts can run, whatever the step drafts (no drafter, or one that
        drafts inside the target step), and the step before took prompts in. Under a steady stream of
        arrivals (a server's load) steps that take prompts in then alternate with bursts instead of
        leaving no step to burst; a prompt waits one burst at most."""
        return self._took_prompts and self._burst_capable() and not self._drafts_apart()

    def _burst_capable(self) -> bool:
        """Bursts on, one rank and every running request decoding on the device
        (`_decides_on_the_device`); whether a step's drafts allow one is `_burst_length`'s to say (the
        gate, if any, times a burst as its steps' share of its wall time: `finish_burst`)."""
        return (
            self.limits.decode_burst > 1
            and isinstance(self.runner, ModelRunner)
            and (not self._host_decides or self._host_decides.isdisjoint(self.scheduler.running))
        )

    def _burst_length(
        self,
        schedule: StepSchedule,
        plan: VerifyPlan,
        first: PackedStep,
        in_flight: InFlight | None,
        defers: bool = False,
    ) -> int:
        """Steps a burst of this planned step runs (`dspark.engine.burst`): `decode_burst`, fewer when a
        request has fewer positions left for them, or where too many of its rows would be for requests
        already ended (`_past_some_ends`); 1 (no burst) when the step carries a
        prefill chunk or prompts wait that it did not leave waiting on purpose (`defers`:
        `_defers_prompts`), drafts apart from the target step or runs them eagerly, when the pages of every
        position the burst may reach cannot be reserved without preempting anyone, or when it goes
        behind a step in flight (`in_flight`) and does not replay graphs (its later steps, packed from
        the schedule, would leave the step in flight out)."""
        if schedule.prefill or not schedule.decode or not self._burst_capable():
            return 1
        if self.scheduler.waiting and not defers:
            return 1  # they wait for seats: the step that frees one takes them in
        if in_flight is not None and not self.runner.replays(first.step):
            return 1
        if plan.drafts is not None and not (
            isinstance(plan.drafts, InStepDrafts) and self.runner.replays(first.step)
        ):
            return 1
        length = self.limits.decode_burst
        max_model_len = self.limits.max_model_len
        # Behind a step in flight a request is past what the host knows of it (`_in_flight_tokens`).
        ahead = self._in_flight_tokens(schedule.decode, in_flight) if in_flight is not None else {}
        left = []  # per request: the tokens it has left once the step in flight committed its least
        for seq, verify_len in zip(schedule.decode, plan.verify_lens, strict=True):
            least, most, _ = ahead.get(seq, (0, 0, 0))
            # Each step moves a request on by 1 to verify_len + 1 positions.
            room = (max_model_len - len(seq.token_ids) - most) // (verify_len + 1)
            length = min(length, room)
            left.append(seq.remaining_tokens - least)
        length = _past_some_ends(length, left)
        if length <= 1:
            return 1
        try_reserve = self.scheduler.allocator.try_reserve
        for seq, verify_len in zip(schedule.decode, plan.verify_lens, strict=True):
            positions = ahead[seq][2] if seq in ahead else seq.num_cached
            if not try_reserve(seq, positions + length * (verify_len + 1)):
                return 1  # pages reserved so far stay with their requests, used by later steps
        if (plan.drafts is not None or in_flight is not None) and not self.runner.replays(first.step):
            # The pages outgrew the graphs' page table: eager steps would draft apart, from the host's
            # state of the requests, which a burst's later steps have left behind (and, behind a step
            # in flight, be packed without it).
            return 1
        return length

    @staticmethod
    def _in_flight_tokens(decode: Seq[Sequence], in_flight: InFlight) -> dict[Sequence, tuple[int, int, int]]:
        """Per decoding request, what the step (or burst) in flight adds to what the host knows of it:
        the tokens it commits at least and at most, and the positions cached once it is accepted, at
        most (where the scheduler lets its next window start). A decode window: its anchors (one token
        each) at least, every draft accepted too at most; a prompt's last chunk: its first token."""
        ahead = {}
        for seq in decode:
            advance, reach = in_flight.advance.get(seq, 0), in_flight.reach.get(seq, 0)
            positions = in_flight.cached(seq) + reach  # a chunk reaches no further than its positions
            if seq.num_cached < seq.prefill_target:  # its prompt's last chunk is in flight
                first = 1 if seq in in_flight.follows else 0
                ahead[seq] = (first, first, positions)
            else:
                ahead[seq] = (advance, advance + reach, positions)
        return ahead

    def _launch_burst(
        self, schedule: StepSchedule, plan: VerifyPlan, first: PackedStep, length: int, ahead: bool = False
    ) -> LaunchedBurst:
        """Launch a burst of `length` steps of `schedule` under `plan` (pages reserved), each counted
        (`ahead`: behind a step in flight)."""
        launched = launch_burst(self.runner, schedule, plan, first, self._capture_layers, length)
        self.loop_counters.bursts += 1
        for _ in range(length):
            self.loop_counters.add_step(
                len(schedule.decode),
                graph=launched.graph,
                ahead=ahead,
                prefill=False,
                verify_tokens=sum(plan.verify_lens),
                burst=True,
            )
        self.timer.lap("target")
        return launched

    def _complete_burst(self, launched: LaunchedBurst) -> list[PendingDelta]:
        """Commit a burst step by step: each request's window outcomes through the usual finish checks
        (EOS, stop ids, max_tokens, context), and its statistics; a request commits nothing after the
        step that ends it, nor anything if it ended while the burst ran (aborted). One delta a request."""
        decode = launched.schedule.decode
        block_size = self.limits.block_size
        outcomes: list[list[WindowAcceptance]] = []
        drafted: list[list[int]] = []
        verified: list[tuple[int, ...]] = []
        if launched.copy is not None:  # plain steps: one copy of every step's argmax
            columns = launched.plain_tokens()
            for j in range(launched.length):
                outcomes.append([WindowAcceptance(0, (column[j],)) for column in columns])
            drafted = verified = [(0,) * len(decode)] * launched.length
        for step, queued in launched.steps:
            drafts = step.drafts
            acceptance = accept(
                step.schedule, step.plan, drafts, step.result, step.packed.logit_offsets, block_size, queued
            )
            outcomes.append(list(acceptance.windows))
            drafted.append(drafts.drafted(block_size) if drafts is not None else [0] * len(decode))
            verified.append(step.plan.verify_lens)
        self.timer.lap("accept")
        processors = {seq: self._outputs[seq.request_id] for seq in decode if not seq.finished}
        appended: dict[Sequence, list[int]] = {seq: [] for seq in processors}
        reasons: dict[Sequence, str] = {}
        committed: list[list[int]] = []  # per step, per request it moved on: tokens committed (the gate)
        lens: list[list[int]] = []  # and the drafts it verified
        for windows, drafted_j, verified_j in zip(outcomes, drafted, verified, strict=True):
            committed.append([])
            lens.append([])
            for r, (seq, window) in enumerate(zip(decode, windows, strict=True)):
                if seq not in processors or seq in reasons:
                    continue
                seq.spec_stats.record_step(drafted_j[r], verified_j[r], window.accepted)
                seq.num_cached += window.accepted + 1
                tokens, reason = processors[seq].commit_ids(window.tokens)
                appended[seq] += tokens
                committed[-1].append(len(tokens))
                lens[-1].append(verified_j[r])
                if reason is not None:
                    reasons[seq] = reason
                    self._finish(seq, reason)
        if self.gate is not None:
            self._gate_report = (committed, lens)
        done = [
            PendingDelta(processor, tuple(appended[seq]), reasons.get(seq))
            for seq, processor in processors.items()
        ]
        self.timer.lap("emit")
        return done

    def _launch_ahead(
        self, earlier: LaunchedStep | LaunchedBurst
    ) -> tuple[LaunchedStep | LaunchedBurst | None, QueuedGreedyAcceptance | None]:
        """Queue the greedy acceptance of `earlier` (on the device, not yet accepted) and launch the next
        step (or burst) behind it, when every request allows (`_in_flight_of`, `_in_flight_of_burst`);
        what was launched, or None, and the queued acceptance (None when nothing went ahead, or behind a
        burst, which keeps its own)."""
        if self._bursts() or isinstance(earlier, LaunchedBurst):
            # Steps replayed from graphs go ahead of a burst, and a burst goes ahead of them (its later
            # steps move the static layout on by themselves); eager ones are accepted first, so that the
            # next step may be a burst packed from the host's state of its requests.
            if isinstance(earlier, LaunchedBurst):
                in_flight = self._in_flight_of_burst(earlier) if earlier.graph else None
                if in_flight is None:
                    return None, None
                return self._launch(in_flight, earlier.outputs), None
            if not self.runner.replays(earlier.packed.step):
                return None, None
        in_flight = self._in_flight_of(earlier)
        if in_flight is None:
            return None, None
        queued = queue_greedy(earlier.plan, earlier.drafts, earlier.result)
        return self._launch(in_flight, queued), queued

    def _may_go_ahead(self) -> bool:
        """Whether anything may be launched before the step or burst in flight is accepted: launch_ahead
        on, one rank (ranks are sent host tokens), no drafts made apart (`_drafts_apart`), and no
        running request whose next step reads what the host learns from the acceptance."""
        return (
            self.config.launch_ahead
            and isinstance(self.runner, ModelRunner)
            and not self._drafts_apart()
            and (not self._host_decides or self._host_decides.isdisjoint(self.scheduler.running))
        )

    def _in_flight_of_burst(self, earlier: LaunchedBurst) -> InFlight | None:
        """`_in_flight_of` a burst: each of its requests cached at least an anchor a step and may have
        accepted every draft of each; one that may end inside it (max_tokens, the context) sits out."""
        if not self._may_go_ahead():
            return None
        windows = self._windows_in_flight(earlier.schedule, earlier.plan, earlier.length)
        advance, reach, follows, sit_out = windows
        return InFlight(advance, reach, frozenset(sit_out), follows)

    def _windows_in_flight(
        self, schedule: StepSchedule, plan: VerifyPlan, steps: int
    ) -> tuple[dict[Sequence, int], dict[Sequence, int], dict[Sequence, int], set[Sequence]]:
        """`InFlight`'s advance, reach, follows and sit_out for the decode windows of `steps` steps of
        `schedule` in flight: each request on by an anchor a step at least and by every draft too at
        most; one that may end there (max_tokens) or whose window may not fit the context after them
        sits out (the next step waits for the acceptance)."""
        advance: dict[Sequence, int] = {}
        reach: dict[Sequence, int] = {}
        follows: dict[Sequence, int] = {}
        sit_out: set[Sequence] = set()
        room = self.limits.max_model_len - self.scheduler.window_positions
        for r, (seq, verify_len) in enumerate(zip(schedule.decode, plan.verify_lens, strict=True)):
            most = steps * (verify_len + 1)
            if seq.remaining_tokens <= most or len(seq.token_ids) + most > room:
                sit_out.add(seq)
                continue
            advance[seq], reach[seq], follows[seq] = steps, steps * verify_len, r
        return advance, reach, follows, sit_out

    def _in_flight_of(self, earlier: LaunchedStep) -> InFlight | None:
        """What the next step may assume of `earlier`'s requests before it is accepted; None when the
        next step must wait for the acceptance: launch_ahead off, tensor parallelism (ranks are sent
        host tokens), drafts made apart from the step (from the host's state of the requests), or a
        running request whose next step reads what the host learns from the acceptance (sampling,
        penalties, stop strings, logprobs)."""
        if not self._may_go_ahead():
            return None
        schedule = earlier.schedule
        advance, reach, follows, sit_out = self._windows_in_flight(schedule, earlier.plan, 1)
        room = self.limits.max_model_len - self.scheduler.window_positions
        # A chunk that ends its prompt samples the first token from its logit row, one of the rows
        # after every verify window's (the acceptance's `rest`, as `accept` reads it): the next anchor.
        offsets = earlier.packed.logit_offsets[len(schedule.decode) :]
        for chunk, offset in zip(schedule.prefill, offsets, strict=True):
            seq = chunk.seq
            advance[seq] = chunk.length
            if not chunk.samples_first_token:
                continue
            if seq.remaining_tokens <= 1 or len(seq.token_ids) + 1 > room:
                sit_out.add(seq)
                continue
            reach[seq], follows[seq] = 0, len(schedule.decode) + offset - offsets[0]
        return InFlight(advance, reach, frozenset(sit_out), follows)

    def _complete(
        self, launched: LaunchedStep | LaunchedBurst, queued: QueuedGreedyAcceptance | None = None
    ) -> list[PendingDelta]:
        """Accept a launched step and commit it: every request's tokens go into its sequence (the next
        schedule sees them); their text and deltas are made by the caller (`PendingDelta.make`).
        `queued`: its greedy acceptance, queued already (`_launch_ahead`). A request that ended while
        the step was in flight (launched ahead of its end, or aborted) commits nothing of it."""
        if isinstance(launched, LaunchedBurst):
            return self._complete_burst(launched)
        schedule, plan, packed, result = launched.schedule, launched.plan, launched.packed, launched.result
        verified = verified_drafts(plan, result)
        raw_logits = self._adjust_logits(
            schedule, plan, verified, packed.logit_offsets, result.logits, result.argmax
        )
        accepting = time.perf_counter()
        acceptance = accept(
            schedule, plan, verified, result, packed.logit_offsets, self.limits.block_size, queued
        )
        self.loop_counters.accept_seconds += time.perf_counter() - accepting
        self.timer.lap("accept")
        committed = self._commit(schedule, plan, verified, acceptance, packed.logit_offsets)
        # Read off the device now: a launched step's graph replay reuses the logits buffer.
        logprobs = self._committed_logprobs(committed, raw_logits)
        done = [self._commit_tokens(c.seq, c.tokens, logprobs.get(c.seq.request_id)) for c in committed]
        if self.gate is not None:
            # Decode-only steps are comparable; a prefill chunk would charge its own cost to the length.
            if schedule.prefill:
                self._gate_report = ([[]], None)
            else:  # `done` follows `committed`: the decoding requests that had not ended, in order
                verify_lens = dict(zip(schedule.decode, plan.verify_lens, strict=True))
                lens = [verify_lens[c.seq] for c in committed]
                self._gate_report = ([[len(pending.tokens) for pending in done]], [lens])
        self.timer.lap("emit")  # committing counts with making the deltas, whenever that comes
        return done

    def _window_of(self, decode: list[Sequence]) -> int:
        """The most positions a decode window takes this step, given the requests that decode (the
        scheduler's `window_of`): 1 + the gate's draft length, chosen from the measured speed of earlier
        steps (1: a plain step). A seeded sampling request replays its stream only if its steps draft
        alike on every run, so a step with one takes the block, as the policy says, rather than the
        timing-driven choice."""
        assert self.gate is not None  # a gate exists only beside a proposer
        if any(s.params.seed is not None and not s.params.greedy for s in decode):
            return 1 + self.limits.block_size
        draining = self._draining(decode)
        if draining is not None and len(decode) < len(self.scheduler.running):
            # A batch run to its end still taking its prompts in (a running request that does not decode
            # is in prefill, or sits a launch out near its end): its steps carry prefill chunks, which
            # time no length, so a warm-up or probe begun now would draft through the whole intake and
            # be measured only after it (H100, 64 requests: a run of length 3 drafted through 6 steps of
            # intake before its one measured burst).
            return 1
        return 1 + self.gate.draft_length(len(decode), draining)

    def _draining(self, decode: list[Sequence]) -> Callable[[], Iterator[RequestProgress]] | None:
        """The progress of the decoding requests, for the gate (`SpeculationGate.draft_length`), when
        the batch runs to its end: no request waits, and every one still running came in one wave
        (within WAVE_STEPS steps of the last to come, as the prompts of one `generate()` do), so no
        seat a request frees is taken. None otherwise (a server's requests come and go: a request that
        ends early makes room for the next), and for one decoding request."""
        running = self.scheduler.running
        if self.scheduler.waiting or len(decode) < 2:
            # One request: its own pace is the batch's, and the shared acceptance the better estimate of
            # it (its own few steps' counts chose shorter windows: through the server at one stream on
            # this project's CPU 1.59 tokens a step against 1.70).
            return None
        if self._latest_arrival_step - min(s.arrival_step for s in running) > WAVE_STEPS:
            return None

        def progress() -> Iterator[RequestProgress]:
            for seq in decode:
                stats = seq.spec_stats
                yield seq.remaining_tokens, stats.verified_per_position, stats.accepted_per_position

        return progress

    def _draft(self, decode: Seq[Sequence], caps: list[int]) -> Drafts | InStepDrafts | None:
        """The step's drafts for windows of up to `caps` drafts: None for a plain step (no drafter, or
        no request may verify a draft); drafts the runner makes inside the target step, when the
        policy's verify lengths do not depend on them and the target graphs allow; else a block drafted
        now, one drafter pass for every decoding request (positions past the longest cap left out)."""
        if self.proposer is None or not any(caps):
            return None
        if self._drafts_in_step():
            # Sampling requests in the block make the runner draft apart (`InStepDrafts.pack`).
            assert isinstance(self.proposer, DSparkProposer)
            return InStepDrafts(self.proposer, decode)
        return self.proposer.propose(decode, max(caps))

    def _max_verifies(
        self, decode: Seq[Sequence], in_flight: InFlight | None, window_drafts: int
    ) -> list[int]:
        """Most drafts each request may verify: the block size and the step's window, its own cap,
        tokens and context left (once the step in flight, if any, has committed the least it can).
        One loop with the limits held in locals: it runs per request on every step."""
        block = min(self.limits.block_size, window_drafts)
        max_model_len = self.limits.max_model_len
        follows = in_flight.follows if in_flight is not None else {}
        caps = []
        for seq in decode:
            own = seq.params.num_draft_tokens
            ahead = 1 if seq in follows else 0
            cap = min(block, seq.remaining_tokens - ahead - 1, max_model_len - len(seq.token_ids) - ahead)
            if own is not None and own < cap:
                cap = own
            caps.append(cap if cap > 0 else 0)
        return caps

    def _adjust_logits(
        self,
        schedule: StepSchedule,
        plan: VerifyPlan,
        drafts: Drafts | None,
        logit_offsets: Seq[int],
        logits: torch.Tensor | None,
        argmax: torch.Tensor | None,
    ) -> torch.Tensor:
        """Apply penalties and min_tokens (`dspark.sampling.penalties`) to the rows of the requests that have
        them, in place (a copy of every row a step would cost more than the rows changed), refreshing
        those rows' argmax; return the logits as the target gave them (a copy when rows changed and a
        request of this step reports logprobs, else `logits`).

        logits: [rows, vocab] fp32 and argmax [rows], the target step's, on the runner's device."""
        assert logits is not None and argmax is not None
        if not self._host_decides:  # penalties and min_tokens are among what the host decides
            return logits
        decode = schedule.decode
        adjusted: list[PenaltyWindow] = []
        for r, seq in enumerate(decode):
            if window_needs_adjusting(seq.params, seq.num_output_tokens):
                draft_row = r if drafts is not None and plan.verify_lens[r] else -1
                adjusted.append(
                    self._penalty_window(seq, logit_offsets[r], 1 + plan.verify_lens[r], draft_row)
                )
        for i, chunk in enumerate(schedule.prefill):
            if chunk.samples_first_token and window_needs_adjusting(chunk.seq.params, 0):
                adjusted.append(self._penalty_window(chunk.seq, logit_offsets[len(decode) + i], 1, -1))
        if not adjusted:
            return logits
        raw = logits
        if any(seq.params.logprobs is not None for seq in [*decode, *(c.seq for c in schedule.prefill)]):
            raw = logits.clone()
        rows = apply_penalties(logits, adjusted, drafts.tokens if drafts is not None else None)
        if rows is not None:
            argmax[rows] = logits[rows].argmax(dim=-1)
        return raw

    def _commit(
        self,
        schedule: StepSchedule,
        plan: VerifyPlan,
        drafts: Drafts | None,
        acceptance: Acceptance,
        logit_offsets: Seq[int],
    ) -> list[Committed]:
        """Advance every scheduled request past what the step committed (the target KV of those
        positions is written and the drafter's context injected already: the cache now holds them) and
        count its speculation; return each request's committed tokens, for emitting."""
        decode = schedule.decode
        drafted = drafts.drafted(self.limits.block_size) if drafts is not None else [0] * len(decode)
        committed = []
        for r, (seq, window) in enumerate(zip(decode, acceptance.windows, strict=True)):
            if seq.finished:
                continue
            seq.spec_stats.record_step(drafted[r], plan.verify_lens[r], window.accepted)
            seq.num_cached += window.accepted + 1
            committed.append(Committed(seq, window.tokens, logit_offsets[r]))
        for i, (chunk, token) in enumerate(zip(schedule.prefill, acceptance.first_tokens, strict=True)):
            if chunk.seq.finished:
                continue
            chunk.seq.num_cached += chunk.length
            if token is not None:
                committed.append(Committed(chunk.seq, (token,), logit_offsets[len(decode) + i]))
        return committed

    def _penalty_window(self, seq: Sequence, first_row: int, num_rows: int, draft_row: int) -> PenaltyWindow:
        """What `apply_penalties` needs of one request's rows."""
        return PenaltyWindow(
            first_row=first_row,
            num_rows=num_rows,
            params=seq.params,
            num_output=seq.num_output_tokens,
            state=self._penalty_states.get(seq.request_id),
            draft_row=draft_row,
            stop_ids=sorted(set(self.eos_token_ids) | set(seq.params.stop_token_ids)),
        )

    def _committed_logprobs(
        self, committed: list[Committed], logits: torch.Tensor
    ) -> dict[str, tuple[list[TokenLogprobs], list[float]]]:
        """Per request that asks for logprobs: each committed token's entry and chosen log probability,
        from the target's raw logits [rows, vocab] (`dspark.sampling.logprobs`); one copy to the host a
        step."""
        if not self._host_decides:  # logprobs are among what the host decides
            return {}
        wanted = [
            (c.seq, c.tokens, c.logit_row)
            for c in committed
            if c.seq.params.logprobs is not None and c.tokens and c.tokens[-1] != NON_FINITE_TOKEN
        ]
        if not wanted:
            return {}
        rows = [row + j for _, tokens, row in wanted for j in range(len(tokens))]
        flat = [token for _, tokens, _ in wanted for token in tokens]
        device = logits.device
        num_top = max(seq.params.logprobs or 0 for seq, _, _ in wanted)
        index = to_device(torch.tensor([rows, flat], dtype=torch.long), device)
        chosen, ranks, top_ids, top_logprobs = gather_logprobs(logits[index[0]], index[1], num_top)
        out: dict[str, tuple[list[TokenLogprobs], list[float]]] = {}
        formatter = self._logprobs_formatter
        k = 0
        for seq, tokens, _ in wanted:
            num = seq.params.logprobs or 0
            entries = [
                formatter.entry(
                    token, chosen[k + j], ranks[k + j], top_ids[k + j][:num], top_logprobs[k + j][:num]
                )
                for j, token in enumerate(tokens)
            ]
            out[seq.request_id] = (entries, chosen[k : k + len(tokens)])
            k += len(tokens)
        return out

    def _commit_tokens(
        self,
        seq: Sequence,
        tokens: Seq[int],
        logprobs: tuple[list[TokenLogprobs], list[float]] | None = None,
    ) -> PendingDelta:
        """Commit a request's tokens (those up to its finish) and finish it if they do; its delta's text
        is made later unless stop strings decide the finish from it. `logprobs`: each token's entry and
        chosen log probability, for requests that ask."""
        processor = self._outputs[seq.request_id]
        if tokens and tokens[-1] == NON_FINITE_TOKEN:  # the sampler saw NaN or inf: this request fails
            self._finish(seq, "error")
            error = "the sampling distribution is not finite (NaN or inf logits)"
            return PendingDelta(processor, (), "error", "", error)
        text = None
        if processor.text_decides_finish:
            appended, text, reason = processor.commit(tokens)
        else:
            appended, reason = processor.commit_ids(tokens)
        if logprobs is not None:
            entries, chosen = logprobs
            processor.add_logprobs(entries[: len(appended)], chosen[: len(appended)])
        state = self._penalty_states.get(seq.request_id)
        if state is not None:
            state.commit(appended)
        if reason is not None:
            self._finish(seq, reason)
        return PendingDelta(processor, tuple(appended), reason, text)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.total_spec_stats.merge(seq.spec_stats)
        if self.gate is not None:  # its acceptance joins the spread a draining batch is judged by
            stats = seq.spec_stats
            self.gate.request_finished(stats.verified_per_position, stats.accepted_per_position)
        self._spec_snapshot = None
        del self._seqs[seq.request_id]
        del self._outputs[seq.request_id]
        self._penalty_states.pop(seq.request_id, None)
        self._host_decides.discard(seq)

    def _apply_aborts(self) -> list[PendingDelta]:
        done = []
        for request_id in self._aborts:
            seq = self._seqs.get(request_id)
            if seq is None:
                continue
            processor = self._outputs[request_id]
            self._finish(seq, "abort")
            done.append(PendingDelta(processor, (), "abort", text=""))
        self._aborts.clear()
        return done


def _given_sps_table(path: str) -> SpsTable:
    """The `sps_table` given before start-up: loaded from its file, flat when empty."""
    return SpsTable.load(path) if path else SpsTable.flat()


def _past_some_ends(length: int, left: list[int]) -> int:
    """The longest burst up to `length` steps whose rows for requests already ended (their max_tokens
    reached inside it, `left` tokens each at a token a step) stay below BURST_ENDED_ROWS of its rows.
    A request that ends inside a burst keeps its tokens up to its end and its later rows are dropped;
    capping every burst at the fewest tokens any request has left made a batch whose requests end at
    different steps run mostly single steps (64 requests of 20-119 tokens on this project's CPU: 45
    of 58 decode launches shortened, 30 to one step), each with the host's whole per-step work. One
    request alone still stops where it ends."""
    short = [n for n in left if n < length]  # most steps: none (one pass over the batch)
    while short and length > 1 and sum(length - n for n in short) >= BURST_ENDED_ROWS * length * len(left):
        length -= 1
        short = [n for n in short if n < length]
    return length


def _decides_on_the_device(seq: Sequence) -> bool:
    """Whether the request's next window can be laid out before its last one is accepted: its tokens
    are decided on the device alone (greedy; no penalties or min_tokens, which read the host's counts;
    no stop strings, which read the text; no logprobs, read off a logits buffer the next step reuses)."""
    params = seq.params
    return (
        params.greedy
        and not params.penalized
        and not params.min_tokens
        and not params.stop
        and params.logprobs is None
    )
