"""LLMEngine: continuous batching with DSpark speculative decoding, one step at a time.

A step: schedule -> draft (one drafter pass for every decoding request) -> plan verify lengths ->
one target forward over packed verify windows and prefill chunks, whose captured features go straight
into the draft cache (the runner's feature sink) -> accept -> emit deltas.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from dspark.config import SPS_PROFILE, EngineConfig
from dspark.cuda_graphs import max_pages_per_request
from dspark.host_to_device import to_device
from dspark.kernels import ops
from dspark.logprobs import LogprobsFormatter, gather_logprobs
from dspark.model_runner import ModelRunner, TargetStep, create_runner
from dspark.models.loader import resolve_device, resolve_dtype
from dspark.output_processor import OutputProcessor
from dspark.outputs import EngineLoad, RequestDelta, SpecStats, TokenLogprobs
from dspark.page_allocator import PageAllocator
from dspark.penalties import PenaltyState, PenaltyWindow, apply_penalties, window_needs_adjusting
from dspark.prompts import check_prompt
from dspark.sampling import NON_FINITE_TOKEN, choose_tokens
from dspark.sampling_params import SamplingParams
from dspark.scheduler import PrefillChunk, Scheduler
from dspark.sequence import Sequence, SequenceStatus
from dspark.spec.accept import rejection_accept_all
from dspark.spec.draft_checkpoint import load_drafter
from dspark.spec.gate import SpeculationGate
from dspark.spec.planner import VerifyPlanner
from dspark.spec.proposer import DraftProposal, DSparkProposer, Proposer
from dspark.spec.sps_table import SpsTable
from dspark.spec.step_draft import InStepDraft
from dspark.step_timer import StepTimer
from dspark.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
MEMORY_READ_INTERVAL_S = 0.5  # how stale the load's GPU memory figures may be


@dataclass(frozen=True)
class ResolvedLimits:
    """Values derived from the config and the checkpoints (the config keeps what the user wrote)."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int


@dataclass
class _VerifyPlan:
    """Per decoding request: drafts verified, and the most of them that may be committed."""

    proposal: DraftProposal | None
    verify_lens: list[int]
    commit_caps: list[int]
    # The engine's block size (it may use fewer of the drafter's positions than it drafts).
    block_size: int = 0
    # Per request: how many positions it drafted (for its statistics).
    drafted: list[int] = field(default_factory=list)
    # Per request: the drafts it verifies as host ints, brought back by greedy acceptance together
    # with the committed tokens (until then empty: nothing on the host needs them earlier).
    drafts: list[list[int]] = field(default_factory=list)
    # Drafts the runner makes inside the target step (`proposal` is None until `take_in_step_drafts`).
    in_step: InStepDraft | None = None

    def __post_init__(self) -> None:
        self.drafts = [[] for _ in self.verify_lens]
        self._count_drafted()

    def take_in_step_drafts(self) -> None:
        """After the target step: the proposal its drafter made."""
        assert self.in_step is not None and self.in_step.proposal is not None, "the step made no drafts"
        self.proposal = self.in_step.proposal
        self._count_drafted()

    def _count_drafted(self) -> None:
        if self.proposal is None:
            self.drafted = [0] * len(self.verify_lens)
            return
        block_size = self.block_size
        lengths = self.proposal.lengths
        self.drafted = (
            [block_size] * len(self.verify_lens)
            if lengths is None
            else [min(block_size, n) for n in lengths.tolist()]
        )


class LLMEngine:
    """The synchronous engine: add requests, call `step()` until none is left."""

    def __init__(self, config: EngineConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
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
        if proposer is None and config.speculative:
            drafter = load_drafter(config.draft_model_path, dtype=dtype, device=device)
            if drafter.config.vocab_size != cfg.vocab_size:
                raise ValueError("draft_model: vocabulary size differs from the target's")
            embedding, lm_head = self.runner.vocab_weights()
            stop = config.draft_stop_survival if config.spec_mode == "compact" else 0.0
            proposer = DSparkProposer(
                drafter, embedding, lm_head, config.num_kv_pages, page_size, stop, config.block_size
            )
            if device.type == "cuda" and config.cuda_graph_max_tokens > 0:
                max_pages = max_pages_per_request(cfg.max_position_embeddings, page_size, config.num_kv_pages)
                proposer.use_graphs(config.max_num_seqs, max_pages)
        self.proposer = proposer if config.speculative else None
        if self.proposer is not None:
            # Every window row is injected, rejected drafts' rows too: a position's draft KV is read only
            # once the position is committed, and the step that commits it injects its true features.
            self.runner.set_feature_sink(self.proposer.inject)
        # Whether each step drafts, from the measured speed of earlier steps (None: always).
        self.gate = SpeculationGate() if self.proposer is not None and config.adaptive_speculation else None
        # Target layers whose outputs the drafter takes (none without speculation).
        self._capture_layers = tuple(self.proposer.target_layer_ids) if self.proposer is not None else ()
        block_size = 0
        if self.proposer is not None:
            block_size = config.block_size or self.proposer.block_size
            if block_size > self.proposer.block_size:
                raise ValueError(f"block_size: the drafter drafts at most {self.proposer.block_size}")
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
        self.limits = ResolvedLimits(device, dtype, block_size, min(limit, capacity))
        # Per-phase step timing, off unless a benchmark or profiler turns it on.
        self.timer = StepTimer(device)
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
        sps = self._sps_table(config, block_size)
        self.planner = VerifyPlanner(config.planner_policy, sps, config.planner_lag)
        self.total_spec_stats = SpecStats()
        self._seqs: dict[str, Sequence] = {}
        self._outputs: dict[str, OutputProcessor] = {}
        # History counts of the requests with penalties (on the device), by request id.
        self._penalty_states: dict[str, PenaltyState] = {}
        self._logprobs_formatter = LogprobsFormatter(self.tokenizer)
        self._pending: list[RequestDelta] = []
        self._aborts: list[str] = []
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(config.seed)

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture the CUDA graphs of every step and draft size now: a capture on first use would stall
        that step by far more than the step itself."""
        self.runner.capture_graphs(self._capture_layers)
        if isinstance(self.proposer, DSparkProposer):
            self._drafts_in_step()  # follows the target graphs' layout: its blocks are captured too
            self.proposer.capture_graphs()

    def _drafts_in_step(self) -> bool:
        """Whether a static step's greedy drafts can be made inside the target step, from the target
        graphs' layout (`InStepDraft`): a single-process runner with graphs and a drafter with them."""
        runner, proposer = self.runner, self.proposer
        return (
            self.config.spec_mode == "static"
            and isinstance(runner, ModelRunner)
            and runner.graphs is not None
            and isinstance(proposer, DSparkProposer)
            and proposer.follow_target_layout(runner.graphs.layout)
        )

    def _sps_table(self, config: EngineConfig, block_size: int) -> SpsTable:
        """The planner's steps/s table: flat, loaded from a file, or measured now on this runner."""
        if config.sps_table != SPS_PROFILE:
            return SpsTable.load(config.sps_table) if config.sps_table else SpsTable.flat()
        if config.spec_mode not in ("compact", "cap-accept"):
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
        )
        self._seqs[request_id] = seq
        self._outputs[request_id] = OutputProcessor(
            seq, self.tokenizer, self.eos_token_ids, self.limits.max_model_len
        )
        if params.penalized:
            self._penalty_states[request_id] = PenaltyState(
                seq.prompt_token_ids, [], self.model_config.vocab_size, self.limits.device
            )
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Abort at the next step: pages are freed and a final delta with reason 'abort' is emitted."""
        self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has an undelivered delta."""
        return bool(self._seqs or self._pending or self._aborts)

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
        return EngineLoad(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_used=self.allocator.num_used,
            kv_pages_total=self.allocator.num_pages,
            gpu_memory_allocated_bytes=self._memory[0],
            gpu_memory_reserved_bytes=self._memory[1],
        )

    def close(self) -> None:
        """Release what the engine holds (TP worker processes, when there are any)."""
        self.runner.close()

    # The step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """Run one scheduling iteration and return every request's delta."""
        timer = self.timer
        timer.start()
        if self.gate is not None:
            self.gate.start_step()
        deltas, self._pending = self._pending, []
        deltas.extend(self._apply_aborts())
        schedule = self.scheduler.schedule()
        if schedule.empty:
            return deltas
        decode = schedule.decode
        timer.lap("schedule")
        plan = self._plan_verification(decode)
        timer.lap("plan")
        windows = self._build_windows(decode, plan, schedule.prefill)
        step = windows.to_step(self._capture_layers)
        timer.lap("layout")
        result = self.runner.run(step)
        if plan.in_step is not None:
            plan.take_in_step_drafts()
        timer.lap("target")
        assert result.logits is not None and result.argmax is not None
        raw_logits = self._adjust_logits(
            decode, plan, schedule.prefill, windows, result.logits, result.argmax
        )
        committed = self._accept(decode, plan, schedule.prefill, result.logits, result.argmax, windows)
        timer.lap("accept")
        logprobs = self._committed_logprobs(committed, raw_logits)
        for seq, tokens, _ in committed:
            deltas.append(self._emit(seq, tokens, logprobs.get(seq.request_id)))
        if self.gate is not None and not schedule.prefill:
            # Decode-only steps are comparable; a prefill chunk would charge its own cost to the kind.
            num_tokens = sum(len(tokens) for _, tokens, _ in committed)
            self.gate.finish_step(len(decode), plan.proposal is not None, num_tokens)
        timer.finish("emit")
        return deltas

    def _plan_verification(self, decode: list[Sequence]) -> _VerifyPlan:
        caps = [self._max_verify(seq) for seq in decode]
        plain = self.proposer is None or not any(caps)
        # A seeded sampling request replays its stream only if its steps draft alike on every run, so a
        # step with one follows spec_mode rather than the timing-driven gate.
        seeded = any(s.params.seed is not None and not s.params.greedy for s in decode)
        gated = self.gate is not None and not seeded
        if plain or (gated and not self.gate.should_speculate(len(decode))):
            return _VerifyPlan(None, [0] * len(decode), [0] * len(decode))
        block_size = self.limits.block_size
        mode = self.config.spec_mode
        if mode == "static" and self._drafts_in_step():
            # Verify lengths do not depend on the drafts: the runner drafts inside the target step
            # (a block with sampling requests drafts apart there, `InStepDraft.draft_into`).
            assert isinstance(self.proposer, DSparkProposer)
            return _VerifyPlan(None, caps, caps, block_size, in_step=InStepDraft(self.proposer, decode))
        proposal = self.proposer.propose(decode)
        self.timer.lap("draft")
        if mode == "static":
            return _VerifyPlan(proposal, caps, caps, block_size)
        if proposal.lengths is not None:
            # Positions a request did not draft (it stopped early) are never verified.
            caps = [min(cap, int(n)) for cap, n in zip(caps, proposal.lengths.tolist(), strict=True)]
        if self.planner.verifies_all:
            return _VerifyPlan(proposal, caps, caps, block_size)
        cap_tensor = torch.tensor(caps, dtype=torch.long)
        survivals = torch.cumprod(proposal.confidences[:, :block_size], dim=1)
        planned = self.planner.plan(survivals, cap_tensor).tolist()
        if mode == "cap-accept":
            return _VerifyPlan(proposal, caps, planned, block_size)
        return _VerifyPlan(proposal, planned, planned, block_size)

    def _max_verify(self, seq: Sequence) -> int:
        """Most drafts this request may verify: block size, its own cap, tokens and context left."""
        own = seq.params.num_draft_tokens
        cap = min(
            self.limits.block_size,
            self.limits.block_size if own is None else own,
            seq.remaining_tokens - 1,
            self.limits.max_model_len - len(seq.token_ids),
        )
        return max(cap, 0)

    def _build_windows(
        self, decode: list[Sequence], plan: _VerifyPlan, prefill: list[PrefillChunk]
    ) -> _Windows:
        windows = _Windows()
        # Verify windows hold their anchor and placeholders: the drafts are packed in where they are
        # (TargetStep.verify_drafts), so nothing waits here to read them back.
        for seq, num_drafts in zip(decode, plan.verify_lens, strict=True):
            windows.add(seq, [seq.anchor] + [0] * num_drafts, seq.num_cached, logits="all")
        if plan.proposal is not None:
            windows.verify_drafts = plan.proposal.tokens
        windows.drafter = plan.in_step
        for chunk in prefill:
            seq = chunk.seq
            wants_logits = chunk.completes_prefill and seq.num_output_tokens == 0
            tokens = seq.token_ids[chunk.start : chunk.start + chunk.length]
            windows.add(seq, tokens, chunk.start, logits="last" if wants_logits else "none")
        return windows

    def _adjust_logits(
        self,
        decode: list[Sequence],
        plan: _VerifyPlan,
        prefill: list[PrefillChunk],
        windows: _Windows,
        logits: torch.Tensor,
        argmax: torch.Tensor,
    ) -> torch.Tensor:
        """Apply penalties and min_tokens (`dspark.penalties`) to the rows of the requests that have
        them, in place, refreshing those rows' argmax; return the logits as the target gave them
        (a copy when rows changed and a request of this step reports logprobs, else `logits`).

        logits: [rows, vocab] fp32 and argmax [rows], the step's, on the runner's device."""
        adjusted: list[PenaltyWindow] = []
        for r, seq in enumerate(decode):
            if window_needs_adjusting(seq.params, seq.num_output_tokens):
                draft_row = r if plan.proposal is not None and plan.verify_lens[r] else -1
                adjusted.append(
                    self._penalty_window(seq, windows.logit_offsets[r], 1 + plan.verify_lens[r], draft_row)
                )
        for i, chunk in enumerate(prefill):
            seq = chunk.seq
            first_token = chunk.completes_prefill and seq.num_output_tokens == 0
            if first_token and window_needs_adjusting(seq.params, 0):
                adjusted.append(self._penalty_window(seq, windows.logit_offsets[len(decode) + i], 1, -1))
        if not adjusted:
            return logits
        raw = logits
        if any(seq.params.logprobs is not None for seq in [*decode, *(c.seq for c in prefill)]):
            raw = logits.clone()
        drafts = plan.proposal.tokens if plan.proposal is not None else None
        rows = apply_penalties(logits, adjusted, drafts)
        if rows is not None:
            argmax[rows] = logits[rows].argmax(dim=-1)
        return raw

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
        self, committed: list[tuple[Sequence, list[int], int]], logits: torch.Tensor
    ) -> dict[str, tuple[list[TokenLogprobs], list[float]]]:
        """Per request that asks for logprobs: each committed token's entry and chosen log probability,
        from the target's raw logits [rows, vocab] (`dspark.logprobs`); one copy to the host a step."""
        wanted = [
            (seq, tokens, row)
            for seq, tokens, row in committed
            if seq.params.logprobs is not None and tokens and tokens[-1] != NON_FINITE_TOKEN
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

    def _accept(
        self,
        decode: list[Sequence],
        plan: _VerifyPlan,
        prefill: list[PrefillChunk],
        logits: torch.Tensor,
        argmax: torch.Tensor,
        windows: _Windows,
    ) -> list[tuple[Sequence, list[int], int]]:
        """Decide committed tokens; return them per sequence, with the logit row of the first.

        logits, argmax: the step's logit rows and their argmax, on the runner's device (greedy
        requests need only the argmax; sampling requests are judged there too)."""
        committed: list[tuple[Sequence, list[int], int]] = []
        greedy = self._greedy_accept(plan, argmax)
        sampled = self._sampled_accept(decode, plan, logits, windows)
        for r, seq in enumerate(decode):
            accepted, next_token = (greedy.accepted[r], greedy.bonus[r]) if seq.params.greedy else sampled[r]
            seq.spec_stats.record_step(plan.drafted[r], plan.verify_lens[r], accepted)
            seq.num_cached += accepted + 1
            committed.append((seq, [*plan.drafts[r][:accepted], next_token], windows.logit_offsets[r]))
        first_prefill_row = windows.logit_offsets[len(decode)] if prefill else 0
        for i, chunk in enumerate(prefill):
            seq = chunk.seq
            seq.num_cached += chunk.length
            if chunk.completes_prefill and seq.num_output_tokens == 0:
                offset = windows.logit_offsets[len(decode) + i]
                if seq.params.greedy:
                    committed.append((seq, [greedy.rest[offset - first_prefill_row]], offset))
                else:
                    row = logits[offset][None]
                    committed.append((seq, [int(choose_tokens(row, seq.params, seq.generator)[0])], offset))
        return committed

    def _sampled_accept(
        self, decode: list[Sequence], plan: _VerifyPlan, logits: torch.Tensor, windows: _Windows
    ) -> dict[int, tuple[int, int]]:
        """Rejection sampling of every sampling request's window (up to its commit cap), in one call
        where the logits are: {decode row: (drafts kept, next token)}. Runs after `_greedy_accept`,
        which brings the drafts back to the host."""
        rows = [r for r, seq in enumerate(decode) if not seq.params.greedy]
        if not rows:
            return {}
        drafts = plan.drafts
        limits = [plan.commit_caps[r] for r in rows]
        probs = [plan.proposal.probs[r] if plan.proposal is not None else None for r in rows]
        offsets = [windows.logit_offsets[r] for r in rows]
        accepted, next_tokens = rejection_accept_all(
            [drafts[r][:n] for r, n in zip(rows, limits, strict=True)],
            probs,
            [logits[o : o + n + 1] for o, n in zip(offsets, limits, strict=True)],
            [decode[r].params for r in rows],
            [decode[r].generator for r in rows],
            self.limits.block_size,
        )
        return {r: (a, t) for r, a, t in zip(rows, accepted, next_tokens, strict=True)}

    def _greedy_accept(self, plan: _VerifyPlan, argmax: torch.Tensor) -> _GreedyOutcome:
        """Greedy acceptance of every verify window where the argmax is (`ops.greedy_accept`: the
        accept kernel on a GPU), then one copy to the host of what the step commits.

        Verify windows come first in the packed step and every one of their rows has logits, so window
        r's argmax rows are argmax[cu[r] : cu[r + 1]] with no gather; the rows after them are the
        prefill chunks' last rows. Sampling requests' results are computed and ignored."""
        num = len(plan.verify_lens)
        if num == 0:
            return _GreedyOutcome([], [], argmax.tolist())
        device = argmax.device
        lens = torch.tensor(plan.verify_lens, dtype=torch.long)
        cu = torch.zeros(num + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lens + 1, 0)
        window_rows = int(cu[-1])
        # One host-to-device copy of the per-window numbers.
        meta = to_device(torch.cat([cu, lens, torch.tensor(plan.commit_caps, dtype=torch.long)]), device)
        cu_d, lens_d, caps_d = meta[: num + 1], meta[num + 1 : 2 * num + 1], meta[2 * num + 1 :]
        proposal = plan.proposal
        if proposal is None:
            drafts = torch.zeros(num, 1, dtype=torch.long, device=device)
        else:
            drafts = to_device(proposal.tokens, device)
        accepted, bonus = ops.greedy_accept(drafts, argmax[:window_rows], cu_d, lens_d, caps_d)
        # The verified drafts come back in the same copy (the host emits the accepted ones).
        width = max(plan.verify_lens) if proposal is not None else 0
        rest = argmax[window_rows:]
        host = torch.cat([accepted, bonus, drafts[:, :width].flatten(), rest]).tolist()
        if proposal is not None:
            flat = host[2 * num : 2 * num + num * width]
            plan.drafts = [flat[r * width : r * width + n] for r, n in enumerate(plan.verify_lens)]
        return _GreedyOutcome(host[:num], host[num : 2 * num], host[2 * num + num * width :])

    def _emit(
        self,
        seq: Sequence,
        tokens: list[int],
        logprobs: tuple[list[TokenLogprobs], list[float]] | None = None,
    ) -> RequestDelta:
        """Commit a request's tokens (those up to its finish) and say what changed; `logprobs`: each
        token's entry and chosen log probability, for requests that ask."""
        processor = self._outputs[seq.request_id]
        if tokens and tokens[-1] == NON_FINITE_TOKEN:  # the sampler saw NaN or inf: this request fails
            self._finish(seq, "error")
            return RequestDelta(
                seq.request_id,
                [],
                "",
                True,
                "error",
                seq.num_prompt_tokens,
                seq.num_output_tokens,
                seq.spec_stats,
                error="the sampling distribution is not finite (NaN or inf logits)",
                logprobs=processor.logprobs_so_far(final=True),
                cumulative_logprob=processor.cumulative_logprob,
            )
        appended, text, reason = processor.commit(tokens)
        if logprobs is not None:
            entries, chosen = logprobs
            processor.add_logprobs(entries[: len(appended)], chosen[: len(appended)])
        state = self._penalty_states.get(seq.request_id)
        if state is not None:
            state.commit(appended)
        if reason is not None:
            self._finish(seq, reason)
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=appended,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            spec_stats=seq.spec_stats,
            logprobs=processor.logprobs_so_far(final=reason is not None),
            cumulative_logprob=processor.cumulative_logprob,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.total_spec_stats.merge(seq.spec_stats)
        del self._seqs[seq.request_id]
        del self._outputs[seq.request_id]
        self._penalty_states.pop(seq.request_id, None)

    def _apply_aborts(self) -> list[RequestDelta]:
        deltas = []
        for request_id in self._aborts:
            seq = self._seqs.get(request_id)
            if seq is None:
                continue
            processor = self._outputs[request_id]
            self._finish(seq, "abort")
            deltas.append(
                RequestDelta(
                    request_id,
                    [],
                    "",
                    True,
                    "abort",
                    seq.num_prompt_tokens,
                    seq.num_output_tokens,
                    seq.spec_stats,
                    logprobs=processor.logprobs_so_far(final=True),
                    cumulative_logprob=processor.cumulative_logprob,
                )
            )
        self._aborts.clear()
        return deltas


@dataclass
class _GreedyOutcome:
    """Greedy acceptance on the host: per verify window the drafts accepted and the token after them,
    and the argmax of every logit row after the windows (the prefill chunks' last rows)."""

    accepted: list[int]
    bonus: list[int]
    rest: list[int]


class _Windows:
    """The packed target batch of one step, built window by window."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.pages: list[list[int]] = []
        self.starts: list[int] = []
        self.lens: list[int] = []
        self.logit_offsets: list[int] = []
        # Logit rows: every row of the leading windows that want them all (the verify windows), then
        # the rows listed (kept as a count, not a list, since most steps have nothing else).
        self.num_leading_rows = 0
        self.logit_rows: list[int] = []
        # Drafts of the first windows (verify windows), packed in where they are, or their drafter
        # (see TargetStep).
        self.verify_drafts: torch.Tensor | None = None
        self.drafter: InStepDraft | None = None

    def add(self, seq: Sequence, tokens: list[int], start: int, logits: str) -> None:
        """Append a window of `tokens` at positions start.. of `seq`; `logits` says which rows' logits
        to compute: "all" (a verify window), "last" (a prefill chunk that ends the prompt), "none"."""
        first = len(self.tokens)
        self.logit_offsets.append(self.num_leading_rows + len(self.logit_rows))
        self.tokens.extend(tokens)
        self.pages.append(seq.pages)
        self.starts.append(start)
        self.lens.append(len(tokens))
        if logits == "all" and first == self.num_leading_rows:
            self.num_leading_rows += len(tokens)
        elif logits == "all":
            self.logit_rows.extend(range(first, first + len(tokens)))
        elif logits == "last":
            self.logit_rows.append(first + len(tokens) - 1)

    def to_step(self, capture_layers: tuple[int, ...]) -> TargetStep:
        """The packed batch as the runner (and every TP rank) takes it."""
        rows = torch.arange(self.num_leading_rows)
        if self.logit_rows:
            rows = torch.cat([rows, torch.tensor(self.logit_rows, dtype=torch.long)])
        return TargetStep(
            token_ids=torch.tensor(self.tokens, dtype=torch.long),
            positions=None,  # laid out where the step runs (TargetStep.window_positions when eager)
            window_starts=self.starts,
            window_lens=self.lens,
            pages=self.pages,
            logit_rows=rows,
            capture_layers=capture_layers,
            host_logits=False,
            verify_drafts=self.verify_drafts,
            drafter=self.drafter,
        )
