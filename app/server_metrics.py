"""`cadence serve`'s GET /metrics: Prometheus text with vLLM's metric names under a ``cadence:`` prefix,
so dashboards made for vLLM read it. What each request adds (tokens, latencies) is counted as answers
finish; what the engine holds (slots running, waiting, lane width, drafting counts since it started) is
read from ``Engine.status()`` at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class EngineCollector:
    """Gauges and counters read from the engine at scrape time, one series per served model."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        running = GaugeMetricFamily("cadence:num_requests_running", "Requests in a decode slot.", labels=["model_name"])
        waiting = GaugeMetricFamily("cadence:num_requests_waiting", "Requests waiting for a slot.", labels=["model_name"])
        width = GaugeMetricFamily("cadence:lane_width", "Slots the model's lane decodes together.", labels=["model_name"])
        drafts = CounterMetricFamily("cadence:spec_decode_num_drafts", "Steps that checked drafted tokens.",
                                     labels=["model_name"])
        draft_tokens = CounterMetricFamily("cadence:spec_decode_num_draft_tokens", "Drafted tokens checked.",
                                           labels=["model_name"])
        accepted = CounterMetricFamily("cadence:spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
                                       labels=["model_name"])
        per_position = CounterMetricFamily("cadence:spec_decode_num_accepted_tokens_per_pos",
                                           "Drafted tokens accepted, by their position in the draft.",
                                           labels=["model_name", "position"])
        for model, lane in self.engine.status()["lanes"].items():
            running.add_metric([model], sum(slot is not None for slot in lane["slots"]))
            waiting.add_metric([model], lane["waiting"])
            width.add_metric([model], lane["width"])
            counts = lane["drafting"]["counts"]
            drafts.add_metric([model], counts["verifications"])
            draft_tokens.add_metric([model], counts["drafted"])
            accepted.add_metric([model], counts["accepted"])
            for position, value in enumerate(counts["accepted_at"]):
                per_position.add_metric([model, str(position)], value)
        yield from (running, waiting, width, drafts, draft_tokens, accepted, per_position)


class ServerMetrics:
    """The registry behind /metrics (one per server, so two servers in one process never mix)."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        labels = ["model_name"]
        self.prompt_tokens = Counter("cadence:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("cadence:generation_tokens", "Tokens generated for finished requests.", labels,
                                         registry=self.registry)
        self.requests = Counter("cadence:request_success", "Finished requests, by why they finished.",
                                labels + ["finished_reason"], registry=self.registry)
        self.first_token = Histogram("cadence:time_to_first_token_seconds", "From a request's start to its first token.",
                                     labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.per_token = Histogram("cadence:time_per_output_token_seconds", "Time between tokens after the first.",
                                   labels, buckets=TOKEN_BUCKETS, registry=self.registry)
        self.end_to_end = Histogram("cadence:e2e_request_latency_seconds", "From a request's start to its last token.",
                                    labels, buckets=LATENCY_BUCKETS, registry=self.registry)

    def finished(self, model: str, answer, reason: str) -> None:
        stats = answer.stats
        self.prompt_tokens.labels(model).inc(int(stats.get("prompt_tokens", 0)))
        self.generation_tokens.labels(model).inc(len(answer.tokens))
        self.requests.labels(model, reason).inc()
        if stats.get("time_to_first_token") is not None:
            self.first_token.labels(model).observe(float(stats["time_to_first_token"]))
        if stats.get("end_to_end") is not None:
            self.end_to_end.labels(model).observe(float(stats["end_to_end"]))
        if stats.get("decode_tok_s"):
            self.per_token.labels(model).observe(1.0 / float(stats["decode_tok_s"]))

    def text(self) -> bytes:
        return generate_latest(self.registry)
