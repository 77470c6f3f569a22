"""Serving metrics, published as Prometheus families through Triton's metrics port.

The Triton adapter reports every request event here from its response thread (one thread, so no
locking) and calls `flush()` between sends. `Metrics` records nothing (metrics disabled);
`TritonMetrics` writes to `triton_python_backend_utils.MetricFamily`, passed in so that this module
imports without Triton. Each metric update is a round trip to the server process (tens of µs), so
counters and gauges are summed here and written once per flush; histograms are observed as events come.
"""

from __future__ import annotations

from typing import Any

from dspark.outputs import EngineLoad

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
SPEC_COUNTERS = ("drafted_tokens", "verified_tokens", "accepted_tokens", "steps", "drafting_steps")


class Metrics:
    """The events the adapter reports. This base class is the disabled case: it records nothing."""

    def request_finished(self, finish_reason: str) -> None:
        """A request ended: stop, length, abort, error, or invalid (rejected before it started)."""

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

    def __init__(self, family: Any, labels: dict[str, str]) -> None:
        self._family = family
        self._labels = dict(labels)
        self._families: list[Any] = []  # a family is unregistered when garbage-collected
        self._requests = self._new(
            family.COUNTER, "dspark_requests_total", "Finished requests, by finish reason"
        )
        self._by_reason: dict[str, Any] = {}
        self._prompt = self._metric(family.COUNTER, "dspark_prompt_tokens_total", "Prompt tokens admitted")
        self._generated = self._metric(family.COUNTER, "dspark_generation_tokens_total", "Tokens generated")
        self._ttft = self._metric(
            family.HISTOGRAM,
            "dspark_time_to_first_token_seconds",
            "Seconds from request arrival to its first streamed token",
            buckets=TTFT_BUCKETS,
        )
        self._itl = self._metric(
            family.HISTOGRAM,
            "dspark_inter_token_latency_seconds",
            "Seconds between streamed tokens (a step's gap divided by the tokens it committed)",
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
            "Mean target tokens verified per request step (1 + drafts)",
        )
        self._accept_length = self._metric(
            family.GAUGE, "dspark_spec_mean_acceptance_length", "Mean tokens committed per request step (tau)"
        )
        self._position_rate = self._new(
            family.GAUGE,
            "dspark_spec_acceptance_rate",
            "Fraction of verified drafts accepted, by draft position (1 = first draft)",
        )
        self._positions: dict[int, Any] = {}
        self._kv_used = self._metric(family.GAUGE, "dspark_kv_pages_used", "KV-cache pages in use")
        self._kv_total = self._metric(family.GAUGE, "dspark_kv_pages_total", "KV-cache pages in all")
        self._running = self._metric(family.GAUGE, "dspark_num_requests_running", "Requests decoding")
        self._waiting = self._metric(family.GAUGE, "dspark_num_requests_waiting", "Requests waiting to start")
        self._totals = dict.fromkeys(SPEC_COUNTERS, 0)
        self._accepted_at: list[int] = []
        self._verified_at: list[int] = []
        self._pending: dict[Any, float] = {}  # counter -> increment not yet published
        self._gauges: dict[Any, float] = {}  # gauge -> value not yet published

    def request_finished(self, finish_reason: str) -> None:
        if finish_reason not in self._by_reason:
            self._by_reason[finish_reason] = self._requests.Metric(
                labels={**self._labels, "finish_reason": finish_reason}
            )
        self._add(self._by_reason[finish_reason], 1)

    def prompt_tokens(self, count: int) -> None:
        self._add(self._prompt, count)

    def tokens_generated(self, count: int, since_arrival: float | None, since_last: float | None) -> None:
        if count <= 0:
            return
        self._add(self._generated, count)
        if since_arrival is not None:
            self._ttft.observe(since_arrival)
        elif since_last is not None:
            per_token = since_last / count
            for _ in range(count):
                self._itl.observe(per_token)

    def speculation(self, before: dict | None, after: dict) -> None:
        before = before or {}
        for name in SPEC_COUNTERS:
            step = after.get(name, 0) - before.get(name, 0)
            if step > 0:
                self._add(self._spec[name], step)
                self._totals[name] += step
        _add_differences(
            self._accepted_at, before.get("accepted_per_position", []), after["accepted_per_position"]
        )
        _add_differences(
            self._verified_at, before.get("verified_per_position", []), after["verified_per_position"]
        )
        steps = self._totals["steps"]
        if steps:
            self._gauges[self._verify_window] = (self._totals["verified_tokens"] + steps) / steps
            self._gauges[self._accept_length] = (self._totals["accepted_tokens"] + steps) / steps
        for k, verified in enumerate(self._verified_at):
            if verified:
                self._gauges[self._position(k + 1)] = self._accepted_at[k] / verified

    def load(self, load: EngineLoad) -> None:
        self._gauges[self._kv_used] = load.kv_pages_used
        self._gauges[self._kv_total] = load.kv_pages_total
        self._gauges[self._running] = load.num_running
        self._gauges[self._waiting] = load.num_waiting

    def flush(self) -> None:
        for counter, amount in self._pending.items():
            counter.increment(amount)
        for gauge, value in self._gauges.items():
            gauge.set(value)
        self._pending.clear()
        self._gauges.clear()

    def _add(self, counter: Any, amount: float) -> None:
        self._pending[counter] = self._pending.get(counter, 0) + amount

    def _position(self, position: int) -> Any:
        if position not in self._positions:
            labels = {**self._labels, "position": str(position)}
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


def _add_differences(totals: list[int], before: list[int], after: list[int]) -> None:
    """totals[k] += after[k] - before[k], growing `totals` as positions appear."""
    totals.extend([0] * max(len(after) - len(totals), 0))
    for k, count in enumerate(after):
        totals[k] += count - (before[k] if k < len(before) else 0)
