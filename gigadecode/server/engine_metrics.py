"""The server's Prometheus metrics: `EngineMetrics`, one registry per engine (several apps may live in one
process): latency histograms and request counters the engine thread updates as outputs arrive, and gauges
and engine-owned counters read from a snapshot it refreshes after each step (`_SnapshotCollector`).
`vllm_metrics.py` serves the same values again under vLLM's names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


# --------------------------------------------------------------------------------------------------
class _SnapshotCollector:
    """Gauges and engine-owned counters, read from a snapshot the engine thread refreshes each step."""

    def __init__(self, snap: dict[str, float], loop_age: Callable[[], float]) -> None:
        self.snap, self.loop_age = snap, loop_age

    def collect(self):
        s = dict(self.snap)
        g = GaugeMetricFamily("gigadecode_engine_loop_age_seconds",
                              "Seconds since the engine loop last showed progress (a step, or a wait for work); "
                              "past --engine-stall-timeout-s /health answers 503 engine_stalled.")
        g.add_metric([], self.loop_age())
        yield g
        for name, doc, key in (
                ("gigadecode_requests_running", "Requests in the engine's running set.", "running"),
                ("gigadecode_requests_waiting", "Requests waiting to be scheduled.", "waiting"),
                ("gigadecode_kv_blocks_used", "KV cache blocks in use (null block excluded).", "kv_blocks_used"),
                ("gigadecode_kv_blocks_total", "Usable KV cache blocks (null block excluded).", "kv_blocks_total"),
                ("gigadecode_kv_leases", "Prefill: requests whose KV is held for a decode server's read.", "kv_leases")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], s.get(key, 0))
            yield g
        for name, doc, i in (("gigadecode_kv_rank_blocks_used", "KV cache blocks in use on each rank's own pool.", 0),
                             ("gigadecode_kv_rank_blocks_total", "Usable KV cache blocks of each rank's own pool.", 1)):
            g = GaugeMetricFamily(name, doc, labels=["rank"])
            for rank, kv in sorted(s.get("kv_per_rank", {}).items()):
                g.add_metric([str(rank)], kv[i])
            yield g
        for name, doc, key in (
                ("gigadecode_kv_bytes_transferred", "Bytes of KV moved by the KV connector.", "kv_bytes"),
                ("gigadecode_kv_transfer_failures", "KV transfers that failed.", "transfer_failures"),
                ("gigadecode_num_preemptions", "Requests preempted (KV freed, recomputed later) when the KV pool "
                 "was short.", "preemptions"),
                ("gigadecode_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
                ("gigadecode_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).",
                 "prefix_hits"),
                ("gigadecode_spec_decode_num_drafts",
                 "Speculative decoding: request-steps that verified drafts (mean accepted length: 1 + accepted / this).",
                 "spec_drafts"),
                ("gigadecode_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
                 "spec_draft_tokens"),
                ("gigadecode_spec_decode_num_accepted_tokens",
                 "Speculative decoding: draft tokens accepted (tokens that took no decode step of their own).",
                 "spec_accepted")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], s.get(key, 0))
            yield c


class EngineMetrics:
    """Prometheus metrics of one engine (own registry: several apps may live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("gigadecode_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gigadecode_inter_token_latency_seconds",
                             "Time between two consecutive generated tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("gigadecode_e2e_request_latency_seconds",
                             "Time from request arrival to its end.", buckets=TTFT_BUCKETS, registry=r)
        self.requests = Counter("gigadecode_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("gigadecode_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("gigadecode_generation_tokens", "Generated tokens.", registry=r)
        self.step_failures = Counter("gigadecode_engine_step_failures",
                                     "Engine step phases that raised (each failed only its own requests).",
                                     registry=r)
        self.snapshot: dict[str, float] = {}
        # seconds since the engine loop last showed progress, read at scrape time (a stalled engine thread
        # refreshes no snapshot); `AsyncEngine` sets it
        self.loop_age: Callable[[], float] = lambda: 0.0
        r.register(_SnapshotCollector(self.snapshot, lambda: self.loop_age()))

    def refresh(self, engine: Any) -> None:
        """Engine thread: read the gauges and the engine's counters."""
        s = self.snapshot
        s["running"] = len(engine.running)
        s["waiting"] = len(engine.waiting)
        s["kv_blocks_used"], s["kv_blocks_total"] = engine.kv_usage()
        per_rank = getattr(engine, "kv_usage_per_rank", None)
        s["kv_per_rank"] = per_rank() if per_rank is not None else {}
        s["kv_bytes"] = engine.stats.kv_bytes_transferred
        s["transfer_failures"] = engine.stats.transfer_failures
        s["preemptions"] = engine.stats.preemptions
        s["prefix_queries"] = engine.stats.prefix_cache_queries
        s["prefix_hits"] = engine.stats.prefix_cache_hits
        s["spec_drafts"] = engine.stats.spec_drafts
        s["spec_draft_tokens"] = engine.stats.spec_draft_tokens
        s["spec_accepted"] = engine.stats.spec_accepted_tokens
        leases = getattr(engine, "num_leases", None)
        s["kv_leases"] = leases() if leases is not None else 0
