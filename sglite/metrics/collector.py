"""Prometheus metrics with SGLang's names and labels (SGLang: metrics/collector.py).

The server's processes share one registry through prometheus_client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR is set before prometheus_client is imported anywhere): the
Scheduler process writes its gauges, the TokenizerManager (the HTTP server's process)
its counters and histograms, and /metrics reads them all. Gauges keep the most recent
value written (``multiprocess_mode="mostrecent"``).
"""

from __future__ import annotations

import time
from typing import Any

METRICS_INTERVAL = 0.5  # seconds between updates of the scheduler's gauges
# SGLang's buckets (seconds)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4,
               0.6, 0.8, 1, 2, 4, 6, 8)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160, 200, 400, 800, 1200, 2400)
SCHEDULER_GAUGES = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_grammar_queue_reqs": "The number of requests in the grammar waiting queue.",
    "num_used_tokens": "The number of KV tokens held by requests.",
    "token_usage": "The token usage (share of the KV pool held by requests).",
    "gen_throughput": "The generation throughput (token/s).",
    "cache_hit_rate": "The prefix cache hit rate.",
    "num_retracted_reqs": "The number of retracted requests so far.",
    "new_token_ratio": "The new token ratio admission reserves for running requests.",
    "max_total_num_tokens": "The KV pool size in tokens.",
}


# SGLang's queue_time_seconds buckets
QUEUE_BUCKETS = (0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500,
                 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
RETRACTION_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 75, 100)


def labels_for(model_name: str) -> dict[str, str]:
    """The scheduler's labels (SGLang's: the tokenizer side has only the first two)."""
    return {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


def tokenizer_labels(labels: dict[str, str]) -> dict[str, str]:
    return {k: labels[k] for k in ("model_name", "engine_type")}


class SchedulerMetricsCollector:
    """The scheduler's gauges, updated at most every METRICS_INTERVAL seconds, and its
    counters and histogram, from the scheduler's events (subscribe ``on_event``)."""

    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Counter, Gauge, Histogram

        self.labels, self._last = labels, 0.0
        self.gauges = {n: Gauge(f"sglang:{n}", doc, list(labels), multiprocess_mode="mostrecent")
                       for n, doc in SCHEDULER_GAUGES.items()}
        names = list(labels)
        self.retracted_requests = Counter("sglang:num_retracted_requests_total", "Retracted requests.",
                                          names).labels(**labels)
        self.retracted_input = Counter("sglang:num_retracted_input_tokens_total",
                                       "Prompt tokens of retracted requests (to prefill again unless cached).",
                                       names).labels(**labels)
        self.retracted_output = Counter("sglang:num_retracted_output_tokens_total",
                                        "Output tokens of retracted requests (to prefill again unless cached).",
                                        names).labels(**labels)
        realtime = Counter("sglang:realtime_tokens_total", "Tokens processed, by mode: prefill_compute (prompt "
                           "rows computed), prefill_cache (prompt tokens served from the prefix cache), decode.",
                           names + ["mode"])
        self.realtime = {mode: realtime.labels(**labels, mode=mode)
                         for mode in ("prefill_compute", "prefill_cache", "decode")}
        self.queue_time = Histogram("sglang:queue_time_seconds", "Time a request waited before its first forward.",
                                    names, buckets=QUEUE_BUCKETS).labels(**labels)
        self._arrived: dict[str, float] = {}  # rid -> its arrival (event ts), until its first admission
        self._decoding: set[str] = set()  # rids whose first token came

    def on_event(self, e: Any) -> None:
        """Counters and the queue-time histogram from the scheduler's events."""
        from sglite import events as ev

        if isinstance(e, ev.ReqArrived):
            self._arrived[e.rid] = e.ts
        elif isinstance(e, ev.ReqAdmitted):
            self.realtime["prefill_compute"].inc(e.extend_len)
            self.realtime["prefill_cache"].inc(e.prefix_len)
            arrived = self._arrived.pop(e.rid, None)
            if arrived is not None:
                self.queue_time.observe(max(0.0, e.ts - arrived))
        elif isinstance(e, ev.ReqRetracted):
            self.retracted_requests.inc()
            self.retracted_output.inc(e.output_tokens)
            self.retracted_input.inc(max(0, e.kept_tokens + e.recompute_tokens - e.output_tokens))
        elif isinstance(e, (ev.ReqAborted, ev.ReqFinished)):
            self._arrived.pop(e.rid, None)

    def on_output(self, rid: str, new_tokens: int, finished: bool) -> None:
        """A request's tokens sent out: its first came from its prefill, the rest from
        decode rounds (realtime_tokens_total{mode="decode"})."""
        if new_tokens:
            first = rid not in self._decoding
            self._decoding.add(rid)
            self.realtime["decode"].inc(new_tokens - first)
        if finished:
            self._decoding.discard(rid)

    @staticmethod
    def kinds() -> tuple[type, ...]:
        """The events ``on_event`` reads."""
        from sglite import events as ev

        return ev.ReqArrived, ev.ReqAdmitted, ev.ReqRetracted, ev.ReqAborted, ev.ReqFinished

    def update(self, scheduler: Any, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < METRICS_INTERVAL:
            return
        self._last = now
        state = scheduler.observer.internal_state()
        state["gen_throughput"] = state.pop("last_gen_throughput")
        for name, gauge in self.gauges.items():
            gauge.labels(**self.labels).set(state[name])


class TokenizerMetricsCollector:
    """The request-side counters and latency histograms."""

    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Counter, Histogram

        names = list(labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"sglang:{name}", doc, names).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"sglang:{name}", doc, names, buckets=buckets).labels(**labels)

        self.prompt_tokens_total = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens_total = counter("generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens_total = counter("cached_tokens", "Number of prompt tokens served from the prefix cache.")
        self.num_requests_total = counter("num_requests", "Number of requests finished.")
        self.num_aborted_requests_total = counter("num_aborted_requests", "Number of requests aborted.")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                                             E2E_BUCKETS)
        self.num_retractions = histogram("num_retractions", "Times a finished request was retracted.",
                                         RETRACTION_BUCKETS)

    def observe_finished(self, meta: dict[str, Any], e2e: float) -> None:
        self.prompt_tokens_total.inc(meta.get("prompt_tokens", 0))
        self.generation_tokens_total.inc(meta.get("completion_tokens", 0))
        self.cached_tokens_total.inc(meta.get("cached_tokens", 0))
        self.num_requests_total.inc()
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            self.num_aborted_requests_total.inc()
        self.e2e_request_latency.observe(e2e)
        self.num_retractions.observe(meta.get("retraction_count", 0))
