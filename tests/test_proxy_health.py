"""The DI proxy's /metrics (`server/proxy_health.py`): valid Prometheus text whatever the URLs hold (read back
with prometheus_client's own parser)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gigadecode.server import proxy_health
from gigadecode.server.proxy_pool import Pool


def test_metrics_escape_label_values():
    """Prometheus text format: a backslash, a double quote and a newline in a label value are written \\\\, \\"
    and \\n; the parser reads back each URL as it was given."""
    urls = ['http://h:1/a"b', "http://h:2/a\\b", "http://h:3/a\nb", 'http://h:4/\\"\\n']
    text = proxy_health.metrics_text([Pool("decode", urls)])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("gigadecode_proxy_upstream_in_flight", "gigadecode_proxy_upstream_in_rotation"):
        assert [s.labels for s in families[name].samples] == [{"role": "decode", "url": u} for u in urls]
