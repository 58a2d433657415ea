"""The Grafana dashboard: well-formed, every query valid PromQL, every metric it reads one the server exports."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests_support.promql import dashboard_queries, metric_names

from quantkit.serve.keyring import ApiKey, KeyRing
from quantkit.serve.metrics import ServerMetrics

REQUIRED_PANELS = ("Time to first token", "Inter-token latency", "End-to-end", "Token throughput", "running",
                   "KV-cache usage", "Prefix-cache hit rate", "Preemptions", "by reason", "Rejected")


def exported_sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metric_names_of_a_query():
    expr = 'histogram_quantile(0.9, sum by (le) (rate(vllm:x_bucket{model_name=~".*"}[1m]))) / 1e3'
    assert metric_names(expr) == {"vllm:x_bucket"}
    assert metric_names("sum(a_total) / sum without (engine) (b) or on (instance) c") == {"a_total", "b", "c"}


def test_dashboard_has_the_panels_and_every_query_names_a_metric():
    queries = dashboard_queries()
    titles = {t for t, _ in queries}
    for want in REQUIRED_PANELS:
        assert any(want in t for t in titles), want
    assert all(metric_names(q) for _, q in queries)


def test_every_query_is_valid_promql(tmp_path):
    """Prometheus's own parser (promtool) reads each query as a recording rule."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; .ci/run installs it)")
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, (_, q) in enumerate(dashboard_queries()):
        rules += [f"      - record: dashboard:q{i}", f"        expr: '{q}'"]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(rules) + "\n")
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_metric_a_panel_reads_is_exported():
    """Against the families a server registers (the live-scrape version runs in tests/serve)."""
    metrics = ServerMetrics("m", max_model_len=64)
    metrics.register(KeyRing([ApiKey("a", "k")]))
    metrics.observe_http("/v1/completions", "POST", 200, 0.1)  # HTTP families appear with their first label set
    exported = exported_sample_names(metrics.render().decode())
    for title, q in dashboard_queries():
        missing = metric_names(q) - exported
        assert not missing, f"panel {title!r} reads {missing}, which the server does not export"
