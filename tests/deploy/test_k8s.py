"""The Kubernetes files: probes on the right routes, a drain that outlasts --shutdown-timeout, scaling on the
waiting queue."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is a dev dependency (pip install -e '.[dev]')")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def load_all() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(values) == 1, f"{name} given {len(values)} times"
    return values[0]


def test_deployment_probes_and_graceful_drain():
    dep = load_all()["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][0] == "serve"
    port = int(flag(c["args"], "--port"))
    assert {p["containerPort"] for p in c["ports"]} == {port}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    shutdown = float(flag(c["args"], "--shutdown-timeout"))
    assert pod["terminationGracePeriodSeconds"] > shutdown + float(pre_stop[1])
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_service_selects_the_pods():
    docs = load_all()
    svc, dep = docs["Service"], docs["Deployment"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    named = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named


def test_autoscaling_on_the_waiting_queue():
    docs = load_all()
    so = docs["ScaledObject"]
    assert so["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) > 0
    assert 1 <= so["spec"]["minReplicaCount"] < so["spec"]["maxReplicaCount"]
