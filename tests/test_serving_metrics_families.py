"""dspark.serving.metrics without Triton: what each adapter event does to the metric families."""

from __future__ import annotations

import random

from dspark.outputs import EngineLoad, SpecStats
from dspark.serving.metrics import (
    REQUEST_OBSERVATIONS_PER_S,
    UPDATE_OBSERVATIONS_PER_S,
    Metrics,
    TritonMetrics,
)


class FakeFamily:
    """Stands in for triton_python_backend_utils.MetricFamily; records every sample."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict[str, FakeFamily] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, {}
        FakeFamily.created[name] = self

    def Metric(self, labels: dict, buckets: list[float] | None = None) -> FakeMetric:  # noqa: N802 - Triton's name
        metric = FakeMetric(buckets)
        self.metrics[tuple(sorted(labels.items()))] = metric
        return metric


class FakeMetric:
    def __init__(self, buckets: list[float] | None) -> None:
        self.value, self.observed, self.buckets = 0.0, [], buckets

    def increment(self, amount: float) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        self.observed.append(value)


def metric(name: str, **labels: str) -> FakeMetric:
    family = FakeFamily.created[name]
    for key, value in family.metrics.items():
        if all((k, v) in key for k, v in labels.items()):
            return value
    raise KeyError(name)


def make() -> TritonMetrics:
    FakeFamily.created = {}
    return TritonMetrics(FakeFamily, {"model": "dspark", "version": "1"}, max_model_len=512)


def stats_after(*steps: tuple[int, int, int]) -> dict:
    stats = SpecStats()
    for step in steps:
        stats.record_step(*step)
    return stats.as_dict()


def test_nothing_is_published_before_a_flush():
    metrics = make()
    metrics.request_finished("stop")
    metrics.load(EngineLoad(num_running=1, num_waiting=0, kv_pages_used=2, kv_pages_total=8))
    assert metric("dspark_kv_pages_used").value == 0
    metrics.flush()
    assert metric("dspark_kv_pages_used").value == 2
    assert metric("dspark_requests_total", finish_reason="stop").value == 1


def test_speculation_counters_add_each_request_s_progress_once():
    metrics = make()
    first = stats_after((7, 3, 2))
    metrics.speculation(None, first)
    metrics.speculation(first, stats_after((7, 3, 2), (7, 2, 0)))
    metrics.flush()
    assert metric("dspark_spec_drafted_tokens_total").value == 14
    assert metric("dspark_spec_verified_tokens_total").value == 5
    assert metric("dspark_spec_accepted_tokens_total").value == 2
    assert metric("dspark_spec_steps_total").value == 2
    assert metric("dspark_spec_drafting_steps_total").value == 2


def test_plain_steps_count_as_steps_but_not_as_drafting_steps():
    metrics = make()
    metrics.speculation(None, stats_after((7, 3, 2), (0, 0, 0), (0, 0, 0)))
    metrics.flush()
    assert metric("dspark_spec_steps_total").value == 3
    assert metric("dspark_spec_drafting_steps_total").value == 1


def test_gauges_give_mean_window_acceptance_length_and_per_position_rates_of_the_engine_s_totals():
    """The gauges are ratios of the engine's totals over finished requests (`EngineLoad.spec`), not of
    one instance's requests: with several instances each would set them from its own share."""
    metrics = make()
    metrics.speculation(None, stats_after((1, 1, 1)))  # one instance's request in flight: no gauge
    metrics.flush()
    assert metric("dspark_spec_mean_acceptance_length").value == 0
    totals = SpecStats()
    for step in ((7, 3, 2), (7, 2, 0)):
        totals.record_step(*step)
    metrics.load(EngineLoad(0, 0, 0, 8, spec=totals))
    metrics.flush()
    assert metric("dspark_spec_mean_verify_window").value == (5 + 2) / 2
    assert metric("dspark_spec_mean_acceptance_length").value == (2 + 2) / 2
    assert metric("dspark_spec_acceptance_rate", position="1").value == 1 / 2
    assert metric("dspark_spec_acceptance_rate", position="2").value == 1 / 2
    assert metric("dspark_spec_acceptance_rate", position="3").value == 0.0


def test_the_gate_s_view_is_published_per_tier_and_draft_length():
    """`EngineLoad.gate` (the adaptive gate's view) as gauges: step seconds and chosen steps per tier
    and length, tokens a request per length; a length chosen but not yet measured has no step time."""
    metrics = make()
    view = (64, 0, 0.0012, 5, 40, 1.0) + (64, 3, 0.0015, 7, 300, 2.25) + (128, 3, 0.0, 0, 2, 2.25)
    metrics.load(EngineLoad(0, 0, 0, 8, gate=view))
    metrics.flush()
    assert metric("dspark_spec_gate_step_seconds", tier="64", length="0").value == 0.0012
    assert metric("dspark_spec_gate_step_seconds", tier="64", length="3").value == 0.0015
    assert metric("dspark_spec_gate_chosen_steps", tier="64", length="3").value == 300
    assert metric("dspark_spec_gate_chosen_steps", tier="128", length="3").value == 2
    assert metric("dspark_spec_gate_tokens_per_request", length="3").value == 2.25
    assert metric("dspark_spec_gate_tokens_per_request", length="0").value == 1.0
    families = FakeFamily.created
    tiers = {dict(key).get("tier") for key in families["dspark_spec_gate_step_seconds"].metrics}
    assert tiers == {"64"}  # tier 128's length 3 was chosen twice, never measured
    assert all("tier" not in dict(key) for key in families["dspark_spec_gate_tokens_per_request"].metrics)


def test_first_tokens_observe_ttft_and_each_later_update_its_per_token_latency():
    # One observation per update (as vLLM observes one per engine step): each observe is a round trip
    # to the server process, and an update carries every token committed since the last one.
    metrics = make()
    metrics.tokens_generated(1, since_arrival=0.2, since_last=None)
    metrics.tokens_generated(3, since_arrival=None, since_last=0.09)
    metrics.flush()
    assert metric("dspark_time_to_first_token_seconds").observed == [0.2]
    assert metric("dspark_inter_token_latency_seconds").observed == [0.03]
    assert metric("dspark_generation_tokens_total").value == 4


def test_requests_are_counted_by_finish_reason_and_load_sets_the_gauges():
    metrics = make()
    for reason in ("stop", "length", "stop", "invalid"):
        metrics.request_finished(reason)
    metrics.flush()
    assert metric("dspark_requests_total", finish_reason="stop").value == 2
    assert metric("dspark_requests_total", finish_reason="invalid").value == 1
    metrics.load(EngineLoad(num_running=3, num_waiting=1, kv_pages_used=40, kv_pages_total=96))
    metrics.flush()
    assert metric("dspark_kv_pages_used").value == 40 and metric("dspark_kv_pages_total").value == 96
    assert (
        metric("dspark_num_requests_running").value == 3 and metric("dspark_num_requests_waiting").value == 1
    )


def test_disabled_metrics_accept_every_event_and_record_nothing():
    metrics = Metrics()
    metrics.request_finished("stop")
    metrics.tokens_generated(2, 0.1, None)
    metrics.speculation(None, stats_after((7, 1, 1)))
    metrics.load(EngineLoad(0, 0, 0, 1))
    metrics.flush()


def test_engine_loop_counters_move_by_the_difference_between_loads():
    from dspark.outputs import LoopTotals

    metrics = make()

    def load(**totals: float) -> None:
        metrics.load(EngineLoad(0, 0, 0, 8, loop=LoopTotals(**totals)))
        metrics.flush()

    load(steps=10, step_requests=40, graph_steps=8, step_seconds=0.5, idle_seconds=2.0)
    load(steps=15, step_requests=60, graph_steps=12, ahead_steps=3, step_seconds=0.75, idle_seconds=2.0)
    assert metric("dspark_engine_steps_total").value == 15
    assert metric("dspark_engine_graph_steps_total").value == 12
    assert metric("dspark_engine_ahead_steps_total").value == 3
    assert metric("dspark_engine_prefill_steps_total").value == 0
    assert metric("dspark_engine_step_requests_total").value == 60
    assert abs(metric("dspark_engine_step_seconds_total").value - 0.75) < 1e-9
    assert metric("dspark_engine_idle_seconds_total").value == 2.0
    # A restarted engine's totals start over: they add from zero, the counters never go back.
    load(steps=3, step_requests=3, step_seconds=0.1)
    assert metric("dspark_engine_steps_total").value == 18
    assert metric("dspark_engine_idle_seconds_total").value == 2.0


def test_streamed_latencies_are_a_uniform_sample_of_at_most_the_budget_a_second():
    FakeFamily.created = {}
    now = [0.0]
    metrics = TritonMetrics(
        FakeFamily, {"model": "dspark", "version": "1"}, 512, clock=lambda: now[0], rng=random.Random(0)
    )
    gaps = [0.001 * (1 + i % 100) for i in range(20_000)]  # 20,000 updates of one token in 2 s
    for gap in gaps:
        metrics.tokens_generated(1, since_arrival=None, since_last=gap)
    now[0] = 2.0
    metrics.flush()
    itl = list(metric("dspark_inter_token_latency_seconds").observed)
    assert len(itl) == 2 * UPDATE_OBSERVATIONS_PER_S
    assert metric("vllm:time_per_output_token_seconds").observed == itl
    assert set(itl) <= set(gaps)
    assert abs(sum(itl) / len(itl) - sum(gaps) / len(gaps)) < 0.005  # the mean holds (0.0505)
    assert metric("dspark_generation_tokens_total").value == 20_000  # counters stay exact
    for gap in gaps[:10]:  # fewer than the budget: every one
        metrics.tokens_generated(2, since_arrival=None, since_last=gap)
    now[0] = 3.0
    metrics.flush()
    assert metric("dspark_inter_token_latency_seconds").observed[len(itl) :] == [g / 2 for g in gaps[:10]]


def test_per_request_histograms_are_a_uniform_sample_of_at_most_the_budget_a_second():
    FakeFamily.created = {}
    now = [0.0]
    metrics = TritonMetrics(
        FakeFamily, {"model": "dspark", "version": "1"}, 512, clock=lambda: now[0], rng=random.Random(1)
    )
    requests = 5 * REQUEST_OBSERVATIONS_PER_S  # in 2 s: 2.5x the budget
    for i in range(requests):
        metrics.tokens_generated(1, since_arrival=0.01 * (1 + i % 50), since_last=None)
        metrics.request_completed(prompt_tokens=10 + i % 7, generation_tokens=100, e2e_latency=1.0 + i % 3)
        metrics.request_finished("length")
    now[0] = 2.0
    metrics.flush()
    ttft = list(metric("dspark_time_to_first_token_seconds").observed)
    assert len(ttft) == 2 * REQUEST_OBSERVATIONS_PER_S
    assert metric("vllm:time_to_first_token_seconds").observed == ttft
    assert abs(sum(ttft) / len(ttft) - 0.255) < 0.03  # the mean holds
    e2e = metric("vllm:e2e_request_latency_seconds").observed
    assert len(e2e) == len(metric("vllm:request_prompt_tokens").observed) == 2 * REQUEST_OBSERVATIONS_PER_S
    assert metric("vllm:request_params_n").observed == [1] * len(e2e)
    assert metric("dspark_generation_tokens_total").value == requests  # counters stay exact
    metrics.tokens_generated(1, since_arrival=0.5, since_last=None)  # fewer than the budget: every one
    now[0] = 3.0
    metrics.flush()
    assert metric("dspark_time_to_first_token_seconds").observed[len(ttft) :] == [0.5]


def test_a_models_instances_split_the_sampling_budgets_between_them():
    FakeFamily.created = {}
    now = [0.0]
    instances = 4
    metrics = TritonMetrics(
        FakeFamily,
        {"model": "dspark", "version": "1"},
        512,
        clock=lambda: now[0],
        rng=random.Random(2),
        instances=instances,
    )
    for i in range(10_000):  # in 2 s: far over either budget
        metrics.tokens_generated(1, since_arrival=0.01 if i % 10 == 0 else None, since_last=0.002)
        if i % 10 == 0:
            metrics.request_completed(prompt_tokens=10, generation_tokens=10, e2e_latency=0.1)
    now[0] = 2.0
    metrics.flush()
    # Each of the 4 stubs observes a quarter: together the families get the budgets their help states.
    assert (
        len(metric("dspark_inter_token_latency_seconds").observed)
        == 2 * UPDATE_OBSERVATIONS_PER_S // instances
    )
    assert (
        len(metric("dspark_time_to_first_token_seconds").observed)
        == 2 * REQUEST_OBSERVATIONS_PER_S // instances
    )
    assert (
        len(metric("vllm:e2e_request_latency_seconds").observed)
        == 2 * REQUEST_OBSERVATIONS_PER_S // instances
    )
    assert metric("dspark_generation_tokens_total").value == 10_000  # counters stay exact
