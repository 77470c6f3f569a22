"""Serving metrics, published as Prometheus families through Triton's metrics port.

The Triton adapter reports request events here from its send threads and calls `flush()` from its poll
thread every 0.1 s. `Metrics` records nothing (metrics disabled); `TritonMetrics` writes to
`triton_python_backend_utils.MetricFamily`, passed in so that this module imports without Triton. Each
metric update is a round trip to the server process (tens of µs), and two at once crashed the backend
stub: counters and gauges are summed here and histogram observations queued, and `flush()` writes them
all from one thread, so no send waits on a metric.

Beside the `dspark_` families, the `vllm:` families Triton's vLLM backend exports (src/utils/metrics.py
there: same names, labels `model` and `version`, same buckets) and vLLM's speculative-decoding counters
(`vllm:spec_decode_*`, which that backend does not forward), so dashboards built for either work. A
vLLM "draft token" is one the target verified: DSpark drafts a block and verifies a planned prefix of
it, so `vllm:spec_decode_num_draft_tokens_total` counts verified drafts (all drafted ones are
`dspark_spec_drafted_tokens_total`), and its positions count from 0 as vLLM's do.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from dspark.config import EngineConfig
from dspark.outputs import STEP_PHASES, EngineLoad, LoopTotals, gate_rows
from dspark.runner.models.hf_config import ModelConfig
from dspark.sampling_params import MAX_INT

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# Streamed updates' seconds per token published at most this often a second per histogram (inter-token
# latency, vLLM's time per output token), a uniform sample of them (`TritonMetrics.flush` says why); the
# model's instances (backend stubs) split this and the next budget between them.
UPDATE_OBSERVATIONS_PER_S = 200
# Likewise the per-request histograms (time to first token; vLLM's end-to-end latency, prompt and
# generation lengths, n): at most this many requests' observations a second, a uniform sample beyond.
REQUEST_OBSERVATIONS_PER_S = 100
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
SPEC_COUNTERS = ("drafted_tokens", "verified_tokens", "accepted_tokens", "steps", "drafting_steps")
# The engine loop's totals (dspark.outputs.LoopTotals fields) as `dspark_engine_<name>_total` counters.
LOOP_COUNTERS = {
    "steps": "Engine steps run",
    "step_requests": "Requests in each engine step, summed over steps (/ steps: the mean batch)",
    "graph_steps": "Engine steps that replayed a captured CUDA graph (the rest ran eagerly)",
    "ahead_steps": "Engine steps launched before the step ahead of them was accepted (launch_ahead)",
    "prefill_steps": "Engine steps that carried a prefill chunk",
    "burst_steps": "Engine steps run in decode bursts (decode_burst)",
    "bursts": "Decode bursts launched (burst_steps / bursts: their mean length)",
    "verify_tokens": "Draft tokens the engine's steps verified (/ step_requests: a request's drafts a step)",
    "step_seconds": "Wall seconds of the engine's steps",
    "prefill_step_seconds": "Of step_seconds: the steps that carried a prefill chunk",
    "accept_seconds": "Wall seconds of the steps' acceptance, where the host waits for the device",
    "idle_seconds": "Seconds the engine loop waited with no request to run",
    "intake_seconds": "Seconds the engine loop spent taking in commands between its steps (not waiting)",
    "handover_seconds": "Seconds the engine loop spent handing each step's deltas to their requests",
    "admitted_requests": "Requests the engine loop admitted",
    "intake_wait_seconds": "Seconds from requests' hand-over to the engine to their admission, summed",
    "first_token_seconds": "Seconds from requests' hand-over to the engine to their first token, summed",
    "gc_collections": "Passes of the engine process's cyclic garbage collector",
    "gc_full_collections": "Of gc_collections: passes over the oldest generation",
    "gc_seconds": "Wall seconds of the engine process's garbage-collector passes (the loop waits in them)",
} | {
    f"host_{phase}_seconds": f"Wall seconds of the engine's steps in their {phase} phase, on the host"
    for phase in STEP_PHASES
}
VLLM_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
]
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
VLLM_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
VLLM_N_BUCKETS = [1, 2, 5, 10, 20]
# vLLM's spec-decode counter -> the SpecStats counter it is
VLLM_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafting_steps",
    "vllm:spec_decode_num_draft_tokens_total": "verified_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


def vllm_token_buckets(max_model_len: int) -> list[float]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def vllm_max_model_len(config: EngineConfig) -> int:
    """The context length vLLM would report: max_model_len, else the target's max_position_embeddings."""
    return config.max_model_len or ModelConfig.load(config.model_path).max_position_embeddings


class Metrics:
    """The events the adapter reports. This base class is the disabled case: it records nothing."""

    def request_finished(self, finish_reason: str) -> None:
        """A request ended: stop, length, abort, error, or invalid (rejected before it started)."""

    def request_completed(self, prompt_tokens: int, generation_tokens: int, e2e_latency: float) -> None:
        """A request the engine ran ended, `e2e_latency` seconds after it arrived."""

    def prompt_tokens(self, count: int) -> None:
        """A request's prompt entered the engine."""

    def tokens_generated(self, count: int, since_arrival: float | None, since_last: float | None) -> None:
        """`count` tokens streamed; `since_arrival` is set on the first ones (TTFT), else `since_last`."""

    def speculation(self, before: dict | None, after: dict) -> None:
        """A request's speculation counters moved from `before` to `after` (SpecStats.as_dict())."""

    def load(self, load: EngineLoad) -> None:
        """The engine's occupancy now."""

    def flush(self) -> None:
        """Publish what was recorded since the last flush."""


class TritonMetrics(Metrics):
    """Prometheus families on Triton's metrics endpoint, labelled with the model name and version."""

    def __init__(
        self,
        family: Any,
        labels: dict[str, str],
        max_model_len: int = 0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        instances: int = 1,
    ) -> None:
        """`max_model_len` bounds vLLM's token-count buckets (0: unknown, up to MAX_INT); `clock` and
        `rng` time and draw the sample of streamed updates' latencies (`flush`); `instances`: the
        model's backend stubs publishing into the same families, which split the sampling budgets
        (each observation costs its stub a round trip to the server: four stubs each observing the
        whole budget spent 10-13% of their CPU in `flush` at 8 streams on this project's CPU)."""
        self._family = family
        self._share = 1 / max(1, instances)
        self._clock = clock
        self._rng = rng or random.Random()
        self._flushed_at = clock()
        self._labels = dict(labels)
        self._families: list[Any] = []  # a family is unregistered when garbage-collected
        self._vllm = _VllmFamilies(self, max_model_len or MAX_INT)
        self._requests = self._new(
            family.COUNTER, "dspark_requests_total", "Finished requests, by finish reason"
        )
        self._by_reason: dict[str, Any] = {}
        self._prompt = self._metric(family.COUNTER, "dspark_prompt_tokens_total", "Prompt tokens admitted")
        self._generated = self._metric(family.COUNTER, "dspark_generation_tokens_total", "Tokens generated")
        self._ttft = self._metric(
            family.HISTOGRAM,
            "dspark_time_to_first_token_seconds",
            "Seconds from request arrival to its first streamed token "
            f"(a uniform sample of at most {REQUEST_OBSERVATIONS_PER_S} requests a second)",
            buckets=TTFT_BUCKETS,
        )
        self._itl = self._metric(
            family.HISTOGRAM,
            "dspark_inter_token_latency_seconds",
            "Seconds between streamed tokens: one observation per response, its gap over its tokens "
            f"(a uniform sample of at most {UPDATE_OBSERVATIONS_PER_S} responses a second)",
            buckets=ITL_BUCKETS,
        )
        self._spec = {
            name: self._metric(
                family.COUNTER, f"dspark_spec_{name}_total", f"Speculation: {name.replace('_', ' ')}"
            )
            for name in SPEC_COUNTERS
        }
        self._verify_window = self._metric(
            family.GAUGE,
            "dspark_spec_mean_verify_window",
            "Mean target tokens verified per request step (1 + drafts), over finished requests",
        )
        self._accept_length = self._metric(
            family.GAUGE,
            "dspark_spec_mean_acceptance_length",
            "Mean tokens committed per request step (tau), over finished requests",
        )
        self._position_rate = self._new(
            family.GAUGE,
            "dspark_spec_acceptance_rate",
            "Fraction of verified drafts accepted by draft position (1 = first draft), finished requests",
        )
        self._positions: dict[int, Any] = {}
        self._kv_used = self._metric(family.GAUGE, "dspark_kv_pages_used", "KV-cache pages in use")
        self._kv_total = self._metric(family.GAUGE, "dspark_kv_pages_total", "KV-cache pages in all")
        self._running = self._metric(family.GAUGE, "dspark_num_requests_running", "Requests decoding")
        self._waiting = self._metric(family.GAUGE, "dspark_num_requests_waiting", "Requests waiting to start")
        self._gpu_allocated = self._metric(
            family.GAUGE,
            "dspark_gpu_memory_allocated_bytes",
            "Bytes in tensors on the engine's GPU (torch.cuda.memory_allocated; 0 on the CPU)",
        )
        self._gpu_reserved = self._metric(
            family.GAUGE,
            "dspark_gpu_memory_reserved_bytes",
            "Bytes the engine's caching allocator holds on its GPU (torch.cuda.memory_reserved; 0 on CPU)",
        )
        # The adaptive gate's view (`EngineLoad.gate`), per tier of decoding requests and draft length.
        self._gate_families = {
            "step_seconds": self._new(
                family.GAUGE,
                "dspark_spec_gate_step_seconds",
                "Adaptive speculation: the median wall seconds of a step, per tier (a power-of-two count "
                "of decoding requests) and draft length (0: plain), over its latest measured steps",
            ),
            "chosen_steps": self._new(
                family.GAUGE,
                "dspark_spec_gate_chosen_steps",
                "Adaptive speculation: steps the gate ran at each draft length, per tier, since the engine "
                "started",
            ),
            "tokens_per_request": self._new(
                family.GAUGE,
                "dspark_spec_gate_tokens_per_request",
                "Adaptive speculation: the tokens a request commits in a step of each draft length, as "
                "the gate estimates them from acceptance so far",
            ),
        }
        self._gate_metrics: dict[tuple[str, int, int], Any] = {}
        # The engine loop's totals (`LoopTotals`): counters that move by the difference between loads.
        self._loop = {
            name: self._metric(family.COUNTER, f"dspark_engine_{name}_total", help_text)
            for name, help_text in LOOP_COUNTERS.items()
        }
        self._loop_seen = LoopTotals()
        self._pending: dict[Any, float] = {}  # counter -> increment not yet published
        self._gauges: dict[Any, float] = {}  # gauge -> value not yet published
        self._per_token: list[float] = []  # streamed updates' seconds per token, not yet published
        self._first_tokens: list[float] = []  # requests' seconds to their first token, not yet published
        self._completions: list[tuple[float, int, int]] = []  # (e2e seconds, prompt, generation) likewise
        # The adapter reports from several threads (its send threads and its poll thread): `_lock`
        # guards the state above. The Python backend's metric calls must not run concurrently (its
        # stub crashed when two threads observed at once), and each is a round trip to the server:
        # they wait for `flush` (the poll thread), under `_publish`, and only a new label's metric is
        # made at once (under both locks, always taken in that order).
        self._lock = threading.Lock()
        self._publish = threading.Lock()

    def request_finished(self, finish_reason: str) -> None:
        with self._lock:
            if finish_reason not in self._by_reason:
                with self._publish:
                    self._by_reason[finish_reason] = self._requests.Metric(
                        labels={**self._labels, "finish_reason": finish_reason}
                    )
            self._add(self._by_reason[finish_reason], 1)

    def request_completed(self, prompt_tokens: int, generation_tokens: int, e2e_latency: float) -> None:
        with self._lock:
            self._completions.append((e2e_latency, prompt_tokens, generation_tokens))

    def prompt_tokens(self, count: int) -> None:
        with self._lock:
            self._add(self._prompt, count)
            self._add(self._vllm.prompt, count)

    def tokens_generated(self, count: int, since_arrival: float | None, since_last: float | None) -> None:
        if count <= 0:
            return
        with self._lock:
            self._add(self._generated, count)
            self._add(self._vllm.generation, count)
            if since_arrival is not None:
                self._first_tokens.append(since_arrival)
            elif since_last is not None:
                # One observation per update, not per token: each observe is a round trip to the server
                # process, and an update carries every token the engine committed since the last one.
                self._per_token.append(since_last / count)

    def speculation(self, before: dict | None, after: dict) -> None:
        with self._lock:
            self._speculation(before or {}, after)

    def _speculation(self, before: dict, after: dict) -> None:
        for name in SPEC_COUNTERS:
            step = after.get(name, 0) - before.get(name, 0)
            if step > 0:
                self._add(self._spec[name], step)
        for vllm_name, name in VLLM_SPEC_COUNTERS.items():
            step = after.get(name, 0) - before.get(name, 0)
            if step > 0:
                self._add(self._vllm.spec[vllm_name], step)
        accepted_before = before.get("accepted_per_position", [])
        for k, count in enumerate(after["accepted_per_position"]):
            step = count - (accepted_before[k] if k < len(accepted_before) else 0)
            if step > 0:
                self._add(self._vllm.accepted_at(k), step)

    def load(self, load: EngineLoad) -> None:
        with self._lock:
            self._gauges[self._kv_used] = load.kv_pages_used
            self._gauges[self._kv_total] = load.kv_pages_total
            self._gauges[self._running] = load.num_running
            self._gauges[self._waiting] = load.num_waiting
            self._gauges[self._gpu_allocated] = load.gpu_memory_allocated_bytes
            self._gauges[self._gpu_reserved] = load.gpu_memory_reserved_bytes
            spec = load.spec
            if spec.steps:
                self._gauges[self._verify_window] = (spec.verified_tokens + spec.steps) / spec.steps
                self._gauges[self._accept_length] = (spec.accepted_tokens + spec.steps) / spec.steps
            for k, verified in enumerate(spec.verified_per_position):
                if verified:
                    self._gauges[self._position(k + 1)] = spec.accepted_per_position[k] / verified
            for row in gate_rows(load.gate):
                tier, length = row["tier"], row["length"]
                if row["measured_steps"]:
                    self._gauges[self._gate_metric("step_seconds", tier, length)] = row["step_seconds"]
                self._gauges[self._gate_metric("chosen_steps", tier, length)] = row["chosen_steps"]
                self._gauges[self._gate_metric("tokens_per_request", 0, length)] = row["tokens_per_request"]
            seen, self._loop_seen = self._loop_seen, load.loop
            if load.loop.steps < seen.steps:  # another engine (a restart): its totals start over
                seen = LoopTotals()
            for name, counter in self._loop.items():
                moved = getattr(load.loop, name) - getattr(seen, name)
                if moved > 0:
                    self._add(counter, moved)

    def flush(self) -> None:
        now = self._clock()
        with self._lock:
            pending, self._pending = self._pending, {}
            gauges, self._gauges = self._gauges, {}
            per_token, self._per_token = self._per_token, []
            first_tokens, self._first_tokens = self._first_tokens, []
            completions, self._completions = self._completions, []
        # Each observation is a round trip to the server process, one at a time (`_publish`; where the
        # backend's binding does not release the GIL, holding it), and under load there is one per
        # streamed response and six per request: the send threads and new requests waited on them. A
        # uniform sample of each keeps the histograms' quantiles and mean (sum over count); their count
        # is the sample's (the counters stay exact).
        elapsed, self._flushed_at = now - self._flushed_at, now
        per_token = self._sample(per_token, UPDATE_OBSERVATIONS_PER_S * self._share * elapsed)
        first_tokens = self._sample(first_tokens, REQUEST_OBSERVATIONS_PER_S * self._share * elapsed)
        completions = self._sample(completions, REQUEST_OBSERVATIONS_PER_S * self._share * elapsed)
        vllm = self._vllm
        observations = [(h, value) for value in per_token for h in (self._itl, vllm.tpot)]
        observations += [(h, value) for value in first_tokens for h in (self._ttft, vllm.ttft)]
        for e2e, prompt, generation in completions:
            observations += [(vllm.e2e, e2e), (vllm.request_prompt, prompt)]
            observations += [(vllm.request_generation, generation), (vllm.n, 1)]
        with self._publish:
            for counter, amount in pending.items():
                counter.increment(amount)
            for gauge, value in gauges.items():
                gauge.set(value)
            for histogram, value in observations:
                histogram.observe(value)

    def _sample(self, values: list, budget: float) -> list:
        """`values`, or a uniform sample of round(budget) of them (at least one) when there are more."""
        budget = max(1, round(budget))
        return self._rng.sample(values, budget) if len(values) > budget else values

    def _add(self, counter: Any, amount: float) -> None:
        self._pending[counter] = self._pending.get(counter, 0) + amount

    def _gate_metric(self, name: str, tier: int, length: int) -> Any:
        """The gate gauge `name` of this tier (0: none, the family has no tier label) and length."""
        key = (name, tier, length)
        if key not in self._gate_metrics:
            labels = {**self._labels, "length": str(length)} | ({"tier": str(tier)} if tier else {})
            with self._publish:
                self._gate_metrics[key] = self._gate_families[name].Metric(labels=labels)
        return self._gate_metrics[key]

    def _position(self, position: int) -> Any:
        if position not in self._positions:
            labels = {**self._labels, "position": str(position)}
            with self._publish:
                self._positions[position] = self._position_rate.Metric(labels=labels)
        return self._positions[position]

    def _new(self, kind: Any, name: str, description: str) -> Any:
        family = self._family(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    def _metric(self, kind: Any, name: str, description: str, buckets: list[float] | None = None) -> Any:
        family = self._new(kind, name, description)
        if buckets is None:
            return family.Metric(labels=self._labels)
        return family.Metric(labels=self._labels, buckets=buckets)


class _VllmFamilies:
    """The `vllm:` families of one TritonMetrics (names, labels and buckets as vLLM's)."""

    def __init__(self, owner: TritonMetrics, max_model_len: int) -> None:
        counter, histogram = owner._family.COUNTER, owner._family.HISTOGRAM
        metric = owner._metric
        token_buckets = vllm_token_buckets(max_model_len)
        self._owner = owner
        self.prompt = metric(counter, "vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation = metric(
            counter, "vllm:generation_tokens_total", "Number of generation tokens processed."
        )
        self.ttft = metric(
            histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=VLLM_TTFT_BUCKETS,
        )
        self.tpot = metric(
            histogram,
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            buckets=VLLM_TPOT_BUCKETS,
        )
        self.e2e = metric(
            histogram,
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            buckets=VLLM_E2E_BUCKETS,
        )
        self.request_prompt = metric(
            histogram,
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            buckets=token_buckets,
        )
        self.request_generation = metric(
            histogram,
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            buckets=token_buckets,
        )
        self.n = metric(
            histogram,
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            buckets=VLLM_N_BUCKETS,
        )
        self.spec = {
            name: metric(counter, name, description)
            for name, description in zip(
                VLLM_SPEC_COUNTERS,
                ("Number of spec decoding drafts.", "Number of draft tokens.", "Number of accepted tokens."),
                strict=True,
            )
        }
        self._per_position = owner._new(
            counter,
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted tokens per draft position.",
        )
        self._positions: dict[int, Any] = {}

    def accepted_at(self, position: int) -> Any:
        """The accepted-tokens counter of draft position `position` (0: the first draft)."""
        if position not in self._positions:
            labels = {**self._owner._labels, "position": str(position)}
            with self._owner._publish:
                self._positions[position] = self._per_position.Metric(labels=labels)
        return self._positions[position]
