"""The engine's Prometheus metrics under vLLM's names, beside its own on `/metrics`, so a dashboard or alert
written for vLLM's V1 engine reads a gigadecode server unchanged: `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:request_success_total{finished_reason}`, `vllm:time_to_first_token_seconds`,
... each labelled `model_name` (the served model name) and `engine` ("0"), as vLLM labels them.

A view, not a second set of counters: each scrape renames what the engine's own registry holds at that
moment (`VLLM_NAMES`), so the two sets never disagree. vLLM's queue-time and per-request token-count
histograms have no counterpart here and are left out.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

# gigadecode family name -> vLLM's (counters without their `_total`, as prometheus_client names families)
VLLM_NAMES = {
    "gigadecode_requests_running": "vllm:num_requests_running",
    "gigadecode_requests_waiting": "vllm:num_requests_waiting",
    "gigadecode_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "gigadecode_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "gigadecode_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "gigadecode_requests": "vllm:request_success",
    "gigadecode_prompt_tokens": "vllm:prompt_tokens",
    "gigadecode_generation_tokens": "vllm:generation_tokens",
    "gigadecode_num_preemptions": "vllm:num_preemptions",
    "gigadecode_prefix_cache_queries": "vllm:prefix_cache_queries",
    "gigadecode_prefix_cache_hits": "vllm:prefix_cache_hits",
    "gigadecode_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "gigadecode_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "gigadecode_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
RENAMED_LABELS = {"finish_reason": "finished_reason"}


class _VllmView:
    """A collector over another registry's families: those in VLLM_NAMES renamed and labelled, plus
    `vllm:kv_cache_usage_perc` (blocks used / total, 0..1)."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source, self.labels = source, {"model_name": model_name, "engine": "0"}

    def collect(self):
        kv: dict[str, float] = {}
        for fam in self.source.collect():
            if fam.name in ("gigadecode_kv_blocks_used", "gigadecode_kv_blocks_total") and fam.samples:
                kv[fam.name] = fam.samples[0].value
            new = VLLM_NAMES.get(fam.name)
            if new is None:
                continue
            out = Metric(new, fam.documentation, fam.type)
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                labels = {RENAMED_LABELS.get(k, k): v for k, v in s.labels.items()}
                out.add_sample(new + s.name[len(fam.name):], {**labels, **self.labels}, s.value, s.timestamp,
                               s.exemplar)
            yield out
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage: the fraction of KV blocks in use "
                                  "(0 to 1).", labels=list(self.labels))
        total = kv.get("gigadecode_kv_blocks_total", 0.0)
        usage.add_metric(list(self.labels.values()), kv.get("gigadecode_kv_blocks_used", 0.0) / total if total else 0.0)
        yield usage


def vllm_metrics_text(source: CollectorRegistry, model_name: str) -> bytes:
    """The Prometheus text of `source`'s families under vLLM's names (appended to the engine's own)."""
    view = CollectorRegistry(auto_describe=False)
    view.register(_VllmView(source, model_name))
    return generate_latest(view)
